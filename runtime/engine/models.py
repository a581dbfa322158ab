"""Model loading: build Moshi-architecture models with moshi's own classes, from a preset or a checkpoint.

Three ways in, one result (:class:`ModelBundle`):

- :func:`build_tiny`: the ``tiny`` preset, random weights from a seed, a text tokenizer trained on a
  bundled paragraph. No download; runs on a CPU.
- :func:`load_checkpoint`: real weights from a local directory or a Hugging Face repo id, laid out as
  Kyutai's and NVIDIA's repos are (``model.safetensors``, the Mimi safetensors, the SentencePiece
  model, an optional ``config.json``, read and checked before any weight file is fetched:
  ``runtime.engine.checkpoint_config``). PersonaPlex checkpoints store 16 depformer steps; they are adapted
  to the number of steps the runtime builds (:func:`adapt_depformer_steps`).
- :func:`write_checkpoint`: the inverse, used by the tests to write the tiny model in the real layout.

INT8 weights (``quantize="int8"``, the runtime's ``DUPLEX_QUANTIZE``) go through moshi 0.2.13's own path,
``moshi/utils/quantize.py``: every ``nn.Linear`` of the LM becomes a ``QLinear`` (bitsandbytes LLM.int8:
int8 weight ``[out, in]`` + one fp32 scale per output row ``weight_scb``); embeddings and norms stay in
fp16, activations run in fp16 (``QLinear`` casts its input with ``.half()``), and the KV cache is fp16
(moshi's ``StreamingMultiheadAttention`` gives it fp16 for a ``QLinear`` projection). Mimi stays fp32. A
bf16/fp16 checkpoint is quantised at load one layer at a time (:func:`quantize_lm_int8`); Kyutai's
pre-quantised ``-q8`` layout (``model.q8.safetensors`` + ``"quantize": true`` in ``config.json``, written by
kyutai-labs/moshi ``scripts/export_quantized.py``) is loaded as it is, into ``LMModel(quantize=True)``.
The capacity planner counts the same split (``infra/capacity/memory.py``, ``lm_weight_bytes``).

The Hugging Face token is read at run time from ``HF_TOKEN`` by ``huggingface_hub``; it is never stored.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sentencepiece
import torch
from moshi.models.compression import MimiModel
from moshi.models.lm import LMModel
from moshi.models.loaders import get_mimi
from moshi.utils.quantize import QLinear, replace_linear_with_qlinear
from safetensors.torch import load_file, save_file

from runtime.engine.checkpoint_config import (
    LM_WEIGHTS_FILE,
    MIMI_WEIGHTS_FILE,
    TEXT_TOKENIZER_FILE,
    CheckpointConfigError,
    check_lm_kwargs,
    resolve_checkpoint_config,
)
from runtime.engine.model_presets import SERVED_DEPFORMER_STEPS, TINY_TEXT_VOCAB, ModelPreset, get_preset

log = logging.getLogger(__name__)

LM_Q8_WEIGHTS_FILE = "model.q8.safetensors"
"""Kyutai's name for a pre-quantised LM (moshi ``loaders.MOSHI_Q8_NAME``)."""
CONFIG_FILE = "config.json"
MIMI_CONFIG_FILE = "mimi_config.json"
QUANTIZE_CHOICES = ("none", "int8")
"""Values of ``DUPLEX_QUANTIZE``: ``none`` (weights at the LM dtype) or ``int8`` (moshi's LLM.int8 path)."""
INT8_COMPUTE_DTYPE = torch.float16
"""The dtype of everything but the int8 weights under ``int8``: moshi's ``QLinear`` computes in fp16."""
BITSANDBYTES_REQUIREMENT = "bitsandbytes>=0.45,<0.50"
"""Within moshi 0.2.13's own pin (``bitsandbytes<0.50``); the ``int8`` extra of pyproject.toml."""


class QuantizationError(ValueError):
    """INT8 weights cannot be used here (no bitsandbytes, a device its kernels do not run on, a mismatched
    checkpoint); the message says what to change."""


# Depformer parameters that exist once per depformer step (codebook): ``<group>.<index>.``. Only keys
# under ``depformer*`` and the output heads ``linears.`` are per step; the temporal transformer's
# ``self_attn.in_projs.0`` is not.
_PER_STEP_KEY = re.compile(
    r"^(?:depformer[^.]*(?:\.[^.]+)*?\.|)(depformer_in|depformer_emb|linears|gating|in_projs|out_projs)\.(\d+)\."
)
# Stacked per-step attention projections, as stored in Kyutai/NVIDIA checkpoints: [steps * rows, cols].
_STACKED_ATTN_KEY = re.compile(r"^depformer\.layers\.\d+\.self_attn\.(in_proj_weight|out_proj\.weight)$")


def _per_step_match(key: str) -> re.Match[str] | None:
    if not (key.startswith("depformer") or key.startswith("linears.")):
        return None
    return _PER_STEP_KEY.match(key)


_TINY_TOKENIZER_CORPUS = """\
Hello, how are you today? I am fine, thank you. What would you like to talk about?
The weather is nice and the sun is shining over the hills. Let us go for a walk.
Full duplex conversation means both people can listen and speak at the same time.
Our service runs many conversations on one graphics card, one frame every eighty milliseconds.
Please tell me more about your trip. Where did you go, and what did you see there?
I can help you book a table, check the news, or answer a question about science.
Numbers like one, two, three, four, five, six, seven, eight, nine and ten are common words.
"""


@dataclass
class ModelBundle:
    """Everything the batch engine needs from a model, on one device.

    Attributes:
        preset: the configuration the models were built from.
        lm: moshi ``LMModel`` in eval mode; ``lm.dep_q`` audio codebooks generated per step.
        mimi: moshi ``MimiModel`` set to ``lm.dep_q`` codebooks; 24 kHz, 1920-sample frames.
        text_tokenizer: SentencePiece model; ids >= its vocabulary size are never detokenised.
        source: where the weights came from ("random(seed=N)", a directory, or a repo id).
        quantize: ``none`` or ``int8`` (the LM's linear layers are moshi ``QLinear``).
    """

    preset: ModelPreset
    lm: LMModel
    mimi: MimiModel
    text_tokenizer: sentencepiece.SentencePieceProcessor
    source: str
    quantize: str = "none"

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def parameter_count(self) -> dict[str, int]:
        """Parameters by part: ``{"lm": n, "mimi": n}``."""
        return {
            "lm": sum(p.numel() for p in self.lm.parameters()),
            "mimi": sum(p.numel() for p in self.mimi.parameters()),
        }

    def lm_parameter_bytes(self) -> int:
        """Bytes of the LM's parameters as stored (int8 weights, their fp32 scales and fp16 rest under
        ``int8``); what the capacity planner's ``lm_weight_bytes`` predicts."""
        return sum(p.nbytes for p in self.lm.parameters())


def check_quantize(quantize: str) -> str:
    """Return ``quantize`` if it is one of :data:`QUANTIZE_CHOICES`.

    Raises:
        ValueError: anything else; the message lists the allowed values.
    """
    if quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {quantize!r}")
    return quantize


def check_int8_support(device: torch.device | str) -> None:
    """Refuse, with what to do, where moshi's INT8 path cannot run on ``device``.

    Checks that bitsandbytes is installed (within moshi's pin) and that its LLM.int8 kernels really run
    there: one 64 x 64 ``QLinear`` is quantised and applied on ``device``. bitsandbytes >= 0.45 ships CPU
    kernels, and CUDA kernels for GPUs of compute capability 7.5 and later (its installation guide); the
    probe catches whatever else is missing (a CUDA build without the device's kernels, an old driver).

    Raises:
        QuantizationError: bitsandbytes missing or too old/new, or its kernels failed on ``device``.
    """
    try:
        import bitsandbytes
    except ImportError:
        raise QuantizationError(
            f"DUPLEX_QUANTIZE=int8 needs bitsandbytes ({BITSANDBYTES_REQUIREMENT}, moshi's pin), which is "
            "not installed: pip install 'duplexops[int8]', or set DUPLEX_QUANTIZE=none"
        ) from None
    version = tuple(int(x) for x in re.findall(r"\d+", bitsandbytes.__version__)[:2])
    if not (0, 45) <= version < (0, 50):
        raise QuantizationError(
            f"DUPLEX_QUANTIZE=int8 needs {BITSANDBYTES_REQUIREMENT} (moshi 0.2.13's pin); "
            f"bitsandbytes {bitsandbytes.__version__} is installed"
        )
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise QuantizationError(f"DUPLEX_QUANTIZE=int8 on {device}: torch sees no CUDA device")
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (7, 5):
            raise QuantizationError(
                f"DUPLEX_QUANTIZE=int8 on {device}: compute capability {major}.{minor}; bitsandbytes' "
                "LLM.int8 kernels need 7.5 or later (T4, A10, L4, A100, H100); use DUPLEX_QUANTIZE=none"
            )
    try:
        generator = torch.Generator().manual_seed(0)
        linear = torch.nn.Linear(64, 64, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(64, 64, generator=generator))
        probe = QLinear(linear.to(device=device, dtype=INT8_COMPUTE_DTYPE)).to(device)
        probe.float()  # the scale stays fp32, as moshi keeps it
        with torch.no_grad():
            out = probe(torch.randn(2, 64, generator=generator).to(device=device, dtype=INT8_COMPUTE_DTYPE))
        if not torch.isfinite(out).all():
            raise RuntimeError("non-finite output")
    except Exception as exc:  # bitsandbytes raises RuntimeError/NotImplementedError/AssertionError
        raise QuantizationError(
            f"DUPLEX_QUANTIZE=int8: bitsandbytes {bitsandbytes.__version__} cannot run LLM.int8 on "
            f"{device} ({type(exc).__name__}: {exc}); use DUPLEX_QUANTIZE=none"
        ) from None


def quantize_lm_int8(lm: LMModel, device: torch.device | str) -> LMModel:
    """Quantise a float ``lm`` (on the CPU or the meta-free host) to moshi's INT8, one layer at a time.

    Each transformer layer (temporal and depformer) and each other child is moved to ``device`` in fp16 and
    its ``nn.Linear`` layers replaced by ``QLinear`` (``replace_linear_with_qlinear``, the function
    ``LMModel(quantize=True)`` calls) before the next is moved, so the device never holds more than the
    int8 result plus one layer in fp16. Peak device memory: the int8 model + the largest single layer in
    fp16 and its int8 copy (moshi-7b: a temporal layer is 0.21 B parameters, 0.41 GB in fp16 and 0.21 GB
    in int8; the int8 LM is 8.0 GB by the capacity planner's count; peak about 8.6 GB, against 15.4 GB for
    the bf16 LM). Host memory holds the float checkpoint while it is read, as for
    ``DUPLEX_QUANTIZE=none``.

    Returns:
        ``lm`` itself, in eval mode, on ``device``.
    """
    # (parent, attribute name, module): each transformer layer on its own, every other child whole.
    units: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    for name, child in lm.named_children():
        layers = getattr(child, "layers", None)
        if name in ("transformer", "depformer") and isinstance(layers, torch.nn.ModuleList):
            units.extend((layers, str(i), layer) for i, layer in enumerate(layers))
        else:
            units.append((lm, name, child))
    with torch.no_grad():
        for parent, name, module in units:
            module.to(device=device, dtype=INT8_COMPUTE_DTYPE)
            if isinstance(module, torch.nn.Linear):
                setattr(parent, name, QLinear(module))
            else:
                replace_linear_with_qlinear(module)
        lm.to(device=device)
        # As moshi does after init: a second pass keeps every scale in fp32 (``QLinear.float()``).
        replace_linear_with_qlinear(lm)
    return lm.eval()


def train_tiny_text_tokenizer(vocab_size: int = TINY_TEXT_VOCAB) -> sentencepiece.SentencePieceProcessor:
    """Train a small SentencePiece model on a bundled paragraph (deterministic, about 0.1 s).

    Ids follow Kyutai's convention for the special pieces the runtime relies on: 0 is ``<unk>`` (also the
    end-of-text padding id), 3 is the text padding piece, both never sent to clients.
    """
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(_TINY_TOKENIZER_CORPUS.splitlines()),
        model_writer=model,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        num_threads=1,
        minloglevel=2,
    )
    return sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())


def _seed_parameters(module: torch.nn.Module, seed: int, codebook_std: float = 1.0) -> None:
    """Re-initialise every parameter (and Mimi's codebook buffers) from ``seed``, independent of the global
    RNG and of build order."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(module.named_parameters()):
            if param.dim() >= 2:
                fan_in = param[0].numel()  # in_features (x kernel size for convolutions)
                std = 1.0 / max(1, fan_in) ** 0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
            elif name.endswith("alpha") or name.endswith("weight"):
                param.fill_(1.0)
            else:
                param.zero_()
        # Mimi's codebooks are buffers (EMA sums and usage counts), not parameters: left at their zero
        # init, every frame would quantise to code 0 and the model would never hear its input.
        for name, buffer in sorted(module.named_buffers()):
            if name.endswith("embedding_sum"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * codebook_std)
            elif name.endswith("cluster_usage") or name.endswith("_initialized"):
                buffer.fill_(1.0)


def _finish(
    lm: LMModel, mimi: MimiModel, device: torch.device | str, dtype: torch.dtype | None
) -> tuple[Any, Any]:
    """Both models on ``device`` in eval mode; the LM cast to ``dtype`` (None: a quantised LM, left as is);
    Mimi stays fp32."""
    lm = (lm.to(device=device) if dtype is None else lm.to(device=device, dtype=dtype)).eval()
    mimi = mimi.to(device=device).eval()
    mimi.set_num_codebooks(lm.dep_q)
    return lm, mimi


def build_tiny(
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    quantize: str = "none",
) -> ModelBundle:
    """Build the ``tiny`` preset with random weights drawn from ``seed``.

    Same seed, same weights, on any machine. Used for CPU tests, the demo and the benchmark.

    Args:
        quantize: ``int8`` quantises the seeded float weights with moshi's INT8 path (``dtype`` is then
            fp16 for everything but the int8 weights), as a bf16 checkpoint is quantised at load.
    Raises:
        QuantizationError: ``int8`` where bitsandbytes cannot run (see :func:`check_int8_support`).
    """
    check_quantize(quantize)
    preset = get_preset("tiny")
    lm = LMModel(**preset.lm_kwargs)
    _seed_parameters(lm, seed)
    mimi = get_mimi(None, preset.mimi_config, num_codebooks=preset.lm_kwargs["dep_q"])
    _seed_parameters(mimi, seed + 1)
    if quantize == "int8":
        check_int8_support(device)
        lm = quantize_lm_int8(lm.eval(), device)
        lm, mimi = _finish(lm, mimi, device, None)
    else:
        lm, mimi = _finish(lm, mimi, device, dtype)
    return ModelBundle(preset, lm, mimi, train_tiny_text_tokenizer(), f"random(seed={seed})", quantize)


def build_random(
    preset_name: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    dep_q: int | None = None,
    quantize: str = "none",
) -> ModelBundle:
    """Build any preset with random weights (moshi's own init), e.g. the 7B on a GPU for benchmarks.

    Args:
        dep_q: depformer steps to build; default the preset's. PersonaPlex's checkpoint layout has 16.
        quantize: ``int8`` builds ``LMModel(quantize=True)`` in fp16 (moshi quantises each layer as it is
            built, so the float model never exists whole).
    Raises:
        QuantizationError: ``int8`` where bitsandbytes cannot run.
    """
    check_quantize(quantize)
    preset = get_preset(preset_name)
    lm_kwargs = dict(preset.lm_kwargs)
    if dep_q is not None:
        lm_kwargs["dep_q"] = dep_q
    if quantize == "int8":
        check_int8_support(device)
        dtype = INT8_COMPUTE_DTYPE
    with torch.device(device):
        lm = LMModel(device=device, dtype=dtype, quantize=quantize == "int8", **lm_kwargs)
    mimi = get_mimi(None, preset.mimi_config, device=device, num_codebooks=min(lm.dep_q, 8))
    lm, mimi = _finish(lm, mimi, device, None if quantize == "int8" else dtype)
    mimi.set_num_codebooks(min(lm.dep_q, 8))
    return ModelBundle(preset, lm, mimi, train_tiny_text_tokenizer(), f"random({preset_name})", quantize)


def checkpoint_depformer_steps(state: Mapping[str, torch.Tensor]) -> int:
    """Number of depformer steps a checkpoint stores, counted from its ``linears.<i>.weight`` heads.

    Raises:
        ValueError: the state dict has no depformer output heads (not a Moshi-architecture checkpoint).
    """
    steps = {int(m.group(1)) for k in state for m in [re.match(r"^linears\.(\d+)\.weight$", k)] if m}
    if not steps:
        raise ValueError(
            "checkpoint has no 'linears.<i>.weight' keys: not a Moshi-architecture LM checkpoint"
        )
    return max(steps) + 1


def adapt_depformer_steps(state: dict[str, torch.Tensor], target_steps: int) -> dict[str, torch.Tensor]:
    """Adapt a checkpoint's depformer to ``target_steps`` steps (codebooks generated per frame).

    PersonaPlex checkpoints carry 16 steps: the agent's 8 codebooks, then the user's 8, which the runtime
    never needs (the user's real codebooks overwrite them). Since the depformer is causal over steps,
    keeping steps 0..7 gives the same agent tokens with half the depformer work (NVIDIA/personaplex PR 103
    argues the same). The reverse (8 stored, 16 wanted) copies index i - 8 into index i, as NVIDIA's loader
    does; ``depformer_emb`` has one entry fewer than steps, and its new entries are copied cyclically.

    Handles both the per-step keys (``depformer_in.<i>``, ``depformer_emb.<i>``, ``linears.<i>``,
    ``...gating.<i>``, ``...in_projs.<i>``) and the stacked attention projections that real checkpoints
    store (``self_attn.in_proj_weight`` of shape ``[steps * 3 * d, d]``, ``self_attn.out_proj.weight`` of
    shape ``[steps * d, d]``).

    Returns:
        A new dict; the input is not modified.
    Raises:
        ValueError: ``target_steps`` < 1, or growing by more than the stored step count.
    """
    stored_steps = checkpoint_depformer_steps(state)
    if target_steps < 1:
        raise ValueError(f"target depformer steps must be >= 1, got {target_steps}")
    if target_steps > 2 * stored_steps:
        raise ValueError(f"cannot grow a depformer from {stored_steps} to {target_steps} steps (at most x2)")
    if stored_steps == target_steps:
        return dict(state)
    # Entries per group as stored (depformer_emb has steps - 1); the target keeps the same offset.
    stored_count: dict[str, int] = {}
    for key in state:
        match = _per_step_match(key)
        if match:
            group = key[: match.start(2)] + match.group(1)
            stored_count[group] = max(stored_count.get(group, 0), int(match.group(2)) + 1)
    adapted: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if _STACKED_ATTN_KEY.match(key):
            per_step = tensor.view(stored_steps, -1, *tensor.shape[1:])
            if target_steps <= stored_steps:
                per_step = per_step[:target_steps]
            else:
                per_step = torch.cat([per_step, per_step[: target_steps - stored_steps]], dim=0)
            adapted[key] = per_step.reshape(-1, *tensor.shape[1:]).clone()
            continue
        match = _per_step_match(key)
        if match is None:
            adapted[key] = tensor
            continue
        group = key[: match.start(2)] + match.group(1)
        count = stored_count[group]
        target_count = count + target_steps - stored_steps
        index = int(match.group(2))
        if index < target_count:
            adapted[key] = tensor
        for new_index in range(count, target_count):
            if new_index % count == index:
                adapted[key[: match.start(2)] + str(new_index) + key[match.end(2) :]] = tensor
    return adapted


def _resolve_file(source: str, filename: str, revision: str | None) -> Path:
    """``filename`` of the checkpoint at ``source`` (a directory or a repo id), or, for a name of the form
    ``hf://<owner>/<repo>/<file>`` (how Kyutai's ``-q8`` configs point at the bf16 repo's Mimi and text
    tokenizer, kyutai-labs/moshi ``scripts/export_quantized.py``), that file of that repo.

    Raises:
        FileNotFoundError: a directory without the file.
        ValueError: a malformed ``hf://`` name.
    """
    if filename.startswith("hf://"):
        parts = filename.removeprefix("hf://").split("/", 2)
        if len(parts) != 3 or not all(parts):
            raise ValueError(f"checkpoint file {filename!r}: expected hf://<owner>/<repo>/<file>")
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(f"{parts[0]}/{parts[1]}", parts[2]))
    directory = Path(source)
    if directory.is_dir():
        path = directory / filename
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint directory {directory} has no {filename}")
        return path
    from huggingface_hub import hf_hub_download

    return Path(hf_hub_download(source, filename, revision=revision))


def _read_json(source: str, filename: str, revision: str | None) -> Any:
    """Parse ``filename`` of the checkpoint (a directory's file or one downloaded from the repo).

    Raises:
        CheckpointConfigError: the file is not valid JSON.
        FileNotFoundError: a directory without the file.
    """
    path = _resolve_file(source, filename, revision)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointConfigError(f"{source} {filename}: not valid JSON ({exc})") from None


def _read_config(source: str, revision: str | None) -> Any:
    """The checkpoint's parsed ``config.json``, or None where it has none (``kyutai/moshi*-pytorch-bf16``).
    Only this file is fetched."""
    try:
        return _read_json(source, CONFIG_FILE, revision)
    except FileNotFoundError:
        return None
    except CheckpointConfigError:
        raise
    except Exception as exc:  # huggingface_hub raises EntryNotFoundError for a repo without config.json
        if type(exc).__name__ in {"EntryNotFoundError", "RemoteEntryNotFoundError"}:
            return None
        raise


def load_checkpoint(
    source: str,
    preset_name: str,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    dep_q: int | None = None,
    revision: str | None = None,
    quantize: str = "none",
) -> ModelBundle:
    """Load real weights from a local directory or a Hugging Face repo id, laid out as published.

    Reads the layouts of ``nvidia/personaplex-7b-v1`` (a metadata-only ``config.json``, a 16-step
    depformer), ``kyutai/moshiko-pytorch-bf16`` and ``moshika`` (no ``config.json``) and the ``-q8`` repos
    (``model.q8.safetensors``, ``"quantize": true``): ``model.safetensors`` (LM),
    ``tokenizer-e351c8d8-checkpoint125.safetensors`` (Mimi), ``tokenizer_spm_32k_3.model`` (text), and
    ``config.json`` where there is one. The configuration is the preset's with the ``LMModel`` keys of
    ``config.json`` merged over it (``runtime.engine.checkpoint_config``: deprecated keys dropped as moshi
    0.2.13 drops them, metadata ignored, file names and ``quantize`` read). ``config.json`` is fetched and
    checked first, the LM skeleton built on the meta device from it, and INT8 support probed, all before
    any weight file is fetched: a configuration that cannot be used costs no download.

    Args:
        source: directory path, or repo id such as ``nvidia/personaplex-7b-v1`` (token from ``HF_TOKEN``).
        preset_name: the architecture the runtime expects; ``config.json`` keys are merged over it.
        dtype: LM weight dtype (bf16 on Ampere and later; fp16 on a T4, which has no bf16).
        dep_q: depformer steps to build; default 8 (the agent's codebooks), whatever the checkpoint holds.
        quantize: ``int8``: a float checkpoint is quantised at load, layer by layer
            (:func:`quantize_lm_int8`); a pre-quantised ``-q8`` one (``"quantize": true`` in its
            ``config.json``, int8 ``weight`` + fp32 ``weight_scb`` per linear layer) is loaded into
            ``LMModel(quantize=True)``. ``dtype`` is ignored (fp16). ``none``: float weights only.
    Raises:
        CheckpointConfigError: ``config.json`` cannot be used (names the key and what is allowed); raised
            before any weight file is fetched.
        FileNotFoundError: a file is missing from the directory.
        ValueError: unknown preset, or weights that do not match the configuration (names the keys).
        QuantizationError: a ``-q8`` checkpoint with ``quantize="none"``, or INT8 where it cannot run;
            raised before any weight file is fetched.
    """
    check_quantize(quantize)
    preset = get_preset(preset_name)
    plan = resolve_checkpoint_config(_read_config(source, revision), preset, where=f"{source} {CONFIG_FILE}")
    names = plan.names
    mimi_config = preset.mimi_config
    if names["mimi_config_name"]:
        mimi_config = _read_json(source, names["mimi_config_name"], revision)
        if not isinstance(mimi_config, dict):
            raise CheckpointConfigError(f"{source} {names['mimi_config_name']}: expected a JSON object")
    prequantized = plan.prequantized
    if prequantized and quantize != "int8":
        raise QuantizationError(
            f'{source} holds INT8 weights (a -q8 checkpoint: config.json has "quantize": true); '
            "set DUPLEX_QUANTIZE=int8 to serve it, or use its bf16 checkpoint"
        )
    if quantize == "int8":
        check_int8_support(device)
        dtype = INT8_COMPUTE_DTYPE
    lm_kwargs = dict(plan.lm_kwargs)
    target_steps = dep_q if dep_q is not None else min(lm_kwargs["dep_q"], SERVED_DEPFORMER_STEPS)
    lm_kwargs["dep_q"] = target_steps
    # The skeleton the weights are assigned into, built before any download: LMModel's own refusals too.
    lm = check_lm_kwargs(lm_kwargs, quantize=prequantized, dtype=dtype, where=f"{source} {CONFIG_FILE}")
    if plan.ignored:
        log.info("%s %s: ignored %s", source, CONFIG_FILE, ", ".join(plan.ignored))
    assert names["moshi_name"] and names["mimi_name"] and names["tokenizer_name"]
    state = load_file(str(_resolve_file(source, names["moshi_name"], revision)), device="cpu")
    state = adapt_depformer_steps(state, target_steps)
    state = {
        k: (v.to(dtype) if v.dtype.is_floating_point and not k.endswith("weight_scb") else v)
        for k, v in state.items()
    }
    try:
        lm.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise ValueError(
            f"LM weights in {source} do not match the {preset_name} configuration"
            f"{' (INT8)' if prequantized else ''}: {exc}"
        ) from exc
    cast_to: torch.dtype | None = dtype  # what _finish casts the LM to; None leaves a quantised LM as is
    if quantize == "int8":
        # -q8: already QLinear, moved whole (it is the int8 size); float: quantised layer by layer.
        lm = lm.to(device) if prequantized else quantize_lm_int8(lm, device)
        cast_to = None
    mimi = get_mimi(
        str(_resolve_file(source, names["mimi_name"], revision)), mimi_config, num_codebooks=target_steps
    )
    tokenizer = sentencepiece.SentencePieceProcessor(
        model_file=str(_resolve_file(source, names["tokenizer_name"], revision))
    )
    lm, mimi = _finish(lm, mimi, device, cast_to)
    log.info(
        "loaded %s from %s (depformer steps %d, quantize %s%s; from %s: %s)",
        preset_name,
        source,
        target_steps,
        quantize,
        ", pre-quantised" if prequantized else "",
        CONFIG_FILE,
        ", ".join(plan.taken) or "nothing",
    )
    return ModelBundle(preset, lm, mimi, tokenizer, source, quantize)


def _stack_attention_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of moshi's load hook: ``in_projs.<i>.weight`` -> stacked ``in_proj_weight`` (real layout); an
    INT8 state's scales likewise, ``in_projs.<i>.weight_scb`` -> ``in_proj_weight_scb``, as Kyutai's February
    2025 ``-q8`` export stored them (kyutai-labs/moshi ba92f01 ``quantize_transformer``)."""
    stacked: dict[str, torch.Tensor] = {}
    groups: dict[tuple[str, str, str], dict[int, torch.Tensor]] = {}
    pattern = re.compile(r"^(.*\.self_attn\.)(in_projs|out_projs)\.(\d+)\.weight(_scb)?$")
    for key, tensor in state.items():
        match = pattern.match(key)
        if match:
            group = (match.group(1), match.group(2), match.group(4) or "")
            groups.setdefault(group, {})[int(match.group(3))] = tensor
        else:
            stacked[key] = tensor
    for (prefix, kind, suffix), per_step in groups.items():
        name = ("in_proj_weight" if kind == "in_projs" else "out_proj.weight") + suffix
        stacked[prefix + name] = torch.cat([per_step[i] for i in sorted(per_step)], dim=0).contiguous()
    return stacked


def write_checkpoint(bundle: ModelBundle, directory: Path, *, with_config: bool = True) -> Path:
    """Write ``bundle`` in the real checkpoint layout that :func:`load_checkpoint` reads.

    The depformer attention projections are stored stacked, as in Kyutai's and NVIDIA's files. An INT8
    bundle is written in Kyutai's ``-q8`` layout instead (kyutai-labs/moshi ``scripts/export_quantized.py``):
    the quantised model's own state dict in ``model.q8.safetensors`` (per-step projections, int8
    ``weight`` + fp32 ``weight_scb``), and ``"quantize": true`` with ``moshi_name`` in ``config.json``.
    Returns the directory.
    """
    directory.mkdir(parents=True, exist_ok=True)
    lm_state = {k: v.detach().cpu().contiguous() for k, v in bundle.lm.state_dict().items()}
    quantized = bundle.quantize == "int8"
    if quantized:
        save_file(lm_state, str(directory / LM_Q8_WEIGHTS_FILE))
    else:
        save_file(_stack_attention_projections(lm_state), str(directory / LM_WEIGHTS_FILE))
    mimi_state = {k: v.detach().cpu().contiguous() for k, v in bundle.mimi.state_dict().items()}
    save_file(mimi_state, str(directory / MIMI_WEIGHTS_FILE))
    (directory / TEXT_TOKENIZER_FILE).write_bytes(bundle.text_tokenizer.serialized_model_proto())
    if with_config:
        config = {**bundle.preset.lm_kwargs, "dep_q": bundle.lm.dep_q, "mimi_config_name": MIMI_CONFIG_FILE}
        if quantized:
            config.update({"quantize": True, "moshi_name": LM_Q8_WEIGHTS_FILE})
        (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
        (directory / MIMI_CONFIG_FILE).write_text(
            json.dumps(bundle.preset.mimi_config, indent=2, sort_keys=True)
        )
    return directory


def load_model(
    model: str,
    *,
    weights: str | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    quantize: str = "none",
) -> ModelBundle:
    """The runtime's single entry: ``tiny`` builds random weights; any other preset loads ``weights``
    (a directory or repo id; default the preset's repo).

    Args:
        quantize: ``none`` or ``int8`` (``DUPLEX_QUANTIZE``; see the module docstring).
    Raises:
        ValueError: unknown preset, or ``tiny`` given weights that do not fit it.
        QuantizationError: ``int8`` where bitsandbytes cannot run, or a ``-q8`` checkpoint without it.
    """
    check_quantize(quantize)
    preset = get_preset(model)
    if dtype is None:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if weights is None:
        if preset.default_source is None:
            return build_tiny(seed=seed, device=device, dtype=dtype, quantize=quantize)
        weights = preset.default_source
    return load_checkpoint(weights, model, device=device, dtype=dtype, quantize=quantize)
