"""The batch engine (model runner): one batched Mimi encode, LM step and Mimi decode per 80 ms tick.

:class:`BatchEngine` owns a fixed number of slots B (each :class:`SlotPhase` FREE, PROMPTING or LIVE) and
knows nothing of sockets or sessions: ``tick()`` takes one PCM frame per slot and gives one PCM frame and
one text token per slot, in :class:`TickBuffers` rewritten by the next tick. A joining slot's rows are
reset alone (the others keep their KV caches) and its Mimi encoder rows pre-rolled with a frame of
silence, so that its caller's first frame is stepped at once (:meth:`BatchEngine._preroll`); persona
prompts are prefilled (:class:`_Prefill`) or teacher-forced step by step (:class:`SlotLMGen`) in the tick's
spare time, after the live step.

How a tick works, the moshi streaming calls it rests on, prompt feeding: docs/runtime.md, "How a tick
works"; prefill figures: docs/protocol.md, "Wire protocol"."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from moshi.models.lm import LMGen
from moshi.modules.streaming import State
from moshi.modules.transformer import RingKVCache, _LayerState, _MHAState, _TransformerState

from runtime.engine.api import FrameFormat
from runtime.engine.model_presets import (
    FRAME_MS,
    FRAME_SAMPLES,
    NVIDIA_SILENCE_TOKENS,
    NVIDIA_SINE_TOKENS,
)
from runtime.engine.models import ModelBundle
from runtime.engine.sampling import SamplingParams, SlotSamplingTable

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
    """One frame of a persona prompt, as NVIDIA's ``LMGen.step(input_tokens, moshi_tokens, text_token)``
    takes it (NVIDIA/personaplex ``moshi/moshi/models/lm.py``, ``prepare_step_input``): each codebook k of
    the frame is written at token-cache position ``i + delay[k]`` (frame i), the agent's codebook 0 one
    step ahead of its codebooks 1..7 as the user's are. How the engine lays the frames out over its steps:
    :func:`prompt_position_tokens`.

    Attributes:
        user_codes: ``[n_q - dep_q]`` int64 codes fed as the user's audio (PersonaPlex: ``SINE_TOKENS``).
        text_token: forced text token, or ``NOT_FORCED``.
        agent_codes: ``[dep_q]`` int64 forced agent audio codes (the voice prompt), or None to let the
            model generate.
        embedding: ``[dim]`` float, the temporal transformer's input at step i given as it is (NVIDIA's
            ``step_embeddings``: no token-embedding lookup), or None. Only the prefill path takes it
            (:meth:`BatchEngine.join` refuses it otherwise); the frame's tokens still fill the token cache.
    """

    user_codes: torch.Tensor
    text_token: int = NOT_FORCED
    agent_codes: torch.Tensor | None = None
    embedding: torch.Tensor | None = None


def prompt_positions(
    prompt: list[PromptStep], delays: list[int], dep_q: int, initial: torch.Tensor
) -> torch.Tensor:
    """``[K, T + 1]`` int64: the token each codebook holds at token-cache positions 0..T after a prompt of
    T frames, as NVIDIA's ``prepare_step_input`` lays them out (NVIDIA/personaplex
    ``moshi/moshi/models/lm.py``): position p of codebook k holds frame ``p - delay[k]``'s token, or the
    initial token where ``p <= delay[k]`` (so frame 0 never reaches the model: NVIDIA overwrites it with
    the initial tokens too); ``NOT_FORCED`` where a frame leaves the codebook free.

    Position T's text and agent codebook 0 (delay 0) are what NVIDIA samples at its first live call; a
    fully forced prefill cannot sample, so the engine forces the prompt's last frame (silence and text
    padding in a persona) there once more. Position T's user codebook 0 is left ``NOT_FORCED``: the
    caller's first frame goes there.

    Args:
        prompt: the frames (T of them).
        delays: ``[K]`` the model's delays (``lm.delays``: text, dep_q agent codebooks, user codebooks).
        dep_q: agent codebooks.
        initial: ``[K]`` the model's initial tokens (``lm._get_initial_token()[0, :, 0]``).
    """
    total = len(prompt)
    k_all = len(delays)
    frames = torch.full((k_all, total + 1), NOT_FORCED, dtype=torch.int64)  # column i = frame i
    for i, step in enumerate(prompt):
        frames[0, i] = step.text_token
        if step.agent_codes is not None:
            frames[1 : 1 + dep_q, i] = step.agent_codes[:dep_q].to(torch.int64)
        frames[1 + dep_q :, i] = step.user_codes[: k_all - 1 - dep_q].to(torch.int64)
    if total:
        frames[:2, total] = frames[:2, total - 1]
    positions = torch.full((k_all, total + 1), NOT_FORCED, dtype=torch.int64)
    for k, delay in enumerate(delays):
        positions[k, delay:] = frames[k, : total + 1 - delay]
        positions[k, : min(delay, total) + 1] = int(initial[k])
    return positions


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
    """Wall time of one tick's parts, in ms (by the engine's clock). ``encode_ms`` includes the encoder
    pre-roll of slots that joined since the last tick; ``prompt_steps``: step-by-step prompt steps;
    ``prefill_steps``: prompt steps run as prefill, in ``prefill_chunks`` chunks. Persona rollovers
    (``runtime.engine.rollover``; 0 without): ``rollover_steps`` prefilled, rollovers swapped in at a
    caller pause or forced, the largest ``persona_age_steps`` (steps since a live slot's persona began)."""

    encode_ms: float = 0.0
    lm_ms: float = 0.0
    decode_ms: float = 0.0
    prompt_ms: float = 0.0
    prompt_steps: int = 0
    prefill_steps: int = 0
    prefill_chunks: int = 0
    rollover_steps: int = 0
    rollovers_at_pause: int = 0
    rollovers_forced: int = 0
    persona_age_steps: int = 0
    total_ms: float = 0.0


@dataclass
class TickResult:
    """What one tick produced.

    The four arrays are the engine's :class:`TickBuffers`: allocated once per engine and rewritten in place
    by the next tick (as Kyutai's ``batched_asr.py`` does with its output buffers). A caller copies what it
    keeps past the next call to ``tick`` (``SlotScheduler`` copies each session's PCM row before handing it
    to the event loop).

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


class TickBuffers:
    """A tick's result arrays, allocated once per engine (``slots`` = B rows) and reused every tick.

    Attributes:
        pcm: ``[B, 1920]`` float32 output audio, zero where no frame was produced.
        audio_ready: ``[B]`` bool.
        text_tokens: ``[B]`` int64, ``UNGENERATED_TOKEN`` where none.
        audio_tokens: ``[B, dep_q]`` int64, ``UNGENERATED_TOKEN`` where none.
    Raises:
        ValueError: ``slots`` or ``dep_q`` < 1.
    """

    def __init__(self, slots: int, dep_q: int) -> None:
        if slots < 1 or dep_q < 1:
            raise ValueError(f"slots and dep_q must be >= 1, got slots {slots}, dep_q {dep_q}")
        self.pcm = np.zeros((slots, FRAME_SAMPLES), dtype=np.float32)
        self.audio_ready = np.zeros(slots, dtype=bool)
        self.text_tokens = np.full(slots, UNGENERATED_TOKEN, dtype=np.int64)
        self.audio_tokens = np.full((slots, dep_q), UNGENERATED_TOKEN, dtype=np.int64)

    def clear(self) -> None:
        """Back to "nothing produced" (silence, not ready, ``UNGENERATED_TOKEN``), in place."""
        self.pcm.fill(0.0)
        self.audio_ready.fill(False)
        self.text_tokens.fill(UNGENERATED_TOKEN)
        self.audio_tokens.fill(UNGENERATED_TOKEN)

    def result(self, prompt_finished: list[int], timings: TickTimings) -> TickResult:
        """A :class:`TickResult` over these arrays (not copies) with this tick's ``prompt_finished`` and
        ``timings``."""
        return TickResult(
            self.pcm, self.audio_ready, self.text_tokens, self.audio_tokens, prompt_finished, timings
        )


@dataclass
class _Slot:
    phase: SlotPhase = SlotPhase.FREE
    prompt: deque[PromptStep] = field(default_factory=deque)
    preroll: bool = False
    """The slot's Mimi encoder rows still need their frame of silence (:meth:`BatchEngine._preroll`)."""
    prefill: _Prefill | None = None
    positions: torch.Tensor | None = None
    """``[K, T + 1]`` the prompt's tokens by token-cache position (:func:`prompt_positions`)."""


@dataclass
class _Prefill:
    """A slot's prompt being prefilled.

    Attributes:
        steps: the prompt, all forced (text token and every agent codebook).
        sequence: ``[1, K, T]`` int64, the temporal transformer's input at steps 0..T-1 exactly as
            ``LMGen._step`` would gather it from its token cache (delays applied, initial tokens where
            ``step <= delay``).
        positions: ``[K, T + 1]`` the prompt's tokens by token-cache position (:func:`prompt_positions`).
        embeddings: ``[T, dim]`` the steps' transformer inputs where given (``PromptStep.embedding``), used
            instead of the summed token embeddings at the steps of ``embedded``; None when no step has one.
        embedded: ``[T]`` bool, the steps whose input is taken from ``embeddings``.
        done: steps already run.
        side: batch-1 streaming states of ``lm.transformer`` (name -> state), created at the first chunk.
    """

    steps: list[PromptStep]
    sequence: torch.Tensor
    positions: torch.Tensor
    embeddings: torch.Tensor | None = None
    embedded: torch.Tensor | None = None
    done: int = 0
    side: dict[str, State] | None = None

    @property
    def total(self) -> int:
        return self.sequence.shape[-1]


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
        prefill: run fully forced prompts as a parallel prefill (see the module docstring); False keeps
            the step-by-step reference for every prompt.
        prefill_max_chunk: most prompt steps in one prefill chunk (bounds the side KV ring at
            ``context + prefill_max_chunk`` positions and the chunk's activations).
        prefill_min_chunk: fewest steps worth a chunk; a tick's first prompt work always runs at least
            this many (progress while live slots use the whole budget).
        prefill_floor_ms: time (by the cost estimate) a tick's first prompt round may give a prefill even
            when the live step has used the budget up: 8 ms = a tenth of the frame, so a busy node still
            makes progress (a 1000-step prompt of the tiny preset needs about 50 ms in all on 2 cores).
        prefill_ms_per_step: cost of one prefilled step used to size chunks (ms); None: measured by
            ``clock`` after each chunk (starting from 1 ms; a lower measurement is taken at once, a higher
            one a quarter at a time).
    Raises:
        ValueError: ``slots`` < 1, or chunk bounds that are not 1 <= min <= max.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        slots: int,
        *,
        prompt_budget_ms: float = 0.6 * FRAME_MS,
        clock: Callable[[], float] = time.perf_counter,
        prefill: bool = True,
        prefill_max_chunk: int = 256,
        prefill_min_chunk: int = 8,
        prefill_floor_ms: float = 0.1 * FRAME_MS,
        prefill_ms_per_step: float | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        if not 1 <= prefill_min_chunk <= prefill_max_chunk:
            raise ValueError(
                f"prefill chunk bounds must satisfy 1 <= min <= max, got min {prefill_min_chunk}, "
                f"max {prefill_max_chunk}"
            )
        self.bundle = bundle
        self.slots = slots
        self.prompt_budget_ms = prompt_budget_ms
        self.clock = clock
        self.prefill = prefill
        self.prefill_max_chunk = prefill_max_chunk
        self.prefill_min_chunk = prefill_min_chunk
        self.prefill_floor_ms = prefill_floor_ms
        self._prefill_cost_fixed = prefill_ms_per_step is not None
        self.prefill_ms_per_step = prefill_ms_per_step if prefill_ms_per_step is not None else 1.0
        self._prefill_queue: deque[int] = deque()
        lm = bundle.lm
        self.device = lm.device
        self.dep_q = lm.dep_q
        self.user_codebooks = lm.num_codebooks - lm.dep_q - 1
        self.mimi_codebooks = bundle.mimi.num_codebooks
        self.sampling = SlotSamplingTable(slots, self.device)
        self._forcing = _Forcing(slots, self.dep_q, self.device)
        if bundle.preset.nvidia_prompt_frames:  # NVIDIA's constant frames (ModelPreset.nvidia_prompt_frames)
            self.silence_codes = torch.tensor(NVIDIA_SILENCE_TOKENS, device=self.device)[:, None]  # [8, 1]
            self.sine_codes = torch.tensor(NVIDIA_SINE_TOKENS, device=self.device)[:, None]
        else:
            self.silence_codes, self.sine_codes = self._reference_codes()
        self.lm_gen = SlotLMGen(lm, self.sampling, self._forcing)
        self.lm_gen.streaming_forever(slots)
        bundle.mimi.streaming_forever(slots)
        self._slots = [_Slot() for _ in range(slots)]
        self._outputs = TickBuffers(slots, self.dep_q)
        self._silence = torch.zeros(slots, 1, FRAME_SAMPLES, device=self.device)  # the pre-roll's input
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

    @property
    def frame(self) -> FrameFormat:
        """The model's frame, from its codec: Mimi's ``sample_rate`` and ``frame_size`` (24000 Hz, 1920)."""
        mimi = self.bundle.mimi
        return FrameFormat(int(mimi.sample_rate), int(mimi.frame_size))

    def phase(self, slot: int) -> SlotPhase:
        return self._slots[slot].phase

    def join(self, slot: int, sampling: SamplingParams, prompt: list[PromptStep] | None = None) -> None:
        """Start a conversation in ``slot``: reset its rows alone, then prompt it (if any) or go LIVE.

        Frame i of ``prompt`` is laid out as NVIDIA's ``prepare_step_input`` lays it
        (:func:`prompt_positions`): each codebook at position ``i + delay[k]``, so step s reads frame s's
        delay-0 tokens and frame s-1's delayed ones, and forces the agent tokens of position s + 1.

        Raises:
            ValueError: slot out of range or not FREE, or a prompt with input embeddings
                (``PromptStep.embedding``) that the prefill cannot take (prefill off, or a step left free):
                the step-by-step path feeds tokens only.
        """
        state = self._check_slot(slot)
        if state.phase is not SlotPhase.FREE:
            raise ValueError(f"slot {slot} is {state.phase.value}, not free")
        steps = list(prompt or [])
        prefilled = bool(steps) and self.prefill and self._can_prefill(steps)
        if not prefilled and any(s.embedding is not None for s in steps):
            raise ValueError(
                "a prompt with input embeddings (an embeddings voice preset) needs the prefill "
                "(prompt_prefill on, every step forced); the step-by-step path feeds tokens only"
            )
        mask = self._mask([slot])
        self.lm_gen.reset_streaming(mask)
        self.bundle.mimi.reset_streaming(mask)
        self.sampling.assign(slot, sampling)
        state.prompt = deque(steps)
        state.phase = SlotPhase.PROMPTING if state.prompt else SlotPhase.LIVE
        state.preroll = True
        state.prefill = None
        state.positions = self._positions(steps) if steps else None
        if prefilled:
            assert state.positions is not None
            state.prefill = self._new_prefill(steps, state.positions)
            state.prompt.clear()
            self._prefill_queue.append(slot)

    def leave(self, slot: int) -> None:
        """Free ``slot``; its rows are masked from the next tick on. Leaving a free slot is a no-op."""
        state = self._check_slot(slot)
        state.phase = SlotPhase.FREE
        state.prompt.clear()
        state.prefill = None
        if slot in self._prefill_queue:
            self._prefill_queue.remove(slot)

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
            :class:`TickResult` over the engine's :class:`TickBuffers`: the same arrays every tick,
            rewritten by the next call (copy what you keep).
        Raises:
            ValueError: ``pcm_in`` has the wrong shape.
        """
        if pcm_in.shape != (self.slots, FRAME_SAMPLES):
            raise ValueError(f"pcm_in must be [{self.slots}, {FRAME_SAMPLES}], got {list(pcm_in.shape)}")
        start = self.clock()
        timings = TickTimings()
        out = self._outputs
        out.clear()

        timings.encode_ms = self._preroll()
        live = [i for i in self.live_slots if active is None or active[i]]
        if live:
            mimi = self.bundle.mimi
            live_mask = self._mask(live)
            t0 = self.clock()
            mimi.set_exec_mask(live_mask)
            frames = torch.from_numpy(pcm_in).to(self.device)[:, None, :]
            codes = mimi.encode(frames)  # [B, K, 1]
            t1 = self.clock()
            timings.encode_ms += (t1 - t0) * 1e3
            self._forcing.clear()
            self.lm_gen.set_exec_mask(live_mask)
            tokens = self.lm_gen.step(codes[:, : self.user_codebooks])  # [B, 1 + dep_q, 1]
            self.sampling.advance(live_mask)
            assert tokens is not None
            tokens = tokens[:, :, 0]
            t2 = self.clock()
            timings.lm_ms = (t2 - t1) * 1e3
            agent = tokens[:, 1:]
            ready = live_mask & (agent >= 0).all(dim=1) & (tokens[:, 0] >= 0)
            ready_cpu = ready.cpu().numpy()
            if ready_cpu.any():
                mimi.set_exec_mask(ready)
                codes_out = agent[:, : self.mimi_codebooks, None].clamp(min=0)  # [B, K, 1]
                decoded = mimi.decode(codes_out)  # [B, 1, 1920]
                np.copyto(out.pcm, decoded[:, 0].float().cpu().numpy(), where=ready_cpu[:, None])
                out.audio_ready[:] = ready_cpu
            timings.decode_ms = (self.clock() - t2) * 1e3
            tokens_cpu = tokens.cpu().numpy()  # [B, 1 + dep_q]
            out.text_tokens[live] = tokens_cpu[live, 0]
            out.audio_tokens[live] = tokens_cpu[live, 1:]

        finished = self._run_prompt_steps(start, timings)
        timings.total_ms = (self.clock() - start) * 1e3
        return out.result(finished, timings)

    def _preroll(self) -> float:
        """Prime the Mimi encoder rows of every slot that joined since the last tick with one frame of
        silence (codes discarded), all of them in one encode with an exec mask of their rows alone: the
        other rows' encoder state is untouched. A caller's first frame is then encoded with that silence as
        context and stepped by the LM in its own tick, where moshi's server encodes the first frame, drops
        its codes (the encoder's left padding) and steps from the second. A persona prompt never runs the
        streaming encoder (its user side is ``PromptStep.user_codes``, encoded once at start), so a prompted
        slot is pre-rolled the same way, in its join tick, before its prompt. Returns the time taken (ms)."""
        pending = [i for i, s in enumerate(self._slots) if s.preroll and s.phase is not SlotPhase.FREE]
        if not pending:
            return 0.0
        t0 = self.clock()
        mimi = self.bundle.mimi
        mimi.set_exec_mask(self._mask(pending))
        mimi.encode(self._silence)
        for i in pending:
            self._slots[i].preroll = False
        return (self.clock() - t0) * 1e3

    def _run_prompt_steps(self, tick_start: float, timings: TickTimings) -> list[int]:
        """Feed persona prompts in the tick's spare time: step-by-step prompts one teacher-forced LM step
        for all of them per round, every other row frozen; the prefill at the head of the queue one chunk
        per round, sized to what is left of ``prompt_budget_ms``. The tick's first round always runs (at
        least one step, or a chunk of ``prefill_min_chunk``), so prompts progress however busy the tick."""
        finished: list[int] = []
        t0 = self.clock()
        before_ms = (t0 - tick_start) * 1e3
        planned_ms = 0.0  # prefill chunks run this tick, at the cost per step they were sized with

        def used_ms() -> float:
            # The clock's view, or the cost model's where it says more (a clock that lags the work).
            return max((self.clock() - tick_start) * 1e3, before_ms + planned_ms)

        first = True
        while True:
            stepping = [i for i in self.prompting_slots if self._slots[i].prefill is None]
            if not stepping and not self._prefill_queue:
                break
            if not first and used_ms() >= self.prompt_budget_ms:
                break
            worked = False
            if stepping:
                finished += self._prompt_step(stepping)
                timings.prompt_steps += 1
                worked = True
            if self._prefill_queue:
                slot = self._prefill_queue[0]
                spare_ms = self.prompt_budget_ms - used_ms()
                if first:
                    spare_ms = max(spare_ms, self.prefill_floor_ms)
                steps = self._chunk_steps(self._slots[slot].prefill, spare_ms, at_least_min=first)
                if steps > 0:
                    planned_ms += steps * self.prefill_ms_per_step
                    if self._prefill_chunk(slot, steps):
                        finished.append(slot)
                    timings.prefill_steps += steps
                    timings.prefill_chunks += 1
                    worked = True
            if not worked:
                break
            first = False
        self._forcing.clear()
        timings.prompt_ms = (self.clock() - t0) * 1e3
        return finished

    def _prompt_step(self, prompting: list[int]) -> list[int]:
        """One teacher-forced LM step for the step-by-step ``prompting`` slots; the ones that finished.

        Step s feeds frame s's user codes (``LMGen`` writes them at ``s + delay``) and forces the text and
        agent tokens of position s + 1 (:func:`prompt_positions`: frame s + 1's text and codebook 0, frame
        s's codebooks 1..7)."""
        finished: list[int] = []
        user = torch.zeros(self.slots, self.user_codebooks, 1, dtype=torch.int64, device=self.device)
        self._forcing.clear()
        for i in prompting:
            positions = self._slots[i].positions
            assert positions is not None
            s = positions.shape[1] - 1 - len(self._slots[i].prompt)
            step = self._slots[i].prompt.popleft()
            user[i, :, 0] = step.user_codes[: self.user_codebooks]
            self._forcing.text[i] = int(positions[0, s + 1])
            self._forcing.audio[i] = positions[1 : self.dep_q + 1, s + 1].to(self.device)
            if not self._slots[i].prompt:
                self._slots[i].phase = SlotPhase.LIVE
                finished.append(i)
        mask = self._mask(prompting)
        self.lm_gen.set_exec_mask(mask)
        self.lm_gen.step(user)
        self.sampling.advance(mask)
        return finished

    # --- prefill --------------------------------------------------------------------------------------

    def _can_prefill(self, prompt: list[PromptStep]) -> bool:
        """Whether ``prompt`` is fully forced (text and every agent codebook at every step) and the
        temporal transformer's streaming state is made of the kinds :meth:`_finish_prefill` copies."""
        if any(
            s.text_token == NOT_FORCED or s.agent_codes is None or s.agent_codes.shape[0] < self.dep_q
            for s in prompt
        ):
            return False
        states = self.bundle.lm.transformer.get_streaming_state()
        known = (_TransformerState, _LayerState, _MHAState)
        return all(
            type(st) in known or type(st) is State for st in states.values()
        ) and all(  # ring caches with per-row positions (moshi's respect_exec_mask), one weight set per step
            st.kv_cache is None or st.kv_cache.respect_exec_mask
            for st in states.values()
            if isinstance(st, _MHAState)
        )

    def _positions(self, prompt: list[PromptStep]) -> torch.Tensor:
        """``[K, T + 1]``: ``prompt``'s tokens by token-cache position (:func:`prompt_positions`)."""
        lm = self.bundle.lm
        initial = lm._get_initial_token()[0, :, 0].cpu()  # [K]
        return prompt_positions(prompt, list(lm.delays), self.dep_q, initial)

    def _new_prefill(self, prompt: list[PromptStep], positions: torch.Tensor) -> _Prefill:
        """The :class:`_Prefill` of a fully forced ``prompt``: its input sequence (positions 0..T-1, what
        ``LMGen._step`` gathers at steps 0..T-1 from a freshly reset row) and its input embeddings where
        given."""
        total = len(prompt)
        if bool((positions[:, :total] == NOT_FORCED).any()):  # _can_prefill admits only forced prompts
            raise ValueError("a prefilled prompt needs forced text and agent codes at every step")
        sequence = positions[None, :, :total].to(self.device)
        embedded = torch.tensor([s.embedding is not None for s in prompt])
        if not bool(embedded.any()):
            return _Prefill(prompt, sequence, positions)
        dim = self.bundle.lm.dim
        weight = self.bundle.lm.text_emb.weight
        embeddings = torch.zeros(total, dim, dtype=weight.dtype, device=self.device)
        for i, step in enumerate(prompt):
            if step.embedding is not None:
                if step.embedding.numel() != dim:
                    raise ValueError(
                        f"step {i}'s input embedding has {step.embedding.numel()} values, not dim {dim}"
                    )
                embeddings[i] = step.embedding.reshape(dim).to(self.device, weight.dtype)
        return _Prefill(prompt, sequence, positions, embeddings, embedded.to(self.device))

    def _prefill_forward(self, prefill: _Prefill, start: int, steps: int) -> None:
        """Run steps ``start .. start + steps - 1`` of ``prefill`` through the temporal transformer (in
        whatever streaming state is set). Token steps embed as moshi 0.2.13's ``LMModel.forward_text`` does
        (audio codebooks summed, then text); steps with a given embedding feed it to the transformer as it
        is (NVIDIA's ``step_embeddings`` -> ``forward_embeddings``). No embeddings: ``forward_text``."""
        lm = self.bundle.lm
        chunk = prefill.sequence[:, :, start : start + steps]
        if prefill.embeddings is None or prefill.embedded is None:
            lm.forward_text(chunk)
            return
        input_ = None
        for cb in range(lm.num_audio_codebooks):
            audio = lm.emb[cb](chunk[:, cb + lm.audio_offset])
            input_ = audio if input_ is None else input_ + audio
        text = lm.text_emb(chunk[:, 0])
        input_ = text if input_ is None else input_ + text  # [1, steps, dim]
        given = prefill.embedded[start : start + steps]
        input_ = torch.where(given[None, :, None], prefill.embeddings[None, start : start + steps], input_)
        lm.transformer(input_)

    def _chunk_steps(self, prefill: _Prefill | None, spare_ms: float, *, at_least_min: bool) -> int:
        """Steps of the next chunk: what ``spare_ms`` pays for at the cost per step, within
        [``prefill_min_chunk``, ``prefill_max_chunk``] and the steps left, rounded down to a power of two
        (a handful of shapes, each warmed once by :meth:`warm_up_prefill`; kernels and their caches are
        chosen per shape); 0 when less than the minimum fits (unless ``at_least_min``)."""
        assert prefill is not None
        left = prefill.total - prefill.done
        fits = int(max(spare_ms, 0.0) / max(self.prefill_ms_per_step, 1e-6))
        steps = min(fits, self.prefill_max_chunk, left)
        if steps < min(self.prefill_min_chunk, left):
            steps = min(self.prefill_min_chunk, left) if at_least_min else 0
        return 1 << (steps.bit_length() - 1) if steps > 0 else 0

    def _new_side_state(self, total: int) -> dict[str, State]:
        """Fresh batch-1 streaming states of ``lm.transformer``, the engine's own states left in place.

        Each attention layer's ring holds ``min(total, context + prefill_max_chunk)`` positions: a chunk of
        at most ``prefill_max_chunk`` then never overwrites a key that one of its queries still attends to
        (the attention mask keeps the window at ``context``), so the chunk computes what the steps would.
        """
        transformer = self.bundle.lm.transformer
        main = transformer.get_streaming_state()
        transformer._stop_streaming()
        try:
            transformer.streaming(1)  # never closed: the states are swapped in and out by hand
            side = transformer.get_streaming_state()
        finally:
            transformer.set_streaming_state(main)
        for name, state in side.items():
            if isinstance(state, _MHAState) and state.kv_cache is not None:
                ring = main[name].kv_cache  # type: ignore[attr-defined]
                _, _, heads, capacity, head_dim = ring.cache.shape
                state.kv_cache = RingKVCache(
                    1,
                    heads,
                    head_dim,
                    min(total, capacity + self.prefill_max_chunk),
                    respect_exec_mask=True,
                    device=ring.cache.device,
                    dtype=ring.cache.dtype,
                )
        return side

    def _run_side_chunk(self, prefill: _Prefill, steps: int) -> tuple[dict[str, State], float]:
        """Run the next ``steps`` steps of ``prefill`` through the temporal transformer in its batch-1 side
        state (made at the first chunk), the engine's own states swapped out meanwhile and back in after;
        advances ``prefill.done``. Returns the engine's own states (``transformer.get_streaming_state()``)
        and the chunk's time in ms by the engine's clock (the side state's making not included)."""
        transformer = self.bundle.lm.transformer
        if prefill.side is None:
            prefill.side = self._new_side_state(prefill.total)
        t0 = self.clock()
        main = transformer.get_streaming_state()
        transformer.set_streaming_state(prefill.side)
        try:
            self._prefill_forward(prefill, prefill.done, steps)
        finally:
            transformer.set_streaming_state(main)
        prefill.done += steps
        return main, (self.clock() - t0) * 1e3

    def _prefill_chunk(self, slot: int, steps: int) -> bool:
        """Run the next ``steps`` prompt steps of ``slot`` through the temporal transformer in its side
        state; True when the prompt is complete (the slot's rows then hold its result and it is LIVE)."""
        state = self._slots[slot]
        prefill = state.prefill
        assert prefill is not None
        main, chunk_ms = self._run_side_chunk(prefill, steps)
        if not self._prefill_cost_fixed:
            # Down at once, up slowly: a chunk preempted by the machine's other work must not shrink the
            # next ones for many ticks, and small chunks (whose fixed cost inflates the per-step figure)
            # must let the estimate fall as soon as a larger one shows the real cost.
            measured = chunk_ms / steps
            estimate = self.prefill_ms_per_step
            self.prefill_ms_per_step = measured if measured < estimate else 0.75 * estimate + 0.25 * measured
        if prefill.done < prefill.total:
            return False
        self._finish_prefill(slot, prefill, main)
        self._prefill_queue.remove(slot)
        state.prefill = None
        state.phase = SlotPhase.LIVE
        return True

    def _copy_side_rows(self, slot: int, prefill: _Prefill, main: dict[str, State]) -> None:
        """Put the temporal transformer's state of a completed ``prefill`` (its batch-1 side state) into
        ``slot``'s rows of ``main`` (the engine's own states): position offsets of every layer, and of each
        attention layer's KV ring the last ``min(T, capacity)`` positions ``[2, H, C, D]`` with its write
        position. Other rows are neither read nor written. Used for a persona prompt and a rollover alike."""
        assert prefill.side is not None
        total = prefill.total
        for name, side in prefill.side.items():
            state = main[name]
            if isinstance(state, _TransformerState):
                assert isinstance(side, _TransformerState)
                state.offsets[slot] = side.offsets[0]
            elif isinstance(state, _MHAState):
                assert isinstance(side, _MHAState)
                state.offset[slot] = side.offset[0]
                if state.kv_cache is not None:
                    assert side.kv_cache is not None
                    ring, side_ring = state.kv_cache, side.kv_cache
                    positions = torch.arange(max(0, total - ring.capacity), total, device=self.device)
                    rows = side_ring.cache[:, 0].index_select(2, positions % side_ring.capacity)
                    ring.cache[:, slot].index_copy_(2, positions % ring.capacity, rows)  # [2, H, C, D]
                    ring.end_offset[slot] = side_ring.end_offset[0]  # older positions: masked invalid

    def _finish_prefill(self, slot: int, prefill: _Prefill, main: dict[str, State]) -> None:
        """Copy the side state into ``slot``'s rows and set LMGen's token cache, its offset and the
        slot's sampling counter to what step-by-step forcing of ``prefill.steps`` leaves."""
        total = prefill.total
        self._copy_side_rows(slot, prefill, main)
        gen = self.lm_gen._streaming_state
        assert gen is not None
        cache = gen.cache  # [B, K, CT] ring of tokens, as LMGen._step writes it
        ct = cache.shape[-1]
        dq = self.dep_q
        delays = list(self.bundle.lm.delays)
        forced = prefill.positions.to(cache.device)  # [K, T + 1]
        for s in range(max(0, total - ct), total):  # the writes of steps s, in order (the ring wraps)
            step = prefill.steps[s]
            for u in range(self.user_codebooks):
                k = dq + 1 + u
                cache[slot, k, (s + delays[k]) % ct] = int(step.user_codes[u])
            cache[slot, : dq + 1, (s + 1) % ct] = forced[: dq + 1, s + 1]
        gen.offsets[slot] += total
        self.sampling.step[slot] += total

    @torch.no_grad()
    def warm_up_prefill(self) -> list[int]:
        """Run one prefill chunk of every size :meth:`_chunk_steps` can choose (powers of two up to
        ``prefill_max_chunk``) through a throwaway batch-1 side state, so that a server's first persona
        does not pay the first-call costs of those shapes during a live tick. No slot is touched.

        Returns:
            The chunk sizes run.
        """
        sizes = [
            1 << i for i in range(self.prefill_max_chunk.bit_length()) if 1 << i <= self.prefill_max_chunk
        ]
        total = sum(sizes)
        lm = self.bundle.lm
        sequence = lm._get_initial_token().expand(1, -1, total).contiguous()  # [1, K, total]
        transformer = lm.transformer
        side = self._new_side_state(total)
        main = transformer.get_streaming_state()
        transformer.set_streaming_state(side)
        try:
            done = 0
            for size in sizes:
                lm.forward_text(sequence[:, :, done : done + size])
                done += size
        finally:
            transformer.set_streaming_state(main)
        return sizes

    def memory_allocated_bytes(self) -> int | None:
        """GPU memory held by torch's allocator on the engine's device, or None on a CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return None
