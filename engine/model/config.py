"""`ModelConfig`: the few numbers the decoder needs, read from a Hugging Face `config.json`.

One typed dataclass instead of a `PretrainedConfig`: the model never sees `transformers`. `from_hf`
maps the three supported families onto one set of switches (qkv bias, o bias, MLP bias, q/k norm),
rejects what the decoder cannot reproduce (sliding-window layers, non-SiLU MLPs, partial rotary,
unknown RoPE scaling) with a message that says what is supported, and keeps the original dict so
`to_hf` writes back every key it did not interpret (token ids, generation fields) unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# model_type -> the HF architecture class name written by `save_hf`.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def _supported_text() -> str:
    return ", ".join(f"{arch} (model_type {mt!r})" for mt, arch in SUPPORTED_ARCHITECTURES.items())


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, `transformers`' `rope_parameters` in typed form.

    `rope_type` is one of SUPPORTED_ROPE_TYPES. `factor` is used by linear/dynamic/llama3/yarn;
    `original_max_position_embeddings` by llama3/yarn; the rest by the variant named in its comment.
    """

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    # yarn: scale of cos/sin; None -> derived from factor/mscale
    attention_factor: float | None = None
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the correction range to whole dimensions


@dataclass(frozen=True)
class ModelConfig:
    """Shape and switches of one Llama / Qwen2 / Qwen3 decoder.

    Build it with `ModelConfig.from_hf(json.load(...))`, or directly (tests, the built-in tiny
    model); `to_hf()` gives back a `config.json` dict that `transformers` reads as the same model.
    """

    model_type: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_bias: bool = False  # bias on the output projection (Llama/Qwen3 `attention_bias`)
    mlp_bias: bool = False  # Llama `mlp_bias`
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    initializer_range: float = 0.02
    # the source config.json
    hf: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported model_type {self.model_type!r}; supported: {_supported_text()}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope.rope_type not in SUPPORTED_ROPE_TYPES:
            supported = ", ".join(SUPPORTED_ROPE_TYPES)
            raise ValueError(
                f"unsupported RoPE scaling {self.rope.rope_type!r}; supported: {supported}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` dict (transformers 4.x `rope_scaling` or 5.x
        `rope_parameters`).

        Raises ValueError naming the supported architectures / options when the config asks for
        something this decoder does not implement.
        """
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {archs or None} (model_type {model_type!r}); "
                f"supported: {_supported_text()}"
            )
        unknown = [a for a in archs if a != SUPPORTED_ARCHITECTURES[model_type]]
        if unknown:
            raise ValueError(
                f"unsupported architecture {unknown} for model_type {model_type!r}; "
                f"supported: {_supported_text()}"
            )
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(
                f"unsupported hidden_act {act!r}: the decoder implements SwiGLU (silu) only"
            )
        layer_types = cfg.get("layer_types") or []
        if cfg.get("use_sliding_window") or "sliding_attention" in layer_types:
            raise ValueError(
                "sliding-window attention layers are not "
                "supported (use_sliding_window / layer_types)"
            )
        if cfg.get("pretraining_tp", 1) not in (None, 1):
            raise ValueError(f"pretraining_tp={cfg['pretraining_tp']} is not supported (only 1)")

        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or (
            128 if model_type == "qwen3" else cfg["hidden_size"] // num_heads
        )
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope=_rope_from_hf(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            initializer_range=cfg.get("initializer_range", 0.02),
            hf=dict(cfg),
        )

    def to_hf(self, dtype: str | None = None) -> dict[str, Any]:
        """A `config.json` dict for this model: the source dict with every interpreted key
        overwritten."""
        if self.model_type == "qwen2" and (self.qkv_bias, self.o_bias, self.mlp_bias) != (
            True,
            False,
            False,
        ):
            raise ValueError(
                "qwen2 has q/k/v bias and no o/MLP bias; this config cannot be written as qwen2"
            )
        if self.model_type == "qwen3" and (
            self.qkv_bias != self.o_bias or self.mlp_bias or not self.qk_norm
        ):
            raise ValueError(
                "qwen3 has q/k norm and one attention_bias switch; this config is not qwen3"
            )
        if self.model_type == "llama" and (self.qkv_bias != self.o_bias or self.qk_norm):
            raise ValueError(
                "llama has one attention_bias switch and no q/k norm; this config is not llama"
            )
        cfg = dict(self.hf)
        rope = _rope_to_hf(self.rope)
        cfg.update(
            architectures=[SUPPORTED_ARCHITECTURES[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters=rope,
            # the same in the transformers 4.x form, which vLLM and older readers use
            rope_theta=self.rope.theta,
            rope_scaling=None
            if self.rope.rope_type == "default"
            else {k: v for k, v in rope.items() if k != "rope_theta"},
            tie_word_embeddings=self.tie_word_embeddings,
            initializer_range=self.initializer_range,
        )
        if self.model_type != "qwen2":
            cfg["attention_bias"] = self.o_bias
        if self.model_type == "llama":
            cfg["mlp_bias"] = self.mlp_bias
        if dtype is not None:
            cfg["dtype"] = cfg["torch_dtype"] = dtype  # 5.x and 4.x names
        return cfg


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    """`rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (transformers 4) ->
    RopeConfig."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported RoPE scaling {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only 1.0)")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is None:
        original = cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    factor = params.get("factor")
    if factor is None:
        if rope_type in ("linear", "dynamic", "llama3"):
            raise ValueError(f"RoPE {rope_type!r} needs a 'factor'")
        # yarn without a factor: transformers uses the ratio of the extended to the original
        # context.
        factor = cfg["max_position_embeddings"] / original if rope_type == "yarn" else 1.0
    return RopeConfig(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(factor),
        original_max_position_embeddings=original,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _rope_to_hf(rope: RopeConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"rope_type": rope.rope_type, "rope_theta": rope.theta}
    if rope.rope_type != "default":
        out["factor"] = rope.factor
    if rope.rope_type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = rope.original_max_position_embeddings
    if rope.rope_type == "llama3":
        out.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    if rope.rope_type == "yarn":
        out.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(rope, key) is not None:
                out[key] = getattr(rope, key)
    return out
