"""The batch engine (model runner): one batched Mimi encode, LM step and Mimi decode per 80 ms tick.

The engine owns a fixed number of slots B. Each slot is FREE, PROMPTING (its persona is being fed in) or
LIVE (a conversation). It knows nothing of sockets or sessions: the tick loop hands it one PCM frame per
slot and gets one PCM frame and one text token per slot back.

Batching rests on moshi's streaming API (moshi 0.2.13, ``modules/streaming.py``):

- ``reset_streaming(mask)`` resets only the rows of a joining slot; the others keep their KV caches.
- ``set_exec_mask(mask)`` freezes rows whose mask is False for that call: free slots, slots waiting for
  their first frame, and (during a prompt step) every slot that is not prompting.
- ``LMGen(support_out_of_sync=True)``: rows still inside the acoustic delay return token -2; those are
  neither decoded nor sent.

Per-slot sampling and teacher forcing (persona prompts) are done by :class:`SlotLMGen`, a subclass of
moshi's ``LMGen`` that samples with :class:`runtime.sampling.SlotSamplingTable` and overwrites the tokens
of forced rows in place before they are fed back.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from moshi.models.lm import LMGen

from runtime.model_presets import FRAME_MS, FRAME_SAMPLES
from runtime.models import ModelBundle
from runtime.sampling import SamplingParams, SlotSamplingTable

UNGENERATED_TOKEN = -2
"""What ``LMGen(support_out_of_sync=True)`` returns for rows still warming up or masked."""
NOT_FORCED = -1
TEXT_PADDING_IDS = (0, 3)
"""Kyutai's text ids that are padding (end-of-text padding 0, padding 3): never sent to clients."""


class SlotPhase(enum.Enum):
    FREE = "free"
    PROMPTING = "prompting"
    LIVE = "live"


@dataclass(frozen=True)
class PromptStep:
    """One teacher-forced LM step of a persona prompt.

    Attributes:
        user_codes: ``[n_q - dep_q]`` int64 codes fed as the user's audio (PersonaPlex: a 440 Hz sine).
        text_token: forced text token, or ``NOT_FORCED``.
        agent_codes: ``[dep_q]`` int64 forced agent audio codes (the voice prompt), or None to let the
            model generate.
    """

    user_codes: torch.Tensor
    text_token: int = NOT_FORCED
    agent_codes: torch.Tensor | None = None


class _Forcing:
    """Teacher-forced tokens for the next LM step, ``NOT_FORCED`` where free. Tensors updated in place."""

    def __init__(self, slots: int, dep_q: int, device: torch.device) -> None:
        self.text = torch.full((slots,), NOT_FORCED, dtype=torch.int64, device=device)
        self.audio = torch.full((slots, dep_q), NOT_FORCED, dtype=torch.int64, device=device)

    def clear(self) -> None:
        self.text.fill_(NOT_FORCED)
        self.audio.fill_(NOT_FORCED)


class SlotLMGen(LMGen):
    """moshi's ``LMGen`` with per-slot sampling and per-slot teacher forcing.

    Text: moshi argmaxes (``use_sampling=False``), then ``on_text_hook`` replaces each row's token with the
    row's own sample, or its forced token. Audio: :meth:`depformer_step` is moshi's loop without CFG,
    sampling each codebook per row and feeding a forced code to the next codebook when one is given.
    Classifier-free guidance is not supported (``cfg_coef`` stays 1).
    """

    def __init__(self, lm_model, sampling: SlotSamplingTable, forcing: _Forcing) -> None:
        super().__init__(
            lm_model,
            use_sampling=False,
            support_out_of_sync=True,
            on_text_logits_hook=self._keep_text_logits,
            on_text_hook=self._resample_text,
        )
        self.sampling = sampling
        self.forcing = forcing
        self._text_logits: torch.Tensor | None = None

    def _keep_text_logits(self, text_logits: torch.Tensor) -> None:
        self._text_logits = text_logits  # [B, 1, 1, V_text]

    def _resample_text(self, text_token: torch.Tensor) -> None:
        assert self._text_logits is not None
        sampled = self.sampling.sample_text(self._text_logits[:, 0, 0])
        forced = self.forcing.text
        text_token.copy_(torch.where(forced >= 0, forced, sampled))

    def depformer_step(self, text_token: torch.Tensor, transformer_out: torch.Tensor) -> torch.Tensor:
        """``[B]`` text tokens, ``[B, 1, dim]`` transformer output -> ``[B, dep_q]`` audio tokens."""
        lm_model = self.lm_model
        batch = text_token.shape[0]
        previous = text_token
        tokens: list[torch.Tensor] = []
        assert lm_model.depformer is not None
        noise = self.sampling.audio_noise(lm_model.dep_q, lm_model.card)  # [B, dep_q, card], one draw
        with lm_model.depformer.streaming(batch):
            for codebook in range(lm_model.dep_q):
                logits = lm_model.forward_depformer(codebook, previous[:, None, None], transformer_out)
                sampled = self.sampling.sample_audio(logits[:, 0, 0], codebook, noise[:, codebook])
                forced = self.forcing.audio[:, codebook]
                previous = torch.where(forced >= 0, forced, sampled)
                tokens.append(previous)
        return torch.stack(tokens, dim=1)


@dataclass
class TickTimings:
    """Wall time of one tick's parts, in ms."""

    encode_ms: float = 0.0
    lm_ms: float = 0.0
    decode_ms: float = 0.0
    prompt_ms: float = 0.0
    prompt_steps: int = 0
    total_ms: float = 0.0


@dataclass
class TickResult:
    """What one tick produced.

    Attributes:
        pcm: ``[B, 1920]`` float32, 24 kHz; meaningful only where ``audio_ready``.
        audio_ready: ``[B]`` bool, slots that produced an audio frame this tick.
        text_tokens: ``[B]`` int64 text token of each slot, -2 where none was produced.
        audio_tokens: ``[B, dep_q]`` int64 agent audio codes, -2 where none.
        prompt_finished: slots whose persona prompt ended this tick (they go LIVE next tick).
        timings: where the time went.
    """

    pcm: np.ndarray
    audio_ready: np.ndarray
    text_tokens: np.ndarray
    audio_tokens: np.ndarray
    prompt_finished: list[int] = field(default_factory=list)
    timings: TickTimings = field(default_factory=TickTimings)


@dataclass
class _Slot:
    phase: SlotPhase = SlotPhase.FREE
    prompt: deque[PromptStep] = field(default_factory=deque)
    skip_next_frame: bool = False


class BatchEngine:
    """Runs B slots through one model copy, one batched step per tick.

    Not thread-safe: one thread (the tick loop) calls :meth:`join`, :meth:`leave` and :meth:`tick`.

    Args:
        bundle: the models; their streaming state is entered here for ``slots`` rows and kept.
        slots: B, the node's maximum concurrent sessions.
        prompt_budget_ms: after the live step, persona prompt steps run while the tick's elapsed time
            is below this (at least one prompt step per tick while any slot is prompting).
        clock: monotonic seconds, read for the tick's timings and its spare time (default
            ``time.perf_counter``). Tests inject a fake clock so that how much prompt work a tick does
            depends on the budget alone, never on the machine's speed.
    Raises:
        ValueError: ``slots`` < 1.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        slots: int,
        *,
        prompt_budget_ms: float = 0.6 * FRAME_MS,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.bundle = bundle
        self.slots = slots
        self.prompt_budget_ms = prompt_budget_ms
        self.clock = clock
        lm = bundle.lm
        self.device = lm.device
        self.dep_q = lm.dep_q
        self.user_codebooks = lm.num_codebooks - lm.dep_q - 1
        self.mimi_codebooks = bundle.mimi.num_codebooks
        self.sampling = SlotSamplingTable(slots, self.device)
        self._forcing = _Forcing(slots, self.dep_q, self.device)
        self.silence_codes, self.sine_codes = self._reference_codes()
        self.lm_gen = SlotLMGen(lm, self.sampling, self._forcing)
        self.lm_gen.streaming_forever(slots)
        bundle.mimi.streaming_forever(slots)
        self._slots = [_Slot() for _ in range(slots)]
        self._no_rows = torch.zeros(slots, dtype=torch.bool, device=self.device)
        self.lm_gen.set_exec_mask(self._no_rows)
        bundle.mimi.set_exec_mask(self._no_rows)

    @torch.no_grad()
    def _reference_codes(self, frames: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """Mimi codes of silence and of a 440 Hz sine at -12 dBFS, ``[K, frames]`` each.

        Encoded once, outside streaming mode, before the engine's streaming state exists.
        """
        mimi = self.bundle.mimi
        samples = frames * FRAME_SAMPLES
        t = torch.arange(samples, dtype=torch.float32) / mimi.sample_rate
        sine = 0.25 * torch.sin(2 * torch.pi * 440.0 * t)
        audio = torch.stack([torch.zeros(samples), sine])[:, None, :].to(self.device)
        codes = mimi.encode(audio)  # [2, K, frames]
        return codes[0], codes[1]

    # --- slot lifecycle -------------------------------------------------------------------------------

    def phase(self, slot: int) -> SlotPhase:
        return self._slots[slot].phase

    def join(self, slot: int, sampling: SamplingParams, prompt: list[PromptStep] | None = None) -> None:
        """Start a conversation in ``slot``: reset its rows alone, then prompt it (if any) or go LIVE.

        Raises:
            ValueError: slot out of range or not FREE.
        """
        state = self._check_slot(slot)
        if state.phase is not SlotPhase.FREE:
            raise ValueError(f"slot {slot} is {state.phase.value}, not free")
        mask = self._mask([slot])
        self.lm_gen.reset_streaming(mask)
        self.bundle.mimi.reset_streaming(mask)
        self.sampling.assign(slot, sampling)
        state.prompt = deque(prompt or [])
        state.phase = SlotPhase.PROMPTING if state.prompt else SlotPhase.LIVE
        state.skip_next_frame = True

    def leave(self, slot: int) -> None:
        """Free ``slot``; its rows are masked from the next tick on. Leaving a free slot is a no-op."""
        state = self._check_slot(slot)
        state.phase = SlotPhase.FREE
        state.prompt.clear()

    def _check_slot(self, slot: int) -> _Slot:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot must be in [0, {self.slots}), got {slot}")
        return self._slots[slot]

    def _mask(self, slots: list[int]) -> torch.Tensor:
        mask = torch.zeros(self.slots, dtype=torch.bool)
        mask[slots] = True
        return mask.to(self.device)

    @property
    def live_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.phase is SlotPhase.LIVE]

    @property
    def prompting_slots(self) -> list[int]:
        return [i for i, s in enumerate(self._slots) if s.phase is SlotPhase.PROMPTING]

    # --- the tick -------------------------------------------------------------------------------------

    @torch.no_grad()
    def tick(self, pcm_in: np.ndarray, active: np.ndarray | None = None) -> TickResult:
        """Run one frame for every slot.

        Args:
            pcm_in: ``[B, 1920]`` float32 in [-1, 1], 24 kHz; rows of non-LIVE slots are ignored. The
                caller puts silence in the row of a live slot whose client frame did not arrive in time.
            active: ``[B]`` bool; LIVE slots where it is False are frozen this tick (a session that has
                not sent its first frame yet). Default: every LIVE slot steps.
        Returns:
            :class:`TickResult`.
        Raises:
            ValueError: ``pcm_in`` has the wrong shape.
        """
        if pcm_in.shape != (self.slots, FRAME_SAMPLES):
            raise ValueError(f"pcm_in must be [{self.slots}, {FRAME_SAMPLES}], got {list(pcm_in.shape)}")
        start = self.clock()
        timings = TickTimings()
        pcm_out = np.zeros((self.slots, FRAME_SAMPLES), dtype=np.float32)
        audio_ready = np.zeros(self.slots, dtype=bool)
        text_tokens: np.ndarray = np.full(self.slots, UNGENERATED_TOKEN, dtype=np.int64)
        audio_tokens: np.ndarray = np.full((self.slots, self.dep_q), UNGENERATED_TOKEN, dtype=np.int64)

        live = [i for i in self.live_slots if active is None or active[i]]
        if live:
            skipping = [i for i in live if self._slots[i].skip_next_frame]
            stepping = [i for i in live if not self._slots[i].skip_next_frame]
            mimi = self.bundle.mimi
            t0 = self.clock()
            mimi.set_exec_mask(self._mask(live))
            frames = torch.from_numpy(pcm_in).to(self.device)[:, None, :]
            codes = mimi.encode(frames)  # [B, K, 1]
            if skipping:
                # As moshi's server does: the first encoded frame carries the encoder's left padding and is
                # dropped; resetting the encoder rows re-applies the padding on the next frame.
                mimi.reset_streaming(self._mask(skipping))
                for i in skipping:
                    self._slots[i].skip_next_frame = False
            t1 = self.clock()
            timings.encode_ms = (t1 - t0) * 1e3
            if stepping:
                step_mask = self._mask(stepping)
                self._forcing.clear()
                self.lm_gen.set_exec_mask(step_mask)
                tokens = self.lm_gen.step(codes[:, : self.user_codebooks])  # [B, 1 + dep_q, 1]
                self.sampling.advance(step_mask)
                assert tokens is not None
                tokens = tokens[:, :, 0]
                t2 = self.clock()
                timings.lm_ms = (t2 - t1) * 1e3
                agent = tokens[:, 1:]
                ready = step_mask & (agent >= 0).all(dim=1) & (tokens[:, 0] >= 0)
                ready_cpu = ready.cpu().numpy()
                if ready_cpu.any():
                    mimi.set_exec_mask(ready)
                    codes_out = agent[:, : self.mimi_codebooks, None].clamp(min=0)  # [B, K, 1]
                    decoded = mimi.decode(codes_out)  # [B, 1, 1920]
                    pcm_out[ready_cpu] = decoded[:, 0].float().cpu().numpy()[ready_cpu]
                    audio_ready = ready_cpu
                timings.decode_ms = (self.clock() - t2) * 1e3
                tokens_cpu = tokens.cpu().numpy()
                step_rows = np.zeros(self.slots, dtype=bool)
                step_rows[stepping] = True
                text_tokens = np.where(step_rows, tokens_cpu[:, 0], UNGENERATED_TOKEN)
                audio_tokens = np.where(step_rows[:, None], tokens_cpu[:, 1:], UNGENERATED_TOKEN)

        finished = self._run_prompt_steps(start, timings)
        timings.total_ms = (self.clock() - start) * 1e3
        return TickResult(pcm_out, audio_ready, text_tokens, audio_tokens, finished, timings)

    def _run_prompt_steps(self, tick_start: float, timings: TickTimings) -> list[int]:
        """Feed persona prompts, one teacher-forced LM step for all prompting slots per call, with every
        other row frozen, while the tick has time left (always at least one step)."""
        finished: list[int] = []
        t0 = self.clock()
        while True:
            prompting = self.prompting_slots
            if not prompting:
                break
            elapsed_ms = (self.clock() - tick_start) * 1e3
            if timings.prompt_steps > 0 and elapsed_ms >= self.prompt_budget_ms:
                break
            user = torch.zeros(self.slots, self.user_codebooks, 1, dtype=torch.int64, device=self.device)
            self._forcing.clear()
            for i in prompting:
                step = self._slots[i].prompt.popleft()
                user[i, :, 0] = step.user_codes[: self.user_codebooks]
                self._forcing.text[i] = step.text_token
                if step.agent_codes is not None:
                    self._forcing.audio[i] = step.agent_codes[: self.dep_q]
                if not self._slots[i].prompt:
                    self._slots[i].phase = SlotPhase.LIVE
                    finished.append(i)
            mask = self._mask(prompting)
            self.lm_gen.set_exec_mask(mask)
            self.lm_gen.step(user)
            self.sampling.advance(mask)
            timings.prompt_steps += 1
        self._forcing.clear()
        timings.prompt_ms = (self.clock() - t0) * 1e3
        return finished

    def memory_allocated_bytes(self) -> int | None:
        """GPU memory held by torch's allocator on the engine's device, or None on a CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return None
