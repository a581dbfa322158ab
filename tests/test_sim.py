"""The ``sim`` model (runtime/engine/sim.py): the engine's surface, the step time it spends, cheap output,
and a
whole server on it."""

from __future__ import annotations

import numpy as np
import pytest
from test_server_e2e import bundle, chat_url, running_server, speech  # noqa: F401 (fixtures)

from runtime.config import RuntimeConfig
from runtime.engine.batch import PromptStep, SlotPhase
from runtime.engine.model_presets import FRAME_SAMPLES, PRESETS
from runtime.engine.sampling import SamplingParams
from runtime.engine.sim import SimEngine
from runtime.engine.sim_timing import StepTime, parse_step_time
from runtime.frontend.codecs.protocol import AudioFormat
from runtime.tools.loadgen import run_session


def test_step_time_fixed_or_interpolated_by_batch():
    assert parse_step_time("30").ms(64) == 30.0
    table = parse_step_time("1:28, 8:32.6,16:45,32:70.2")
    assert table.ms(1) == 28.0 and table.ms(16) == 45.0 and table.ms(64) == 70.2
    assert table.ms(24) == pytest.approx((45.0 + 70.2) / 2)
    assert str(table) == "1:28,8:32.6,16:45,32:70.2"
    for bad in ("fast", "1:2:3", "0:30", "1:30,1:40", "-5", "1:20000"):
        with pytest.raises(ValueError, match="sim step time"):
            parse_step_time(bad)
    with pytest.raises(ValueError, match="sim step time"):
        RuntimeConfig(sim_step_ms="fast")


def test_sim_is_a_preset_but_never_the_default():
    assert "sim" in PRESETS and PRESETS["sim"].extra["simulated"]
    assert RuntimeConfig().model != "sim"


def test_sim_engine_sleeps_the_step_time_of_its_batch_and_returns_cheap_output():
    slept: list[float] = []
    engine = SimEngine(4, StepTime(((1, 10.0), (4, 40.0))), text_vocab=256, sleep=slept.append)
    pcm = np.zeros((4, FRAME_SAMPLES), dtype=np.float32)
    assert engine.tick(pcm).audio_ready.sum() == 0 and slept == []  # nobody live: no step
    engine.join(0, SamplingParams())
    engine.join(1, SamplingParams())
    first = engine.tick(pcm)
    assert slept == [pytest.approx(0.02)]  # two slots: 20 ms
    assert not first.audio_ready.any()  # the acoustic delay: LMGen's first step gives no audio
    texts = []
    for _ in range(8):
        result = engine.tick(pcm)
        assert list(result.audio_ready) == [True, True, False, False]
        assert np.abs(result.pcm[0]).max() > 0.01 and result.pcm[2].max() == 0
        texts.append(int(result.text_tokens[0]))
    assert {t for t in texts if t != 3} and all(0 <= t < 256 for t in texts)
    engine.leave(1)
    engine.tick(pcm)
    assert slept[-1] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="not free"):
        engine.join(0, SamplingParams())


def test_sim_engine_feeds_prompts_within_the_tick_budget():
    clock = [0.0]
    engine = SimEngine(2, StepTime(((1, 10.0),)), text_vocab=256, prompt_budget_ms=48, sleep=clock.append)
    step = PromptStep(engine.sine_codes[:, 0])
    engine.join(0, SamplingParams(), [step] * 3)
    assert engine.phase(0) is SlotPhase.PROMPTING
    result = engine.tick(np.zeros((2, FRAME_SAMPLES), dtype=np.float32))
    assert result.prompt_finished == [0] and engine.phase(0) is SlotPhase.LIVE


@pytest.mark.asyncio(loop_scope="module")
async def test_a_server_on_the_sim_model_serves_opus_sessions(bundle, speech):  # noqa: F811
    async with running_server(bundle, model="sim", sim_step_ms="5", max_sessions=2) as server:
        assert isinstance(server.backend.engine, SimEngine)
        url = chat_url(server, audio_format=AudioFormat.OPUS)
        result = await run_session(url, speech[0][: FRAME_SAMPLES * 15], audio_format=AudioFormat.OPUS)
        assert result.handshake and result.close_code == 1000, result
        assert result.audio_messages >= 8 and result.text


def test_the_planner_writes_a_step_table_the_simulator_reads():
    from infra.capacity.gpus import get_gpu
    from infra.capacity.models import get_model
    from infra.capacity.timing import sim_step_table, tick_ms

    spec, gpu = get_model("personaplex-7b"), get_gpu("h100")
    table = parse_step_time(sim_step_table(spec, gpu))
    assert table.ms(16) == pytest.approx(tick_ms(spec, gpu, "bf16", "bf16", 16), abs=0.05)
    assert table.ms(1) < table.ms(64)


def test_sim_engine_reuses_its_result_buffers_tick_after_tick():
    """Guards issue 21 item 5: the tick's result arrays are allocated once per engine and rewritten in
    place (Kyutai's batched_asr.py), not allocated every 80 ms."""
    engine = SimEngine(2, StepTime(((1, 1.0),)), text_vocab=256, sleep=lambda _: None)
    engine.join(0, SamplingParams())
    pcm = np.full((2, FRAME_SAMPLES), 0.2, dtype=np.float32)
    first = engine.tick(pcm)
    ids = [id(a) for a in (first.pcm, first.audio_ready, first.text_tokens, first.audio_tokens)]
    second = engine.tick(pcm)
    assert [id(a) for a in (second.pcm, second.audio_ready, second.text_tokens, second.audio_tokens)] == ids
    assert second.audio_ready.tolist() == [True, False]
    assert np.allclose(second.pcm[0], 0.1 + engine._tone) and not second.pcm[1].any()
    engine.leave(0)
    third = engine.tick(pcm)  # nothing produced: the reused rows are cleared, not left from the last tick
    assert third.pcm is first.pcm and not third.audio_ready.any() and not third.pcm.any()
    assert (third.text_tokens == -2).all() and (third.audio_tokens == -2).all()
