"""The encoder pre-roll (issue 24, item 2): a joining slot's Mimi encoder rows are primed with one frame of
silence, so the caller's first real frame is encoded with context and stepped by the LM in the same tick.

Before it, the engine encoded each session's first frame and dropped its codes (moshi's ``server.py``
``skip_frames``), so the first LM step came one 80 ms tick later. The reference here is moshi's own classes
at batch 1 (``MimiModel`` streaming encode, stock ``LMGen`` with greedy sampling): the stream a caller gets
must be exactly that of a stock stream fed one extra leading frame of silence whose codes are dropped.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from moshi.models.lm import LMGen
from test_engine import FakeClock

from runtime.engine.batch import UNGENERATED_TOKEN, BatchEngine, PromptStep, SlotPhase
from runtime.engine.model_presets import FRAME_SAMPLES, MOSHI_7B_LM, PERSONAPLEX_7B_LM, get_preset
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.persona import Persona, VoiceCatalog, build_prompt
from runtime.engine.sampling import SamplingParams
from runtime.engine.sim import SimEngine, StepTime

SLOTS = 3
FRAMES = 8

Tokens = tuple[int, ...] | None
"""One tick's (text, audio...) tokens of a row; None where the row produced nothing."""


@pytest.fixture(scope="module")
def tiny() -> ModelBundle:
    return build_tiny(seed=0)


@pytest.fixture(scope="module")
def audio() -> np.ndarray:
    """``[SLOTS, FRAMES, 1920]`` noise, a different stream per slot."""
    rng = np.random.default_rng(7)
    return (rng.standard_normal((SLOTS, FRAMES, FRAME_SAMPLES)) * 0.1).astype(np.float32)


def _engine(bundle: ModelBundle, **kwargs) -> BatchEngine:
    return BatchEngine(copy.deepcopy(bundle), SLOTS, clock=FakeClock(), **kwargs)


def _record_encodes(engine: BatchEngine) -> list[torch.Tensor]:
    """Wrap the engine's ``mimi.encode``: every call's ``[B, K]`` codes, in call order."""
    mimi = engine.bundle.mimi
    encode = mimi.encode
    calls: list[torch.Tensor] = []

    def recording(x: torch.Tensor) -> torch.Tensor:
        codes = encode(x)
        calls.append(codes[:, :, 0].clone())
        return codes

    mimi.encode = recording  # type: ignore[method-assign]
    return calls


def _row(result, slot: int) -> Tokens:
    if result.text_tokens[slot] == UNGENERATED_TOKEN:
        return None
    return (int(result.text_tokens[slot]), *map(int, result.audio_tokens[slot]))


def _persona_prompt(bundle: ModelBundle, engine: BatchEngine) -> list[PromptStep]:
    codes = engine.silence_codes.cpu()
    return build_prompt(
        Persona(voice_prompt="anna", text_prompt="Be brief."),
        VoiceCatalog({"anna": codes[:, :2]}),
        bundle.text_tokenizer,
        silence_codes=codes,
        sine_codes=engine.sine_codes.cpu(),
    )


@torch.no_grad()
def _stock_stream(bundle: ModelBundle, frames: np.ndarray) -> tuple[list[list[int]], list[Tokens]]:
    """moshi's own classes at batch 1: a streaming ``MimiModel`` fed one leading frame of silence (its codes
    dropped), then ``frames``, each frame's codes stepped at once by a stock greedy ``LMGen``. Returns each
    frame's codes and the LM's tokens for it (None while the LM is inside its acoustic delay)."""
    mimi = copy.deepcopy(bundle.mimi)
    gen = LMGen(copy.deepcopy(bundle.lm), use_sampling=False)
    user_codebooks = bundle.lm.num_codebooks - bundle.lm.dep_q - 1
    codes_out: list[list[int]] = []
    tokens_out: list[Tokens] = []
    with mimi.streaming(1), gen.streaming(1):
        mimi.encode(torch.zeros(1, 1, FRAME_SAMPLES))  # the extra leading frame of silence, codes dropped
        for frame in frames:
            codes = mimi.encode(torch.from_numpy(frame)[None, None])
            codes_out.append(codes[0, :, 0].tolist())
            tokens = gen.step(codes[:, :user_codebooks])
            tokens_out.append(None if tokens is None else tuple(tokens[0, :, 0].tolist()))
    return codes_out, tokens_out


def _drive(
    engine: BatchEngine,
    audio: np.ndarray,
    *,
    slot: int,
    join_at: int,
    first_frame_at: int | None = None,
    neighbours: dict[int, int] | None = None,
    prompt: list[PromptStep] | None = None,
    max_ticks: int = 200,
) -> tuple[list[list[int]], list[Tokens], int]:
    """Tick ``engine``: ``slot`` joins at ``join_at`` (with ``prompt``) and sends its frames from
    ``first_frame_at`` (default: the tick it is LIVE, after its prompt) on; each ``neighbours`` slot is
    LIVE and sending from its tick on. Returns ``slot``'s codes (the tick's last encode) and tokens for
    each frame it sent, and the tick of its first frame."""
    calls = _record_encodes(engine)
    neighbours = neighbours or {}
    for other in neighbours:
        engine.join(other, SamplingParams.greedy())
    codes: list[list[int]] = []
    tokens: list[Tokens] = []
    sent = 0
    first = -1
    t = 0
    while sent < FRAMES and t < max_ticks:
        if t == join_at:
            engine.join(slot, SamplingParams.greedy(), prompt)
        pcm = np.zeros((SLOTS, FRAME_SAMPLES), dtype=np.float32)
        active = np.zeros(SLOTS, dtype=bool)
        for other, at in neighbours.items():
            if t >= at:
                active[other] = True
                pcm[other] = audio[other, (t - at) % FRAMES]
        live = t >= join_at and engine.phase(slot) is SlotPhase.LIVE
        sending = live and (first_frame_at is None or t >= first_frame_at) and sent < FRAMES
        if sending:
            first = t if first < 0 else first
            active[slot] = True
            pcm[slot] = audio[slot, sent]
        result = engine.tick(pcm, active)
        if sending:
            codes.append(calls[-1][slot].tolist())
            tokens.append(_row(result, slot))
            sent += 1
        t += 1
    assert sent == FRAMES, f"the slot sent {sent} of {FRAMES} frames"
    return codes, tokens, first


def test_tiny_preset_has_the_7b_delays() -> None:
    """The tick counts below hold for the 7B models because the tiny preset has their delays (text 0, the
    first audio codebook 0, the others 1): LMGen's first audio comes at its second step."""
    tiny = get_preset("tiny").lm_kwargs["delays"]
    assert tiny == MOSHI_7B_LM["delays"] == PERSONAPLEX_7B_LM["delays"]
    assert tiny[:3] == [0, 0, 1] and max(tiny) == 1


@pytest.mark.parametrize("join_at, first_frame_at", [(0, 0), (2, 5)], ids=["same-tick", "frames-later"])
def test_preroll_equals_a_stock_stream_with_one_leading_silent_frame(
    tiny, audio, join_at, first_frame_at
) -> None:
    """Guards the dropped first frame (issue 24, item 2). A session's codes and LM tokens for its frames
    1..N equal those of moshi's own Mimi + LMGen at batch 1 fed one leading frame of silence whose codes
    are dropped: the first real frame is encoded with that silence as context and stepped at once. The old
    engine encoded the caller's first frame, dropped it and reset the encoder, so its first LM step took
    frame 2 and every token came one tick late."""
    ref_codes, ref_tokens = _stock_stream(tiny, audio[1])
    assert sum(t is None for t in ref_tokens) == 1  # the stock stream's acoustic delay
    engine = _engine(tiny)
    codes, tokens, _ = _drive(
        engine, audio, slot=1, join_at=join_at, first_frame_at=first_frame_at, neighbours={0: 0, 2: 1}
    )
    for frame in range(FRAMES):
        assert codes[frame] == ref_codes[frame], f"codes of frame {frame + 1}"
        assert tokens[frame] == ref_tokens[frame], f"tokens of frame {frame + 1}"


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "step-by-step"])
def test_a_persona_slot_is_prerolled_too(tiny, audio, prefill) -> None:
    """Guards a persona session losing its first frame, or being encoded without the pre-roll: the prompt's
    steps feed the LM precomputed user codes (``PromptStep.user_codes``, a 440 Hz sine encoded once at
    start) and never run the slot's streaming encoder, so after the prompt the encoder rows are as the join
    left them and need the same one frame of silence. The caller's codes equal a stock batch-1 Mimi
    stream's after one silent frame, and its first frame is stepped at once: the prompt's steps have used
    the acoustic delay up, so the first frame's own tick has tokens (the old engine dropped that frame)."""
    ref_codes, _ = _stock_stream(tiny, audio[1])
    engine = _engine(tiny, prompt_budget_ms=8.0, prefill=prefill)  # a prompt of a few ticks
    prompt = _persona_prompt(tiny, engine)
    codes, tokens, first = _drive(engine, audio, slot=1, join_at=1, neighbours={0: 0}, prompt=prompt)
    assert first > 2  # the prompt took ticks: the pre-roll ran before the conversation, not with it
    assert codes == ref_codes
    assert all(t is not None for t in tokens)  # frame 1 stepped in its own tick


def test_preroll_leaves_the_other_slots_untouched(tiny, audio) -> None:
    """Guards the pre-roll's exec mask: priming a joining slot's encoder rows (one silent frame through the
    batched Mimi) must not advance any other row's encoder. A stepping neighbour and a LIVE neighbour that
    has not sent its first frame yet (frozen) produce the same tokens and PCM, tick by tick, whether or not
    a third slot joins and pre-rolls meanwhile, in the tick of its own first frame or ticks before it."""

    def run(join: tuple[int, int] | None) -> list[tuple[Tokens, Tokens, bytes, bytes]]:
        engine = _engine(tiny)
        engine.join(0, SamplingParams.greedy())
        engine.join(2, SamplingParams.greedy())
        out = []
        for t in range(FRAMES + 2):
            if join is not None and t == join[0]:
                engine.join(1, SamplingParams.greedy())
            pcm = np.zeros((SLOTS, FRAME_SAMPLES), dtype=np.float32)
            active = np.array([True, False, False])
            pcm[0] = audio[0, t % FRAMES]
            if t >= 4:  # slot 2 is LIVE from tick 0 but sends from tick 4 on
                active[2] = True
                pcm[2] = audio[2, (t - 4) % FRAMES]
            if join is not None and t >= join[1]:
                active[1] = True
                pcm[1] = audio[1, t % FRAMES]
            result = engine.tick(pcm, active)
            out.append((_row(result, 0), _row(result, 2), result.pcm[0].tobytes(), result.pcm[2].tobytes()))
        return out

    alone = run(None)
    assert sum(r[0] is not None for r in alone) >= FRAMES and sum(r[1] is not None for r in alone) >= 4
    for join in [(2, 2), (1, 5)]:  # pre-roll and first frame in one tick; pre-roll while slot 2 is frozen
        assert run(join) == alone, f"slot 1 joining at tick {join[0]}, sending from tick {join[1]}"


@pytest.mark.parametrize(
    "persona, prefill", [(False, True), (True, True), (True, False)], ids=["none", "prefill", "step-by-step"]
)
def test_first_audio_comes_max_delay_plus_one_ticks_after_the_first_frame(
    tiny, audio, persona, prefill
) -> None:
    """Guards the tick the old engine added to every first-audio latency. Counting the tick that takes a
    session's first frame as tick 1, its first audio (``audio_ready`` for its row) comes at tick
    ``max_delay + 1`` = 2 (LMGen's acoustic delay, the 7B's delays: ungenerated until its second step);
    after a persona prompt, whose steps have used the delay up, at tick 1, the first frame's own. With the
    first frame's codes dropped each came one tick later (3, and 2). Logical ticks, not time."""
    engine = _engine(tiny, prompt_budget_ms=8.0, prefill=prefill)
    prompt = _persona_prompt(tiny, engine) if persona else None
    max_delay = max(tiny.lm.delays)
    assert max_delay == 1
    engine.join(0, SamplingParams.greedy(), prompt)
    ticks = 0
    while engine.phase(0) is not SlotPhase.LIVE:  # the prompt, if any; the caller has not sent yet
        result = engine.tick(np.zeros((SLOTS, FRAME_SAMPLES), dtype=np.float32))
        assert not result.audio_ready.any()
        ticks += 1
        assert ticks < 200
    active = np.array([True, False, False])
    for tick in range(1, FRAMES + 1):
        pcm = np.zeros((SLOTS, FRAME_SAMPLES), dtype=np.float32)
        pcm[0] = audio[0, tick - 1]
        result = engine.tick(pcm, active)
        if result.audio_ready[0]:
            break
    assert tick == (1 if persona else max_delay + 1)
    assert np.abs(result.pcm[0]).max() > 0


@pytest.mark.parametrize("persona", [False, True], ids=["none", "persona"])
def test_the_sim_engine_gives_first_audio_at_the_real_engines_tick(persona) -> None:
    """Guards the ``sim`` model's first-audio latency drifting from the real engine's: it models the
    acoustic delay (prompt steps included), not a dropped first frame, so a load test on it sees the first
    audio at the tick the real engine gives it (the test above): tick 2 of the first frame, or tick 1 after a
    persona prompt."""
    engine = SimEngine(SLOTS, StepTime(((1, 1.0),)), text_vocab=256, sleep=lambda _: None)
    step = PromptStep(engine.sine_codes[:, 0], 3, torch.zeros(8, dtype=torch.int64))
    engine.join(0, SamplingParams(), [step] * 5 if persona else None)
    while engine.phase(0) is not SlotPhase.LIVE:
        assert not engine.tick(np.zeros((SLOTS, FRAME_SAMPLES), dtype=np.float32)).audio_ready.any()
    active = np.array([True, False, False])
    pcm = np.full((SLOTS, FRAME_SAMPLES), 0.1, dtype=np.float32)
    ready = [bool(engine.tick(pcm, active).audio_ready[0]) for _ in range(4)]
    assert ready.index(True) + 1 == (1 if persona else max(MOSHI_7B_LM["delays"]) + 1)
    assert all(ready[ready.index(True) :])
