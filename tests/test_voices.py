"""The voice catalog as NVIDIA publishes voices (issue 30, items 3, 4 and 8): ``<NAME>.pt`` presets of input
embeddings and token cache, written here the way NVIDIA/personaplex ``moshi/moshi/models/lm.py``
``_step_voice_prompt_core`` writes them (``torch.save`` of a dict with the ``torch.stack`` of per-step
``embed_codes`` outputs and ``_streaming_state.cache``), at the tiny model's dimensions; ``voices.tgz`` with
its ``voices/`` folder; bad files of each kind refused and skipped; wav voices at −24 LUFS, zero-padded,
loaded before Mimi streams (a 5-slot node)."""

from __future__ import annotations

import asyncio
import copy
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pyloudnorm
import pytest
import sphn
import torch
from test_server_e2e import chat_url, http_get, running_server

from runtime import ipc
from runtime.config import RuntimeConfig
from runtime.engine import voice_files
from runtime.engine.local_slots import LocalSlots
from runtime.engine.model_presets import FRAME_SAMPLES, SAMPLE_RATE_HZ
from runtime.engine.models import ModelBundle, build_tiny
from runtime.engine.persona_limits import VOICE_PROMPT_RE
from runtime.engine.voices import CodesVoice, EmbeddingsVoice, VoiceCatalog, voices_source
from runtime.frontend.engine_client import EngineClient
from runtime.frontend.gate.query import parse_session_query
from runtime.frontend.gate.tokens import TokenClaims
from runtime.tools.loadgen import run_session

NVIDIA_VOICES = [f"NATF{i}" for i in range(4)] + [f"NATM{i}" for i in range(4)]
NVIDIA_VOICES += [f"VARF{i}" for i in range(5)] + [f"VARM{i}" for i in range(5)]
"""The 18 presets of ``nvidia/personaplex-7b-v1``'s ``voices.tgz``."""


@pytest.fixture(scope="module")
def bundle() -> ModelBundle:
    return build_tiny(0)


# --------------------------------------------------------------------------------------------------
# Files as NVIDIA writes them
# --------------------------------------------------------------------------------------------------


def nvidia_preset(lm, frames: int = 5, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """What NVIDIA's ``_step_voice_prompt_core`` saves after ``frames`` voice frames: ``embed_codes`` of
    each step's model input (``[B=1, S=1, dim]``: the text embedding plus the 16 audio codebooks'), for
    every step but the first (``step`` returns None at offset 0), stacked; and the ``[1, num_codebooks,
    max_delay + 3]`` token cache. In bf16, as the 7B runs."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    with torch.no_grad():
        for _ in range(frames - 1):
            tokens = torch.randint(0, lm.card, (1, lm.num_codebooks, 1), generator=generator)
            tokens[:, 0] = 3  # zero_text_code
            embedding = lm.text_emb(tokens[:, 0])
            for cb in range(lm.num_audio_codebooks):
                embedding = embedding + lm.emb[cb](tokens[:, cb + lm.audio_offset])
            steps.append(embedding.to(torch.bfloat16))  # [1, 1, dim]
    cache = torch.randint(0, lm.card, (1, lm.num_codebooks, max(lm.delays) + 3), generator=generator)
    cache[:, 0] = 3  # the text row: NVIDIA's voice steps feed zero_text_code (3) as the text
    return {"embeddings": torch.stack(steps, dim=0).detach().cpu(), "cache": cache}


def write_archive(path: Path, members: dict[str, bytes]) -> Path:
    """A gzipped tar of ``members`` (name -> bytes) under ``voices/``, as NVIDIA packs ``voices.tgz``."""
    with tarfile.open(path, "w:gz") as tar:
        folder = tarfile.TarInfo("voices")
        folder.type = tarfile.DIRTYPE
        folder.mode = 0o755
        tar.addfile(folder)
        for name, data in members.items():
            info = tarfile.TarInfo(name if "/" in name else f"voices/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def saved(value: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_nvidia_preset_loads_as_embeddings_under_its_published_name(bundle, tmp_path: Path) -> None:
    preset = nvidia_preset(bundle.lm, frames=6)
    torch.save(preset, tmp_path / "NATF2.pt")
    catalog = VoiceCatalog.load(tmp_path, bundle.mimi, lm=bundle.lm)
    assert catalog.names == ["NATF2"] and catalog.refused == ()
    voice = catalog.get("NATF2.pt")  # as NVIDIA's server and LiveKit's plugin name it
    assert voice is catalog.get("NATF2")
    assert isinstance(voice, EmbeddingsVoice)
    assert voice.embeddings.shape == (5, 1, 1, bundle.lm.dim) and voice.embeddings.dtype == torch.bfloat16
    assert torch.equal(voice.embeddings, preset["embeddings"])
    assert torch.equal(voice.cache, preset["cache"]) and voice.cache.shape == (1, 17, 4)


def test_voices_tgz_is_unpacked_once_beside_it(bundle, tmp_path: Path, monkeypatch) -> None:
    archive = write_archive(
        tmp_path / "voices.tgz",
        {f"{name}.pt": saved(nvidia_preset(bundle.lm, seed=i)) for i, name in enumerate(NVIDIA_VOICES)},
    )
    catalog = VoiceCatalog.load(tmp_path, bundle.mimi, lm=bundle.lm)
    assert catalog.names == sorted(NVIDIA_VOICES) and catalog.refused == ()
    assert isinstance(catalog.get("VARM4.pt"), EmbeddingsVoice)
    assert (tmp_path / "voices.tgz.unpacked" / "voices" / "NATF0.pt").is_file()

    def no_unpacking(*args, **kwargs):
        raise AssertionError("voices.tgz unpacked a second time")

    with monkeypatch.context() as patch:
        patch.setattr(voice_files.tarfile, "open", no_unpacking)
        again = VoiceCatalog.load(tmp_path, bundle.mimi, lm=bundle.lm)  # a second start
        assert again.names == sorted(NVIDIA_VOICES) and again.refused == ()
        also = VoiceCatalog.load(archive, bundle.mimi, lm=bundle.lm)  # the archive named itself
        assert also.names == sorted(NVIDIA_VOICES)
    write_archive(archive, {"NATF0.pt": saved(nvidia_preset(bundle.lm))})  # a new archive: unpacked again
    assert VoiceCatalog.load(tmp_path, bundle.mimi, lm=bundle.lm).names == ["NATF0"]


@pytest.mark.parametrize(
    "member",
    [
        pytest.param("../escape.pt", id="parent-path"),
        pytest.param("voices/../../escape.pt", id="nested-parent-path"),
    ],
)
def test_an_archive_reaching_outside_is_refused_and_the_rest_loads(bundle, tmp_path: Path, member) -> None:
    voices = tmp_path / "voices"
    voices.mkdir()
    write_archive(voices / "voices.tgz", {"NATF0.pt": saved(nvidia_preset(bundle.lm)), member: b"x"})
    torch.save(torch.randint(0, 2048, (8, 3)), voices / "bob.pt")
    catalog = VoiceCatalog.load(voices, bundle.mimi, lm=bundle.lm)
    assert catalog.names == ["bob"]
    [refused] = catalog.refused
    assert refused.file == "voices.tgz" and "cannot unpack voices.tgz" in refused.reason
    assert not (tmp_path / "escape.pt").exists()
    assert sorted(p.name for p in voices.iterdir()) == ["bob.pt", "voices.tgz"]  # nothing left half-unpacked


def test_an_archive_with_a_link_out_is_refused(bundle, tmp_path: Path) -> None:
    with tarfile.open(tmp_path / "voices.tgz", "w:gz") as tar:
        link = tarfile.TarInfo("voices/NATF0.pt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    catalog = VoiceCatalog.load(tmp_path, bundle.mimi, lm=bundle.lm)
    assert catalog.names == [] and [r.file for r in catalog.refused] == ["voices.tgz"]


# --------------------------------------------------------------------------------------------------
# Bad files: refused with their name and what was wrong, skipped
# --------------------------------------------------------------------------------------------------


class _NotATensor:
    pass


def test_bad_voice_files_are_refused_and_skipped(bundle, tmp_path: Path) -> None:
    good = nvidia_preset(bundle.lm)
    dim = bundle.lm.dim
    cases: dict[str, tuple[object, str]] = {
        "garbage.pt": (b"not a torch file", "unreadable as a torch file"),
        "pickled.pt": ({"embeddings": _NotATensor(), "cache": good["cache"]}, "unreadable as a torch file"),
        "old_keys.pt": ({"codes": good["cache"][0], "cache": good["cache"]}, "has keys ['cache', 'codes']"),
        "wrong_keys.pt": (
            {"embedding": good["embeddings"], "cache": good["cache"]},
            "expected {'embeddings'",
        ),
        "wide.pt": (
            {"embeddings": torch.zeros(4, 1, 1, dim * 2), "cache": good["cache"]},
            f"'embeddings' are {dim * 2} wide; this model's dim is {dim}",
        ),
        "batched.pt": (
            {"embeddings": torch.zeros(4, 2, 1, dim), "cache": good["cache"]},
            "'embeddings' must be [T, 1, 1, dim]",
        ),
        "long.pt": (
            {"embeddings": torch.zeros(bundle.lm.context, 1, 1, dim), "cache": good["cache"]},
            f"this model's context is {bundle.lm.context}",
        ),
        "nan.pt": (
            {"embeddings": torch.full((4, 1, 1, dim), float("nan")), "cache": good["cache"]},
            "NaN or infinite",
        ),
        "cache_rows.pt": (
            {"embeddings": good["embeddings"], "cache": torch.zeros(1, 9, 4, dtype=torch.long)},
            "'cache' is [1, 9, 4]; this model's LMGen cache is [1, 17, 4]",
        ),
        "cache_float.pt": (
            {"embeddings": good["embeddings"], "cache": good["cache"].float()},
            "'cache' must be an integer tensor",
        ),
        "codes_k.pt": (torch.zeros(4, 3, dtype=torch.long), "'codes' have 4 codebooks; Mimi here has 8"),
        "codes_range.pt": (torch.full((8, 3), 5000), "'codes' must lie in [0, 2048)"),
        "-bad name.pt": (torch.zeros(8, 2, dtype=torch.long), "the name must match"),
        "noise.wav": (b"RIFF....WAVEfmt not really", "unreadable as audio"),
        "anna.wav": (None, "voice 'anna' is already loaded from anna.pt"),
    }
    torch.save(good, tmp_path / "NATF2.pt")
    torch.save({"codes": torch.randint(0, 2048, (8, 4))}, tmp_path / "anna.pt")
    for name, (content, _) in cases.items():
        if isinstance(content, bytes):
            (tmp_path / name).write_bytes(content)
        elif content is None:
            sphn.write_wav(str(tmp_path / name), np.zeros((1, 4800), dtype=np.float32), SAMPLE_RATE_HZ)
        else:
            torch.save(content, tmp_path / name)
    catalog = VoiceCatalog.load(tmp_path, bundle.mimi, lm=bundle.lm)
    assert catalog.names == ["NATF2", "anna"]
    reasons = {r.file: r.reason for r in catalog.refused}
    assert sorted(reasons) == sorted(cases)
    for name, (_, expected) in cases.items():
        assert expected in reasons[name], (name, reasons[name])
    assert str(catalog.refused[0]) == f"{catalog.refused[0].file}: {catalog.refused[0].reason}"


def test_a_voices_dir_that_is_not_there_is_refused_not_fatal(bundle, tmp_path: Path) -> None:
    catalog = VoiceCatalog.load(tmp_path / "missing", bundle.mimi, lm=bundle.lm)
    assert catalog.names == [] and "is not a directory" in catalog.refused[0].reason


# --------------------------------------------------------------------------------------------------
# Wav voices: -24 LUFS, the last partial frame zero-padded, a short clip one padded frame
# --------------------------------------------------------------------------------------------------


class SpyMimi:
    """The tiny Mimi, recording what its encoder is fed (``[1, 1, N]``)."""

    def __init__(self, mimi) -> None:
        self.mimi = mimi
        self.inputs: list[np.ndarray] = []

    def parameters(self):
        return self.mimi.parameters()

    @property
    def num_codebooks(self) -> int:
        return self.mimi.num_codebooks

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x[0, 0].cpu().numpy().astype(np.float64))
        return self.mimi.encode(x)


def lufs(pcm: np.ndarray) -> float:
    return pyloudnorm.Meter(SAMPLE_RATE_HZ).integrated_loudness(pcm)


def test_wav_voice_is_fed_to_the_encoder_at_minus_24_lufs_and_zero_padded(bundle, tmp_path: Path) -> None:
    samples = int(2.5 * SAMPLE_RATE_HZ)  # 31.25 frames
    t = np.arange(samples) / SAMPLE_RATE_HZ
    quiet = (0.02 * np.sin(2 * np.pi * 330 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)
    sphn.write_wav(str(tmp_path / "anna.wav"), quiet[None], SAMPLE_RATE_HZ)
    source = sphn.read(str(tmp_path / "anna.wav"))[0][0].astype(np.float64)
    assert lufs(source) < -35  # far from the target
    spy = SpyMimi(bundle.mimi)
    catalog = VoiceCatalog.load(tmp_path, spy, lm=bundle.lm)
    [fed] = spy.inputs
    assert len(fed) == 32 * FRAME_SAMPLES  # the last partial frame kept, zero-padded
    assert np.all(fed[samples:] == 0) and np.any(fed[samples - 100 : samples] != 0)
    assert lufs(fed[:samples]) == pytest.approx(-24.0, abs=0.05)
    # the same gain on every sample: the shape of the clip is untouched
    assert np.allclose(
        fed[:samples] / np.max(np.abs(fed[:samples])), source / np.max(np.abs(source)), atol=1e-4
    )
    voice = catalog.get("anna")
    assert isinstance(voice, CodesVoice) and voice.codes.shape == (8, 32)


def test_a_clip_under_one_frame_is_one_zero_padded_frame_not_tiled(bundle, tmp_path: Path) -> None:
    samples = 1200  # 50 ms
    t = np.arange(samples) / SAMPLE_RATE_HZ
    sphn.write_wav(
        str(tmp_path / "short.wav"),
        (0.1 * np.sin(2 * np.pi * 440 * t))[None].astype(np.float32),
        SAMPLE_RATE_HZ,
    )
    spy = SpyMimi(bundle.mimi)
    catalog = VoiceCatalog.load(tmp_path, spy, lm=bundle.lm)
    [fed] = spy.inputs
    assert len(fed) == FRAME_SAMPLES and np.all(fed[samples:] == 0)
    # measured as the clip repeated past BS.1770's 400 ms block (pyloudnorm refuses shorter input)
    assert lufs(np.resize(fed[:samples], SAMPLE_RATE_HZ)) == pytest.approx(-24.0, abs=0.1)
    assert catalog.codes("short").shape == (8, 1)


def test_a_silent_wav_is_kept_silent_and_padded(bundle, tmp_path: Path) -> None:
    """Below BS.1770's -70 LUFS gate there is no loudness to scale (pyloudnorm gives -inf): kept as is."""
    silent = np.zeros((1, 3 * FRAME_SAMPLES + 500), dtype=np.float32)
    sphn.write_wav(str(tmp_path / "hush.wav"), silent, SAMPLE_RATE_HZ)
    spy = SpyMimi(bundle.mimi)
    catalog = VoiceCatalog.load(tmp_path, spy, lm=bundle.lm)
    assert catalog.names == ["hush"] and catalog.codes("hush").shape == (8, 4)
    assert len(spy.inputs[0]) == 4 * FRAME_SAMPLES and np.all(spy.inputs[0] == 0)


# --------------------------------------------------------------------------------------------------
# Where the voices come from: DUPLEX_VOICES_DIR, else the model's voices.tgz
# --------------------------------------------------------------------------------------------------


def test_voices_source_prefers_the_voices_dir_then_the_models_archive(tmp_path: Path, monkeypatch) -> None:
    weights = tmp_path / "personaplex"
    weights.mkdir()
    assert voices_source(tmp_path / "mine", str(weights)) == tmp_path / "mine"
    assert voices_source(None, str(weights)) is None  # no archive in the weights directory
    write_archive(weights / "voices.tgz", {})
    assert voices_source(None, str(weights)) == weights / "voices.tgz"
    assert voices_source(None, "random(seed=0)") is None

    asked: list[tuple[str, str, str | None]] = []

    def download(repo: str, filename: str, revision: str | None = None) -> str:
        asked.append((repo, filename, revision))
        if repo != "nvidia/personaplex-7b-v1":
            raise FileNotFoundError(f"{repo} has no {filename}")  # as EntryNotFoundError
        return str(weights / filename)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert voices_source(None, "nvidia/personaplex-7b-v1") == weights / "voices.tgz"
    assert voices_source(None, "kyutai/moshiko-pytorch-bf16") is None
    assert voices_source(None, "kyutai/moshiko-pytorch-bf16", from_hub=False) is None  # Moshi: never asked
    assert asked == [
        ("nvidia/personaplex-7b-v1", "voices.tgz", None),
        ("kyutai/moshiko-pytorch-bf16", "voices.tgz", None),
    ]


def test_a_node_lists_refused_voices_and_counts_them(bundle, tmp_path: Path) -> None:
    torch.save(nvidia_preset(bundle.lm), tmp_path / "NATF2.pt")
    torch.save({"codes": torch.zeros(8, 2)}, tmp_path / "broken.pt")
    config = RuntimeConfig(max_sessions=2, voices_dir=tmp_path, auth_mode="off")
    slots = LocalSlots(config, copy.deepcopy(bundle))
    status = slots.status()
    assert status.voices == ("NATF2",)
    assert status.voices_refused == (
        "broken.pt: 'codes' must be an integer tensor [K, T] of Mimi codes; got torch.float32 [8, 2]",
    )
    assert slots.metrics.voice_files_refused._value.get() == 1


def test_the_front_end_takes_nvidias_file_name_for_a_listed_voice() -> None:
    assert VOICE_PROMPT_RE.fullmatch("NATF2.pt")
    assert parse_session_query({"voice_prompt": "NATF2.pt"}).voice_prompt == "NATF2.pt"
    client = EngineClient("ipc:///nowhere", "worker-0", slots=2, clock=lambda: 100.0)
    message = ipc.Status(
        slots=2,
        free_slots=2,
        waiting=0,
        tick_alive=True,
        draining=False,
        voices=["NATF2"],
        voices_refused=["x.pt: y"],
    )
    client.status_message = ipc.decode(ipc.encode(message))  # type: ignore[assignment] (as broadcast)
    client.status_at = 100.0
    client.check_persona("NATF2.pt", None)
    client.check_persona("NATF2", None)
    with pytest.raises(ValueError, match="unknown voice_prompt 'NATM1.pt'; voices on this node: NATF2"):
        client.check_persona("NATM1.pt", None)
    assert client.status().voices_refused == ("x.pt: y",)


# --------------------------------------------------------------------------------------------------
# Item 4: a wav voice on a node of 5 slots (Mimi streams 5 rows once the engine exists)
# --------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_wav_voice_and_an_nvidia_preset_go_live_on_a_five_slot_node(bundle, tmp_path: Path) -> None:
    t = np.arange(int(0.9 * SAMPLE_RATE_HZ)) / SAMPLE_RATE_HZ
    sphn.write_wav(
        str(tmp_path / "anna.wav"),
        (0.2 * np.sin(2 * np.pi * 220 * t))[None].astype(np.float32),
        SAMPLE_RATE_HZ,
    )
    torch.save(nvidia_preset(bundle.lm), tmp_path / "NATF2.pt")
    (tmp_path / "bad.pt").write_bytes(b"nope")
    expected = VoiceCatalog.load(tmp_path, copy.deepcopy(bundle).mimi, lm=bundle.lm).codes("anna")
    assert expected.shape == (8, 12)  # 0.9 s: 11.25 frames, the last zero-padded
    async with running_server(bundle, max_sessions=5, voices_dir=tmp_path) as server:
        assert server.backend.engine.slots == 5
        assert torch.equal(server.backend.voices.codes("anna"), expected)  # encoded before Mimi streamed
        status, _, body = await http_get(server.port, "/api/personas")
        personas = json.loads(body)
        assert status == 200 and personas["voices"] == ["NATF2", "anna"]
        assert personas["voices_refused"][0].startswith("bad.pt: unreadable as a torch file")
        pcm = (0.05 * np.random.default_rng(0).standard_normal(SAMPLE_RATE_HZ)).astype(np.float32)
        result = await asyncio.wait_for(
            run_session(chat_url(server, voice_prompt="anna"), pcm, realtime=False, tail_s=0.5), 60
        )
        assert result.handshake and not result.errors and result.audio_messages > 0, result
        # NVIDIA's preset joins a live session under its published file name, as LiveKit's plugin asks.
        result = await asyncio.wait_for(
            run_session(chat_url(server, voice_prompt="NATF2.pt"), pcm, realtime=False, tail_s=0.5), 60
        )
        assert result.handshake and not result.errors and result.audio_messages > 0, result


def test_a_token_allowing_a_voice_allows_it_under_nvidias_file_name() -> None:
    claims = TokenClaims("jti", "k1", "node", ("NATF2",), 0.0, 0.0, 1e12)
    assert claims.allows_persona("NATF2.pt") and claims.allows_persona("NATF2")
    assert not claims.allows_persona("NATM1.pt")
    assert TokenClaims("jti", "k1", "node", ("NATF2.pt",), 0.0, 0.0, 1e12).allows_persona("NATF2")
