"""Voice catalog loading and persona prompt building."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sphn
import torch

from runtime.engine.models import build_tiny
from runtime.engine.persona import (
    SILENCE_FRAMES,
    TEXT_PADDING_ID,
    Persona,
    PersonaError,
    VoiceCatalog,
    build_prompt,
)


@pytest.fixture(scope="module")
def bundle():
    return build_tiny(seed=0)


def test_catalog_loads_wav_at_any_rate_and_pt_codes(bundle, tmp_path: Path) -> None:
    t = np.arange(16000 * 2) / 16000
    sphn.write_wav(
        str(tmp_path / "anna.wav"), (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)[None], 16000
    )
    torch.save(torch.randint(0, 2048, (8, 5)), tmp_path / "bob.pt")
    (tmp_path / "notes.txt").write_text("ignored")
    catalog = VoiceCatalog.load(tmp_path, bundle.mimi)
    assert catalog.names == ["anna", "bob"]
    anna = catalog.codes("anna")
    # 2 s resampled 16 kHz -> 24 kHz: sphn's resampler gives 49152 samples (its latency and tail), 25.6
    # frames; the last partial frame is zero-padded as NVIDIA's _iterate_audio(pad=True) does, not dropped
    assert anna.shape == (8, 26)
    assert catalog.codes("bob").shape == (8, 5)


def test_unknown_voice_lists_the_known_ones() -> None:
    catalog = VoiceCatalog({"anna": torch.zeros(8, 2, dtype=torch.long)})
    with pytest.raises(PersonaError, match="voices on this node: anna"):
        catalog.codes("zoe")


def test_prompt_sequence_follows_personaplex(bundle) -> None:
    voice = torch.arange(8 * 3).reshape(8, 3)
    silence = torch.full((8, 2), 7)
    sine = torch.full((8, 2), 9)
    steps = build_prompt(
        Persona(voice_prompt="v", text_prompt="be kind"),
        VoiceCatalog({"v": voice}),
        bundle.text_tokenizer,
        silence_codes=silence,
        sine_codes=sine,
    )
    text_tokens = bundle.text_tokenizer.encode("<system> be kind <system>")
    assert len(steps) == 3 + SILENCE_FRAMES + len(text_tokens) + SILENCE_FRAMES
    assert all(torch.equal(s.user_codes, sine[:, 0]) for s in steps)
    assert [s.text_token for s in steps[:3]] == [TEXT_PADDING_ID] * 3
    assert torch.equal(steps[1].agent_codes, voice[:, 1])
    spoken = steps[3 + SILENCE_FRAMES : 3 + SILENCE_FRAMES + len(text_tokens)]
    assert [s.text_token for s in spoken] == text_tokens
    assert all(torch.equal(s.agent_codes, silence[:, 0]) for s in spoken)


def test_no_persona_no_prompt(bundle) -> None:
    codes = torch.zeros(8, 1, dtype=torch.long)
    assert (
        build_prompt(Persona(), VoiceCatalog(), bundle.text_tokenizer, silence_codes=codes, sine_codes=codes)
        == []
    )


def test_overlong_text_prompt_is_refused(bundle) -> None:
    codes = torch.zeros(8, 1, dtype=torch.long)
    with pytest.raises(PersonaError, match=r"at most 1000 tokens of the model.s tokenizer .*; got \d+ tok"):
        build_prompt(
            Persona(text_prompt="word " * 1500),
            VoiceCatalog(),
            bundle.text_tokenizer,
            silence_codes=codes,
            sine_codes=codes,
        )
