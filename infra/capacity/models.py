"""Model catalog: parameter counts by part, cache and state sizes, FLOPs per frame, derived from the configs.

The configs are the presets of ``runtime.engine.model_presets`` (the keyword sets moshi 0.2.13's ``LMModel``
and
``get_mimi`` are built from); every count below is the arithmetic of the module constructors of moshi 0.2.13
(``models/lm.py``, ``modules/transformer.py``, ``modules/gating.py``, ``modules/seanet.py``,
``modules/conv.py``, ``modules/resample.py``, ``quantization/vq.py``), written without torch. The test suite
checks these formulas against real modules: parameter counts of the 7B configs built on the meta device,
and the bytes of the streaming-state tensors of the tiny preset at batch B.

Figures for the real presets (from these formulas, equal to the meta-device counts):
- moshi-7b: 7,687,729,152 parameters; personaplex-7b as stored (dep_q 16): 8,371,408,896, as served (the
  agent's 8 depformer steps, ``get_model``): 7,687,729,152; Mimi: 79,308,609
  parameters + 16,842,784 buffer elements (codebooks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.engine.model_presets import FRAME_MS, PRESETS, get_preset, served_lm_kwargs

from .units import check_choice

MODEL_NAMES: tuple[str, ...] = tuple(n for n, p in PRESETS.items() if not p.extra.get("simulated"))
"""Model names the planner accepts: the runtime's presets but ``sim`` (a simulator, runtime/engine/sim.py)."""


# --------------------------------------------------------------------------------------------------------
# Parameter counting
# --------------------------------------------------------------------------------------------------------


@dataclass
class ParamTally:
    """Parameters of a module tree, split by how they are stored and used.

    Attributes:
        linear: weights of ``nn.Linear`` layers (quantised by moshi's INT8, read once per tick).
        linear_rows: output features of those layers (one fp32 scale each under LLM.int8).
        embedding: embedding tables (left in 16-bit by INT8; only gathered rows are read per tick).
        other: norms, layer scales, convolutions, biases (kept in their own dtype).
    """

    linear: int = 0
    linear_rows: int = 0
    embedding: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        """All parameters."""
        return self.linear + self.embedding + self.other

    def __iadd__(self, o: ParamTally) -> ParamTally:
        self.linear += o.linear
        self.linear_rows += o.linear_rows
        self.embedding += o.embedding
        self.other += o.other
        return self


def _linear(n_in: int, n_out: int, copies: int = 1) -> ParamTally:
    return ParamTally(linear=copies * n_in * n_out, linear_rows=copies * n_out)


def _norm(norm: str, dim: int) -> ParamTally:
    """``create_norm_fn`` (modules/transformer.py): RMS norms have one ``alpha`` of ``dim``; layer norms a
    weight and a bias."""
    if norm.startswith("rms_norm"):
        return ParamTally(other=dim)
    if norm.startswith("layer_norm"):
        return ParamTally(other=2 * dim)
    raise ValueError(f"norm: unknown value {norm!r}; allowed values: rms_norm, rms_norm_f32, layer_norm")


def gating_hidden(dim: int, dim_feedforward: int) -> int:
    """Hidden width of moshi's ``ActivationGating`` (modules/gating.py): 21/8 dim if dff = 4 dim, else 2/3 dff
    (moshi's rule)."""
    return (21 * dim) // 8 if dim_feedforward == 4 * dim else (2 * dim_feedforward) // 3


def transformer_layer_params(
    d_model: int,
    num_heads: int,
    dim_feedforward: int | list[int],
    *,
    gating: str = "none",
    norm: str = "layer_norm",
    layer_scale: float | None = None,
    weights_per_step: int = 0,
    kv_repeat: int = 1,
) -> ParamTally:
    """Parameters of one ``StreamingTransformerLayer`` (self-attention + feed-forward + 2 norms)."""
    mult = weights_per_step or 1
    kv_dim = (d_model // num_heads) * (num_heads // kv_repeat)
    t = ParamTally()
    t += _linear(d_model, d_model + 2 * kv_dim, mult)  # in_projs
    t += _linear(d_model, d_model, mult)  # out_projs
    dffs = dim_feedforward if isinstance(dim_feedforward, list) else [dim_feedforward] * mult
    if gating == "none":
        t += _linear(d_model, dffs[0])
        t += _linear(dffs[0], d_model)
    else:
        for dff in dffs[:mult]:
            hidden = gating_hidden(d_model, dff)
            t += _linear(d_model, 2 * hidden)
            t += _linear(hidden, d_model)
    t += _norm(norm, d_model)
    t += _norm(norm, d_model)
    if layer_scale is not None:
        t += ParamTally(other=2 * d_model)
    return t


def lm_param_tally(cfg: dict[str, Any]) -> dict[str, ParamTally]:
    """Parameters of ``LMModel(**cfg)`` by child module name (``emb``, ``transformer``, ``depformer`` ...).

    Covers the options the presets use: weights-per-step depformer, multi-linear depformer input, no
    conditioners, no extra heads, no low-rank embeddings, no demuxed text stream.
    """
    dim, n_q, dep_q, card = cfg["dim"], cfg["n_q"], cfg.get("dep_q", 8), cfg["card"]
    text_card = cfg["text_card"]
    norm = cfg.get("norm", "layer_norm")
    hidden_scale = cfg.get("hidden_scale", 4)
    out: dict[str, ParamTally] = {}
    out["emb"] = ParamTally(embedding=n_q * (card + 1) * dim)
    out["text_emb"] = ParamTally(embedding=(text_card + 1) * dim)
    out["text_linear"] = _linear(dim, cfg.get("text_card_out") or text_card)
    layer = transformer_layer_params(
        dim,
        cfg["num_heads"],
        int(hidden_scale * dim),
        gating=cfg.get("gating", "none"),
        norm=norm,
        layer_scale=cfg.get("layer_scale"),
        kv_repeat=cfg.get("kv_repeat", 1),
    )
    t = ParamTally()
    for _ in range(cfg["num_layers"]):
        t += layer
    out["transformer"] = t
    out["out_norm"] = _norm(norm, dim)
    d_dim = cfg.get("depformer_dim", 256)
    out["depformer_in"] = _linear(dim, d_dim, dep_q if cfg.get("depformer_multi_linear") else 1)
    out["depformer_emb"] = ParamTally(embedding=max(dep_q - 1, 0) * (card + 1) * d_dim)
    out["depformer_text_emb"] = ParamTally(embedding=(text_card + 1) * d_dim)
    d_dff = cfg.get("depformer_dim_feedforward") or int(hidden_scale * d_dim)
    wps = dep_q if cfg.get("depformer_weights_per_step") else 0
    d_layer = transformer_layer_params(
        d_dim,
        cfg.get("depformer_num_heads", 8),
        d_dff,
        gating=cfg.get("depformer_gating", "none"),
        norm=norm,
        layer_scale=cfg.get("depformer_layer_scale"),
        weights_per_step=wps,
    )
    dt = ParamTally()
    for _ in range(cfg.get("depformer_num_layers", 2)):
        dt += d_layer
    out["depformer"] = dt
    out["linears"] = _linear(d_dim, card, dep_q)
    return out


LM_PARTS: dict[str, tuple[str, ...]] = {
    "temporal_transformer": ("transformer", "out_norm"),
    "depformer": ("depformer_in", "depformer_emb", "depformer_text_emb", "depformer", "linears"),
    "embeddings_and_heads": ("emb", "text_emb", "text_linear"),
}
"""How the LM's child modules group into the parts the planner reports."""


# --------------------------------------------------------------------------------------------------------
# Mimi: layer list, parameters, state, FLOPs
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvSpec:
    """One streaming (transposed) convolution of Mimi, with its per-frame length.

    ``t_in`` is the input length (time steps) for one 80 ms frame at batch 1.
    """

    module: str
    transposed: bool
    c_in: int
    c_out: int
    kernel: int
    stride: int = 1
    dilation: int = 1
    groups: int = 1
    bias: bool = True
    t_in: int = 0

    @property
    def params(self) -> int:
        """Weights (+ bias) of the convolution."""
        return self.c_in * (self.c_out // self.groups) * self.kernel + (self.c_out if self.bias else 0)

    @property
    def state_elements(self) -> int:
        """Streaming state per slot: ``previous`` = c_in x (effective kernel - stride) for a convolution
        (modules/conv.py ``StreamingConv1d``), ``partial`` = c_out x (kernel - stride) for a transposed one.
        """
        if self.transposed:
            return self.c_out * (self.kernel - self.stride)
        return self.c_in * ((self.kernel - 1) * self.dilation + 1 - self.stride)

    @property
    def t_out(self) -> int:
        """Output length for one frame."""
        return self.t_in * self.stride if self.transposed else self.t_in // self.stride

    @property
    def flops(self) -> int:
        """FLOPs for one frame at batch 1 (2 per multiply-accumulate)."""
        if self.transposed:
            return 2 * self.c_in * (self.c_out // self.groups) * self.kernel * self.t_in
        return 2 * self.c_out * (self.c_in // self.groups) * self.kernel * self.t_out


def _seanet_convs(sea: dict[str, Any], frame_samples: int) -> tuple[list[ConvSpec], list[ConvSpec]]:
    """Encoder and decoder convolutions of ``SEANetEncoder``/``SEANetDecoder`` (modules/seanet.py)."""
    nf, ratios = sea["n_filters"], list(sea["ratios"])
    ch, dim, nres = sea["channels"], sea["dimension"], sea["n_residual_layers"]
    rk, db, comp = sea["residual_kernel_size"], sea["dilation_base"], sea["compress"]
    enc: list[ConvSpec] = []
    t = frame_samples
    enc.append(ConvSpec("encoder", False, ch, nf, sea["kernel_size"], t_in=t))
    mult = 1
    for ratio in reversed(ratios):
        for j in range(nres):
            hidden = mult * nf // comp
            enc.append(ConvSpec("encoder", False, mult * nf, hidden, rk, dilation=db**j, t_in=t))
            enc.append(ConvSpec("encoder", False, hidden, mult * nf, 1, t_in=t))
        enc.append(ConvSpec("encoder", False, mult * nf, 2 * mult * nf, 2 * ratio, stride=ratio, t_in=t))
        t //= ratio
        mult *= 2
    enc.append(ConvSpec("encoder", False, mult * nf, dim, sea["last_kernel_size"], t_in=t))
    dec: list[ConvSpec] = []
    mult = 2 ** len(ratios)
    dec.append(ConvSpec("decoder", False, dim, mult * nf, sea["kernel_size"], t_in=t))
    for ratio in ratios:
        dec.append(ConvSpec("decoder", True, mult * nf, mult * nf // 2, 2 * ratio, stride=ratio, t_in=t))
        t *= ratio
        for j in range(nres):
            c = mult * nf // 2
            dec.append(ConvSpec("decoder", False, c, c // comp, rk, dilation=db**j, t_in=t))
            dec.append(ConvSpec("decoder", False, c // comp, c, 1, t_in=t))
        mult //= 2
    dec.append(ConvSpec("decoder", False, nf, ch, sea["last_kernel_size"], t_in=t))
    return enc, dec


@dataclass(frozen=True)
class MimiArithmetic:
    """Mimi's parameters, per-slot streaming state and FLOPs per frame, from its config.

    Mimi runs in fp32 (moshi's server does not cast it), so all its bytes are 4 per element.
    """

    params_by_module: dict[str, int]
    buffer_elements: int
    encode_convs: list[ConvSpec]
    decode_convs: list[ConvSpec]
    transformer_kv_elements_per_slot: int
    """KV rings of the encoder and the decoder transformers together, per slot."""
    transformer_steps_per_frame: int
    transformer_linear_params: int
    transformer_layers: int
    transformer_context: int
    transformer_d_model: int

    @property
    def params(self) -> int:
        """All parameters."""
        return sum(self.params_by_module.values())

    @property
    def conv_state_elements_per_slot(self) -> int:
        """``previous`` + ``partial`` buffers of every streaming convolution, per slot."""
        return sum(c.state_elements for c in self.encode_convs + self.decode_convs)

    def _transformer_flops(self) -> int:
        per_step = 2 * self.transformer_linear_params + 4 * self.transformer_context * (
            self.transformer_d_model * self.transformer_layers
        )
        return per_step * self.transformer_steps_per_frame

    @property
    def encode_flops_per_frame(self) -> int:
        """Encoder convolutions + encoder transformer, one slot, one 80 ms frame."""
        return sum(c.flops for c in self.encode_convs) + self._transformer_flops()

    @property
    def decode_flops_per_frame(self) -> int:
        """Decoder convolutions + decoder transformer, one slot, one 80 ms frame."""
        return sum(c.flops for c in self.decode_convs) + self._transformer_flops()


def mimi_arithmetic(mc: dict[str, Any]) -> MimiArithmetic:
    """Parameters, state and FLOPs of ``get_mimi(None, mc)`` (models/loaders.py, models/compression.py)."""
    sea, tr, qz = mc["seanet"], mc["transformer"], mc["quantizer"]
    frame_samples = int(round(mc["sample_rate"] / mc["frame_rate"]))
    enc, dec = _seanet_convs(sea, frame_samples)
    hop = 1
    for r in sea["ratios"]:
        hop *= r
    encoder_rate = mc["sample_rate"] / hop
    steps = int(round(encoder_rate / mc["frame_rate"]))
    if steps != 1:  # ConvDownsample1d / ConvTrUpsample1d, learnt, channel-wise upsample (modules/resample.py)
        d = sea["dimension"]
        enc.append(ConvSpec("downsample", False, d, d, 2 * steps, stride=steps, bias=False, t_in=steps))
        dec.insert(0, ConvSpec("upsample", True, d, d, 2 * steps, stride=steps, groups=d, bias=False, t_in=1))
    d_model = tr["d_model"]
    layer = transformer_layer_params(
        d_model,
        tr["num_heads"],
        tr["dim_feedforward"],
        gating=tr.get("gating", "none"),
        norm=tr.get("norm", "layer_norm"),
        layer_scale=tr.get("layer_scale"),
    )
    proj = 0
    if tr["input_dimension"] != d_model:
        proj += tr["input_dimension"] * d_model
    proj += sum(d_model * o for o in tr["output_dimensions"] if o != d_model)
    tr_params = layer.total * tr["num_layers"] + proj
    tr_linear = layer.linear * tr["num_layers"] + proj
    q_dim, q_in, q_out, n_q, bins = (
        qz["dimension"],
        qz["input_dimension"],
        qz["output_dimension"],
        qz["n_q"],
        qz["bins"],
    )
    by_module = {
        "encoder": sum(c.params for c in enc if c.module == "encoder"),
        "decoder": sum(c.params for c in dec if c.module == "decoder"),
        "encoder_transformer": tr_params,
        "decoder_transformer": tr_params,
        # rvq_first and rvq_rest, each with forced 1x1 input and output projections, no bias (vq.py).
        "quantizer": 2 * (q_in * q_dim + q_dim * q_out),
        "downsample": sum(c.params for c in enc if c.module == "downsample"),
        "upsample": sum(c.params for c in dec if c.module == "upsample"),
    }
    # EuclideanCodebook buffers (core_vq.py): embedding_sum [bins, dim], cluster_usage [bins],
    # _initialized [1].
    buffers = n_q * (bins * q_dim + bins + 1)
    # encoder and decoder transformers: each a ring of `context` steps, keys and values, per layer
    kv = 2 * (2 * tr["num_layers"] * tr["context"] * d_model)
    return MimiArithmetic(
        by_module, buffers, enc, dec, kv, steps, tr_linear, tr["num_layers"], tr["context"], d_model
    )


# --------------------------------------------------------------------------------------------------------
# The model spec the planner works on
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: the LM and Mimi configs and their derived sizes.

    Attributes:
        name: preset name (``personaplex-7b``).
        lm: ``LMModel`` keyword arguments as served (``dep_q`` at most 8: ``served_lm_kwargs``).
        mimi: Mimi config.
        lm_params: LM parameters by child module, as served.
        mimi_arith: Mimi's parameters, state and FLOPs.
        stored_lm_params: LM parameters in the checkpoint (PersonaPlex's holds 16 depformer steps:
            8,371,408,896), or 0 when not given.
    """

    name: str
    lm: dict[str, Any]
    mimi: dict[str, Any]
    lm_params: dict[str, ParamTally] = field(repr=False)
    mimi_arith: MimiArithmetic = field(repr=False)
    stored_lm_params: int = 0

    # -- shape ------------------------------------------------------------------------------------------
    @property
    def layers(self) -> int:
        """Temporal transformer layers."""
        return self.lm["num_layers"]

    @property
    def dim(self) -> int:
        """Temporal transformer width."""
        return self.lm["dim"]

    @property
    def heads(self) -> int:
        """Temporal transformer attention heads."""
        return self.lm["num_heads"]

    @property
    def context(self) -> int:
        """KV ring length of the temporal transformer, in frames (3000 = 4 minutes for the 7B)."""
        return self.lm["context"]

    @property
    def codebooks(self) -> int:
        """Audio codebooks in the LM input (n_q: agent + user)."""
        return self.lm["n_q"]

    @property
    def dep_q(self) -> int:
        """Codebooks the depformer predicts per frame (its sequential steps per tick)."""
        return self.lm.get("dep_q", 8)

    @property
    def acoustic_delay_frames(self) -> int:
        """Largest codebook delay: frames between the semantic token and the complete audio frame."""
        return max(self.lm["delays"])

    @property
    def acoustic_delay_ms(self) -> float:
        """Acoustic delay in ms (80 ms for the 7B presets: FIELD-NOTES, '160 ms theoretical latency')."""
        return self.acoustic_delay_frames * FRAME_MS

    # -- parameters --------------------------------------------------------------------------------------
    def part_params(self) -> dict[str, int]:
        """Parameters by reported part: temporal transformer, depformer, embeddings and heads, Mimi."""
        out = {p: sum(self.lm_params[m].total for m in mods) for p, mods in LM_PARTS.items()}
        out["mimi"] = self.mimi_arith.params
        return out

    @property
    def lm_tally(self) -> ParamTally:
        """All LM parameters, split by storage kind."""
        t = ParamTally()
        for v in self.lm_params.values():
            t += v
        return t

    # -- per-slot caches, element counts -------------------------------------------------------------------
    def temporal_kv_elements_per_slot(self) -> int:
        """2 (K and V) x layers x context x (kv heads x head dim) elements per slot (``RingKVCache``)."""
        kv_dim = (self.dim // self.heads) * (self.heads // self.lm.get("kv_repeat", 1))
        return 2 * self.layers * self.context * kv_dim

    def depformer_kv_elements_per_slot(self) -> int:
        """2 x depformer layers x dep_q x depformer dim: the depformer's ring has ``dep_q`` positions
        (``weights_per_step`` capacity; lm.py sets its context to None). It lives for one tick."""
        d = self.lm.get("depformer_dim", 256)
        return 2 * self.lm.get("depformer_num_layers", 2) * self.dep_q * d

    def lmgen_token_elements_per_slot(self) -> int:
        """``LMGen``'s token cache, int64: (n_q + 1) x (max delay + 2) per slot (models/lm.py)."""
        return (self.codebooks + 1) * (self.acoustic_delay_frames + 2)

    # -- FLOPs ---------------------------------------------------------------------------------------------
    def lm_flops_per_frame(self) -> dict[str, int]:
        """FLOPs of one LM step for one slot: every linear weight once (2 FLOPs per weight: the depformer
        uses each step's weights once per frame) plus attention (QK and AV: 4 x positions x width per layer;
        the temporal ring is read whole every step)."""
        t = self.lm_params
        temporal_lin = t["transformer"].linear + t["text_linear"].linear
        dep_lin = t["depformer_in"].linear + t["depformer"].linear + t["linears"].linear
        d = self.lm.get("depformer_dim", 256)
        temporal_attn = 4 * self.context * self.dim * self.layers
        # step k of the depformer attends to k+1 positions of its ring
        dep_attn = 4 * d * self.lm.get("depformer_num_layers", 2) * sum(range(1, self.dep_q + 1))
        return {
            "temporal_linear": 2 * temporal_lin,
            "temporal_attention": temporal_attn,
            "depformer_linear": 2 * dep_lin,
            "depformer_attention": dep_attn,
        }


def get_model(name: str) -> ModelSpec:
    """Return the planner's view of preset ``name`` as ``duplex serve`` builds it; ``ValueError`` naming the
    allowed names otherwise.

    The LM is the served one (``runtime.engine.model_presets.served_lm_kwargs``): ``personaplex-7b``'s
    checkpoint stores 16 depformer steps, the runtime loads and runs the agent's 8, so its weights, depformer
    KV cache and per-tick depformer work are those of 8 steps. ``stored_lm_params`` keeps the checkpoint's
    count (what is downloaded and read from disk)."""
    check_choice("model", name, MODEL_NAMES)
    p = get_preset(name)
    served = served_lm_kwargs(p)
    return ModelSpec(
        name,
        served,
        p.mimi_config,
        lm_param_tally(served),
        mimi_arithmetic(p.mimi_config),
        stored_lm_params=sum(t.total for t in lm_param_tally(p.lm_kwargs).values()),
    )
