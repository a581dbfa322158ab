"""The persona prompt as NVIDIA runs it (issue 30, items 3, 6, 7, 9, 10), on the tiny model.

The reference is worked out here by hand from NVIDIA's published algorithm (NVIDIA/personaplex
``moshi/moshi/models/lm.py``: ``prepare_step_input``, ``step_system_prompts``, ``SINE_TOKENS``,
``SILENCE_TOKENS``; ``moshi/moshi/server.py``: ``wrap_with_system_tags``), not taken from the engine."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from test_engine import FakeClock

from runtime.config import RuntimeConfig
from runtime.engine.batch import BatchEngine, SlotPhase
from runtime.engine.local_slots import LocalSlots
from runtime.engine.model_presets import DEFAULT_TEXT_PROMPT
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.persona import (
    Persona,
    PersonaError,
    VoiceCatalog,
    build_prompt,
    embeddings_voice_steps,
    with_defaults,
)
from runtime.engine.sampling import SamplingParams
from runtime.engine.voices import EmbeddingsVoice
from runtime.frontend.codecs.protocol import ProtocolError
from runtime.frontend.gate.query import parse_session_query

SINE = [430, 1268, 381, 1611, 1095, 1495, 56, 472]  # NVIDIA lm.py SINE_TOKENS
SILENCE = [948, 243, 1178, 546, 1736, 1030, 1978, 2008]  # NVIDIA lm.py SILENCE_TOKENS
PAD = 3  # NVIDIA's zero_text_code
DELAYS = [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]  # text, agent 8, user 8 (the 7B's)
NV_CT = 4  # NVIDIA's cache columns: max_delay + 3
K = 17


@pytest.fixture(scope="module")
def tiny() -> ModelBundle:
    return build_tiny(seed=0)


def _engine(bundle: ModelBundle, **kwargs) -> BatchEngine:
    kwargs.setdefault("clock", FakeClock())
    kwargs.setdefault("prompt_budget_ms", 1e9)
    return BatchEngine(copy.deepcopy(bundle), 1, **kwargs)


def _nvidia_frames(voice: torch.Tensor, text_tokens: list[int]) -> list[tuple[list[int], int, list[int]]]:
    """NVIDIA's ``step_system_prompts`` as (user, text, agent) per ``step`` call: the voice with the sine
    as user and PAD as text, 6 silence, the text tokens over silence, 6 silence."""
    frames = [(SINE, PAD, voice[:, t].tolist()) for t in range(voice.shape[1])]
    frames += [(SINE, PAD, SILENCE)] * 6
    frames += [(SINE, tok, SILENCE) for tok in text_tokens]
    frames += [(SINE, PAD, SILENCE)] * 6
    return frames


def _nvidia_run(frames, initial: list[int]) -> tuple[list[list[int]], list[list[int]]]:
    """NVIDIA's ``prepare_step_input`` transcribed for B = 1: for each call (offset o) write the user's
    codebook k at ``o + delay[k]``, the agent's likewise, the text at ``o``; overwrite ``o`` with the
    initial token where ``o <= delay[k]``; the first call only initialises; later calls feed column o - 1
    to the transformer. Returns the transformer inputs of the N - 1 prompt calls plus the one its first
    live call reads (column N - 1), and the cache after the last call."""
    cache = [[-1] * NV_CT for _ in range(K)]
    inputs = []
    for o, (user, text, agent) in enumerate(frames):
        for q in range(8):
            cache[9 + q][(o + DELAYS[9 + q]) % NV_CT] = user[q]
            cache[1 + q][(o + DELAYS[1 + q]) % NV_CT] = agent[q]
        cache[0][o % NV_CT] = text
        for k in range(K):
            if o <= DELAYS[k]:
                cache[k][o % NV_CT] = initial[k]
        if o == 0:
            for k in range(K):
                cache[k][0] = initial[k]
            continue
        inputs.append([cache[k][(o - 1) % NV_CT] for k in range(K)])
    n = len(frames)
    inputs.append([cache[k][(n - 1) % NV_CT] for k in range(K)])  # what NVIDIA's first live call reads
    return inputs, cache


class _TokenSpy:
    """The tokens the temporal transformer embeds, per codebook, by forward pre-hooks on ``lm.text_emb`` and
    ``lm.emb[q]`` (what ``forward_text`` reads from the token cache): :meth:`steps` gives ``[K]`` per step
    of row 0."""

    def __init__(self, engine: BatchEngine) -> None:
        lm = engine.bundle.lm
        self.seen: list[list[torch.Tensor]] = [[] for _ in range(K)]
        modules = [lm.text_emb, *lm.emb]
        for k, module in enumerate(modules):
            module.register_forward_pre_hook(
                lambda _m, args, k=k: self.seen[k].append(args[0][0].cpu().clone())
            )

    def steps(self) -> list[list[int]]:
        per_codebook = torch.stack([torch.cat(chunks) for chunks in self.seen])  # [K, steps]
        return per_codebook.T.tolist()


def _run_prompt(engine: BatchEngine, prompt) -> None:
    engine.join(0, SamplingParams.greedy(), prompt)
    for _ in range(400):
        if engine.phase(0) is SlotPhase.LIVE:
            return
        engine.tick(np.zeros((1, 1920), dtype=np.float32))
    raise AssertionError("the prompt never finished")


def test_whole_prompt_token_cache_is_nvidias_step_by_step(tiny) -> None:
    voice = (torch.arange(8 * 5).reshape(8, 5) * 37 + 11) % 2048
    text_tokens = tiny.text_tokenizer.encode("<system> be kind <system>")
    frames = _nvidia_frames(voice, text_tokens)
    initial = tiny.lm._get_initial_token()[0, :, 0].tolist()
    expected, nv_cache = _nvidia_run(frames, initial)
    n = len(frames)

    stepper = _engine(tiny, prefill=False)
    prompt = build_prompt(
        Persona("v", "be kind"),
        VoiceCatalog({"v": voice}),
        tiny.text_tokenizer,
        silence_codes=stepper.silence_codes.cpu(),
        sine_codes=stepper.sine_codes.cpu(),
    )
    assert len(prompt) == n
    spy = _TokenSpy(stepper)
    _run_prompt(stepper, prompt)
    got = spy.steps()
    assert len(got) == n  # N engine steps: NVIDIA's N - 1 prompt calls and the column its live call reads
    for t in range(n):
        assert got[t] == expected[t], f"step {t}"
    cache = stepper.lm_gen._streaming_state.cache[0]  # [K, 3], moshi 0.2.13's layout
    delayed = [k for k in range(K) if DELAYS[k] > 0]
    # Position n: the delayed rows of the last frame, as in NVIDIA's cache after its last prompt call.
    assert cache[delayed, n % 3].tolist() == [nv_cache[k][n % NV_CT] for k in delayed]

    prefiller = _engine(tiny, prefill=True)
    spy = _TokenSpy(prefiller)
    _run_prompt(prefiller, prompt)
    assert spy.steps() == expected
    assert torch.equal(prefiller.lm_gen._streaming_state.cache[0], cache)
    assert int(prefiller.lm_gen._streaming_state.offsets[0]) == n


def _embeddings_voice(tiny: ModelBundle, count: int) -> EmbeddingsVoice:
    gen = torch.Generator().manual_seed(3)
    embeddings = torch.randn(count, 1, 1, tiny.lm.dim, generator=gen)
    cache = torch.randint(0, 2048, (1, K, NV_CT), generator=gen)
    cache[0, 0] = torch.randint(0, 200, (NV_CT,), generator=gen)  # text row: the tiny vocabulary
    return EmbeddingsVoice(embeddings, cache)


def test_embeddings_voice_replays_the_stored_embeddings_then_the_mapped_cache(tiny) -> None:
    count = 9  # E embeddings: a voice of T = E + 1 frames
    preset = _embeddings_voice(tiny, count)
    engine = _engine(tiny, prefill=True)
    prompt = build_prompt(
        Persona("NATF2", "be kind"),
        VoiceCatalog({"NATF2": preset}),
        tiny.text_tokenizer,
        silence_codes=engine.silence_codes.cpu(),
        sine_codes=engine.sine_codes.cpu(),
    )
    inputs: list[torch.Tensor] = []
    handle = engine.bundle.lm.transformer.register_forward_pre_hook(
        lambda _m, args: inputs.append(args[0][0].detach().cpu().clone())
    )
    _run_prompt(engine, prompt)
    handle.remove()
    fed = torch.cat(inputs)  # [N, dim], the temporal transformer's input at every step
    assert fed.shape[0] == len(prompt)
    torch.testing.assert_close(fed[:count], preset.embeddings.reshape(count, -1), rtol=0, atol=0)
    # Step E = T - 1 reads position T - 1 from NVIDIA's cache column (T - 1) % 4, every row.
    total = count + 1
    lm = engine.bundle.lm
    tokens = preset.cache[0, :, (total - 1) % NV_CT]
    summed = sum(lm.emb[q](tokens[1 + q].view(1, 1)) for q in range(16)) + lm.text_emb(tokens[0].view(1, 1))
    torch.testing.assert_close(fed[count], summed[0, 0].detach().cpu())

    # A voice alone: the slot ends with NVIDIA's cache mapped by position onto moshi's 3 columns.
    alone = _engine(tiny, prefill=True)
    steps = embeddings_voice_steps(
        preset, sine=alone.sine_codes[:, 0].cpu(), silence=alone.silence_codes[:, 0].cpu()
    )
    _run_prompt(alone, steps)
    cache = alone.lm_gen._streaming_state.cache[0]
    nv = preset.cache[0]
    delayed = [k for k in range(K) if DELAYS[k] > 0]
    assert cache[:, (total - 1) % 3].tolist() == nv[:, (total - 1) % NV_CT].tolist()
    assert cache[delayed, total % 3].tolist() == nv[delayed, total % NV_CT].tolist()


def test_embeddings_voice_needs_the_prefill(tiny) -> None:
    engine = _engine(tiny, prefill=False)
    steps = embeddings_voice_steps(
        _embeddings_voice(tiny, 3),
        sine=engine.sine_codes[:, 0].cpu(),
        silence=engine.silence_codes[:, 0].cpu(),
    )
    with pytest.raises(ValueError, match="needs the prefill"):
        engine.join(0, SamplingParams.greedy(), steps)
    assert engine.phase(0) is SlotPhase.FREE


def test_nvidias_constant_frames_are_used_for_the_tiny_preset(tiny) -> None:
    engine = _engine(tiny)
    assert engine.sine_codes[:, 0].tolist() == SINE and engine.silence_codes[:, 0].tolist() == SILENCE


def test_personaplex_session_gets_the_default_voice_and_text(tiny) -> None:
    voice = torch.full((8, 3), 5)
    catalog = VoiceCatalog({"NATF2": voice, "other": voice})
    assert with_defaults(Persona(), catalog, default_voice="NATF2", default_text="hi") == Persona(
        "NATF2", "hi"
    )
    assert with_defaults(
        Persona("other", "yo"), catalog, default_voice="NATF2", default_text="hi"
    ) == Persona("other", "yo")
    with pytest.raises(PersonaError, match="no default voice.*'X'.*name one of: NATF2, other"):
        with_defaults(Persona(), catalog, default_voice="X", default_text="t")

    bundle = dataclasses.replace(tiny, preset=dataclasses.replace(tiny.preset, persona_required=True))
    slots = LocalSlots(RuntimeConfig(model="tiny", max_sessions=1), bundle)
    slots.voices = catalog
    expected = build_prompt(
        Persona("NATF2", DEFAULT_TEXT_PROMPT),
        catalog,
        tiny.text_tokenizer,
        silence_codes=slots.engine.silence_codes.cpu(),
        sine_codes=slots.engine.sine_codes.cpu(),
    )
    got = slots.prompt(None, None)
    assert [(s.text_token, s.agent_codes.tolist()) for s in got] == [
        (s.text_token, s.agent_codes.tolist()) for s in expected
    ]
    slots.voices = VoiceCatalog({"other": voice})
    with pytest.raises(PersonaError, match="no default voice"):
        slots.prompt(None, "be kind")


def test_a_prompt_already_in_system_tags_is_not_wrapped_twice(tiny) -> None:
    def text_tokens(text: str) -> list[int]:
        codes = torch.zeros(8, 1, dtype=torch.long)
        steps = build_prompt(
            Persona(text_prompt=text),
            VoiceCatalog(),
            tiny.text_tokenizer,
            silence_codes=codes,
            sine_codes=codes,
        )
        return [s.text_token for s in steps]

    wrapped = text_tokens("  <system> be kind <system> ")
    assert wrapped == text_tokens("be kind")
    assert wrapped[:-6] == tiny.text_tokenizer.encode("<system> be kind <system>")


def test_audio_topk_is_capped_at_the_depformer_bound_where_the_session_joins() -> None:
    assert parse_session_query({"audio_topk": "250"}).audio_topk == 250
    with pytest.raises(ProtocolError, match=r"audio_topk.*\[1, 250\].*same on every device"):
        parse_session_query({"audio_topk": "251"})
