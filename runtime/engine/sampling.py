"""Per-slot token sampling for the batched LM step.

moshi's ``LMGen`` samples every row with the same temperature and top-k (``utils/sampling.py``). Sessions
sharing a batch want their own, and a seeded session should draw the same tokens whether it runs alone or
beside others. This sampler gives each slot its own temperature and top-k for text and for audio, and
draws its randomness from a counter-based hash of (slot seed, slot step, stream, token id): no shared
random state, so one row's draws never depend on which other rows are active.

Sampling is Gumbel-max: ``argmax(logits / T + g)`` with ``g = -log(-log(u))`` draws exactly from
``softmax(logits / T)`` (Gumbel 1954; see e.g. Maddison et al. 2014, "A* Sampling"). Temperature 0 means
greedy (argmax of the logits).
"""

from __future__ import annotations

import torch

# The plain settings live with the slot backend's interface (torch-free, runtime.engine.api).
from runtime.engine.api import DEFAULT_AUDIO_TEMPERATURE, DEFAULT_AUDIO_TOP_K, DEFAULT_TEXT_TEMPERATURE
from runtime.engine.api import DEFAULT_TEXT_TOP_K as DEFAULT_TEXT_TOP_K
from runtime.engine.api import SamplingParams as SamplingParams

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """Murmur3's 32-bit finaliser on int64 tensors holding 32-bit values; wraps like uint32."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def counter_uniform(
    seed: torch.Tensor, step: torch.Tensor, stream: int | torch.Tensor, vocab: int
) -> torch.Tensor:
    """Uniform draws in (0, 1) from a hash of (seed, step, stream, token id).

    Args:
        seed: ``[B]`` int64, one per slot.
        step: ``[B]`` int64, the slot's own frame counter.
        stream: which token stream (0 text, 1 + codebook index for audio); an int, or a ``[S]`` int64
            tensor to draw S streams at once.
        vocab: number of candidate tokens V.
    Returns:
        ``[B, V]`` float32 for an int ``stream``, ``[B, S, V]`` for a tensor.
    """
    device = seed.device
    ids = torch.arange(vocab, device=device, dtype=torch.int64)
    streams = torch.as_tensor(stream, dtype=torch.int64, device=device).reshape(-1)  # [S]
    row = _mix32(seed * 0x9E3779B1 + 0x7F4A7C15)  # [B]
    row = _mix32(row[:, None] ^ (step[:, None] * 0x85EBCA77 + streams[None, :] * 0xC2B2AE3D))  # [B, S]
    x = _mix32(row[:, :, None] ^ (ids * 0x27D4EB2F + 0x165667B1))  # [B, S, V]
    uniform = ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)
    return uniform if isinstance(stream, torch.Tensor) else uniform[:, 0]


def gumbel_noise(uniform: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel draws from uniform ones in (0, 1): ``-log(-log(u))``."""
    return -torch.log(-torch.log(uniform))


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    seed: torch.Tensor,
    step: torch.Tensor,
    stream: int,
    top_k_bound: int | None = None,
    gumbel: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token per row with that row's own settings.

    Args:
        logits: ``[B, V]`` any float dtype.
        temperature: ``[B]`` float32; 0 means greedy for that row.
        top_k: ``[B]`` int64 in [1, V]; larger values are clamped to V.
        seed, step: ``[B]`` int64, see :func:`counter_uniform`.
        stream: token stream index.
        top_k_bound: a host-side upper bound on ``top_k`` (default V). Passing it keeps the candidate
            search to ``topk(bound)`` instead of a full sort, with no device-to-host sync.
        gumbel: ``[B, V]`` precomputed noise for this stream (see :meth:`SlotSamplingTable.audio_noise`);
            drawn here from (seed, step, stream) when None.
    Returns:
        ``[B]`` int64 token ids.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = logits.argmax(dim=-1)
    k = top_k.clamp(1, vocab)
    # The bound is a host int, so no device-to-host sync: the step stays capturable in a CUDA graph.
    bound = vocab if top_k_bound is None else max(1, min(vocab, top_k_bound))
    k = k.clamp(max=bound)
    top_values = logits.topk(bound, dim=-1).values  # [B, bound], descending
    threshold = top_values.gather(1, (k - 1)[:, None])  # [B, 1]: the k-th largest logit of each row
    safe_temperature = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / safe_temperature[:, None]
    scaled = scaled.masked_fill(logits < threshold, float("-inf"))
    if gumbel is None:
        gumbel = gumbel_noise(counter_uniform(seed, step, stream, vocab))
    sampled = (scaled + gumbel).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)


class SlotSamplingTable:
    """Sampling settings and step counters of every slot, as tensors the batched step reads.

    All tensors are ``[B]`` on the model's device. A slot's step counter is advanced by the engine each
    time that slot's LM row executes.
    """

    def __init__(self, slots: int, device: torch.device) -> None:
        self.slots = slots
        self.audio_temperature = torch.full((slots,), DEFAULT_AUDIO_TEMPERATURE, device=device)
        self.audio_top_k = torch.full((slots,), DEFAULT_AUDIO_TOP_K, device=device, dtype=torch.int64)
        self.text_temperature = torch.full((slots,), DEFAULT_TEXT_TEMPERATURE, device=device)
        self.text_top_k = torch.full((slots,), DEFAULT_TEXT_TOP_K, device=device, dtype=torch.int64)
        self.seed = torch.zeros(slots, device=device, dtype=torch.int64)
        self.step = torch.zeros(slots, device=device, dtype=torch.int64)
        # Host-side bounds of the top-k tensors: they only grow, so no sync is ever needed to read them.
        self.audio_top_k_bound = DEFAULT_AUDIO_TOP_K
        self.text_top_k_bound = DEFAULT_TEXT_TOP_K

    def assign(self, slot: int, params: SamplingParams) -> None:
        """Give ``slot`` the settings of a joining session and restart its step counter."""
        self.audio_temperature[slot] = params.audio_temperature
        self.audio_top_k[slot] = params.audio_top_k
        self.text_temperature[slot] = params.text_temperature
        self.text_top_k[slot] = params.text_top_k
        self.seed[slot] = params.seed
        self.step[slot] = 0
        self.audio_top_k_bound = max(self.audio_top_k_bound, params.audio_top_k)
        self.text_top_k_bound = max(self.text_top_k_bound, params.text_top_k)

    def advance(self, executed: torch.Tensor) -> None:
        """Count one step for the rows in ``executed`` (``[B]`` bool)."""
        self.step += executed.to(self.step.dtype)

    def sample_text(self, logits: torch.Tensor) -> torch.Tensor:
        """``[B, V_text]`` logits -> ``[B]`` text tokens."""
        return sample_rows(
            logits, self.text_temperature, self.text_top_k, self.seed, self.step, 0, self.text_top_k_bound
        )

    def audio_noise(self, codebooks: int, card: int) -> torch.Tensor:
        """Gumbel noise of every audio codebook of this step in one draw: ``[B, codebooks, card]``.

        The same values :meth:`sample_audio` would draw one codebook at a time (streams 1..codebooks).
        """
        streams = torch.arange(1, codebooks + 1, device=self.seed.device)
        return gumbel_noise(counter_uniform(self.seed, self.step, streams, card))

    def sample_audio(
        self, logits: torch.Tensor, codebook: int, gumbel: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[B, card]`` logits of one audio codebook -> ``[B]`` audio tokens.

        Args:
            gumbel: this codebook's ``[B, card]`` slice of :meth:`audio_noise`, or None to draw it here.
        """
        return sample_rows(
            logits,
            self.audio_temperature,
            self.audio_top_k,
            self.seed,
            self.step,
            1 + codebook,
            self.audio_top_k_bound,
            gumbel,
        )
