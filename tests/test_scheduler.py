"""The slot scheduler's tick loop (runtime/engine/scheduler.py) over the sim engine, with no server."""

from __future__ import annotations

import asyncio

import numpy as np

from runtime.engine.model_presets import FRAME_SAMPLES
from runtime.engine.sampling import SamplingParams
from runtime.engine.scheduler import SlotScheduler, SlotSession
from runtime.engine.sim import SimEngine
from runtime.engine.sim_timing import StepTime
from runtime.metrics import RuntimeMetrics

FRAMES = 12


class _Tokenizer:
    """The two calls the scheduler makes of a sentencepiece tokenizer."""

    def vocab_size(self) -> int:
        return 256

    def id_to_piece(self, token: int) -> str:
        return f"<{token}>"


async def test_frames_handed_to_a_session_are_not_rewritten_by_later_ticks() -> None:
    """Guards issue 21 item 5: the engine rewrites one set of result buffers every tick, so the scheduler
    must copy each session's PCM row before handing it to the event loop. The tick thread here runs far
    ahead of the loop (1 ms ticks, a sleepless sim), so every frame is delivered after later ticks have
    rewritten the buffer: without the copy each would read as the last tick's audio."""
    loop = asyncio.get_running_loop()
    engine = SimEngine(2, StepTime(((1, 1.0),)), text_vocab=256, sleep=lambda _: None)
    scheduler = SlotScheduler(engine, _Tokenizer(), RuntimeMetrics(), loop, frame_ms=1.0)  # type: ignore[arg-type]
    got: list[np.ndarray] = []
    enough = asyncio.Event()

    def on_output(pcm: np.ndarray | None, piece: str | None) -> None:
        if pcm is not None:
            got.append(pcm)
            if len(got) >= FRAMES:
                enough.set()

    session = SlotSession("s1", SamplingParams(), [], on_output, lambda: None, max_inbox_frames=FRAMES + 1)
    frames = [np.full(FRAME_SAMPLES, 0.01 * (k + 1), dtype=np.float32) for k in range(FRAMES + 1)]
    for frame in frames:
        session.push_frame(frame)
    scheduler.start()
    try:
        scheduler.admit(session)
        await asyncio.wait_for(enough.wait(), 60)
    finally:
        scheduler.stop()
    # The first frame's step is the model's acoustic delay (no audio, as LMGen's first step gives none);
    # output k echoes input frame k + 1 at half level over the sim's tone.
    for k, pcm in enumerate(got[: FRAMES - 1]):
        assert np.allclose(pcm, 0.5 * frames[k + 1] + engine._tone), f"frame {k} was rewritten"
