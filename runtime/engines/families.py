"""Model families: what differs between Llama, Mistral, Qwen2 and Qwen3 (as data for `ModelConfig`), and what is
refused at load because the one LLaMA-style forward would run it wrongly.

Everything here reads a Hugging Face config.json dict and follows transformers' modeling code for these families,
so a checkpoint runs as transformers runs it; `rope_frequencies` turns a RoPE scaling into one fixed table.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from spectrt.runtime.engines.model import ModelConfig

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
MULTIMODAL_KEYS = ("vision_config", "audio_config", "text_config", "vision_tower", "mm_projector_type")
ROPE_KEYS = {  # the parameters each supported scaling reads (Hugging Face's modeling_rope_utils names)
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"),
}


def rope_parameters(raw: dict) -> dict:
    """RoPE settings of a config.json: `rope_scaling` (older files) wins over `rope_parameters`, as in transformers."""
    return raw.get("rope_scaling") or raw.get("rope_parameters") or {}


def check_supported(raw: dict, name: str) -> None:
    """Refuse, naming the model type and the feature, a config.json this engine would run wrongly."""
    kind = raw.get("model_type")

    def refuse(feature: str) -> None:
        raise ValueError(f"{name} is a {kind!r} model with {feature}, which spectrt does not run; supported: "
                         f"{sorted(SUPPORTED_MODEL_TYPES)} dense text decoders")

    if any(k in raw for k in MULTIMODAL_KEYS):
        refuse("multimodal inputs (a vision/audio tower)")
    if any(raw.get(k) for k in MOE_KEYS):
        refuse("mixture-of-experts layers")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{name} is a {kind!r} model: model_type {kind!r} is not supported; spectrt runs "
                         f"{sorted(SUPPORTED_MODEL_TYPES)} checkpoints")
    window = sliding_window(raw)
    if window is not None and window < raw.get("max_position_embeddings", 0):
        refuse(f"sliding-window attention (window {window} < context {raw['max_position_embeddings']})")
    if raw.get("mlp_bias"):
        refuse("MLP biases (mlp_bias)")
    if raw.get("hidden_act", "silu") != "silu":
        refuse(f"activation {raw['hidden_act']!r} (only silu)")
    rope = rope_parameters(raw)
    if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        refuse("partial rotary embeddings (partial_rotary_factor)")
    rope_scaling_spec(raw, name)


def sliding_window(raw: dict) -> int | None:
    """The attention window some layer uses, None when every layer attends to the whole context."""
    window = raw.get("sliding_window")
    if raw.get("model_type") in ("qwen2", "qwen3"):  # Qwen slides only with use_sliding_window, from a layer on
        types = raw.get("layer_types")
        slides = raw.get("use_sliding_window") and (
            "sliding_attention" in types if types else raw.get("max_window_layers", 0) < raw["num_hidden_layers"])
        return window if slides else None
    return window


def family_features(raw: dict) -> dict:
    """Biases and q/k norms by family (Hugging Face's modeling code: Qwen2 always has q/k/v biases and no
    o_proj bias; Llama and Qwen3 put biases on all four projections when attention_bias; Mistral has none)."""
    kind, bias = raw["model_type"], bool(raw.get("attention_bias"))
    return {"attention_bias": kind == "qwen2" or (bias and kind in ("llama", "qwen3")),
            "output_bias": bias and kind in ("llama", "qwen3"),
            "qk_norm": kind == "qwen3"}


def rope_scaling_spec(raw: dict, name: str) -> tuple:
    """The RoPE scaling of a config.json as sorted (key, value) pairs; () for plain RoPE.

    Dynamic NTK is refused: its frequencies change with the longest position seen, so K/V cached earlier were
    rotated with another table and no fixed table reproduces Hugging Face's outputs."""
    rope = rope_parameters(raw)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return ()
    if kind == "dynamic":
        raise ValueError(f"{name} is a {raw.get('model_type')!r} model with dynamic NTK RoPE scaling, which spectrt "
                         "does not run: its frequencies depend on the sequence length reached, not one fixed table")
    if kind not in ROPE_KEYS:
        raise ValueError(f"{name} is a {raw.get('model_type')!r} model with RoPE type {kind!r}, which spectrt does "
                         f"not run (supported: default, {', '.join(ROPE_KEYS)})")
    spec = {k: rope[k] for k in ROPE_KEYS[kind] if rope.get(k) is not None}
    if kind in ("llama3", "yarn"):
        spec.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if kind == "yarn" and "factor" not in spec and raw.get("max_position_embeddings"):
        spec["factor"] = raw["max_position_embeddings"] / spec["original_max_position_embeddings"]
    required = ROPE_KEYS[kind] if kind == "llama3" else ROPE_KEYS[kind][:2]
    missing = [k for k in required if spec.get(k) is None]
    if missing:
        raise ValueError(f"{name}: RoPE type {kind!r} needs {missing} in its rope_scaling/rope_parameters")
    return tuple(sorted({"rope_type": kind, **spec}.items()))


def rope_frequencies(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies [head_dim/2] and the cos/sin scale, computed once for the whole context
    (Hugging Face's formulas, transformers/modeling_rope_utils.py, so outputs match its models)."""
    d, base = config.head_dim, config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2).float() / d))
    spec = dict(config.rope_scaling)
    kind = spec.get("rope_type", "default")
    if kind == "linear":
        return inv_freq / spec["factor"], 1.0
    if kind == "llama3":
        factor, low, high = spec["factor"], spec["low_freq_factor"], spec["high_freq_factor"]
        old = spec["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) * ~(wavelen > old / low)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(inv_freq, spec, d, base)
    return inv_freq, 1.0


def _yarn(inv_freq: torch.Tensor, spec: dict, d: int, base: float) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies by `factor`, keep high ones, ramp between; scale cos/sin by mscale."""
    factor = spec["factor"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = spec.get("attention_factor")
    if attention is None:
        m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return d * math.log(spec["original_max_position_embeddings"] / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(spec.get("beta_fast") or 32), correction_dim(spec.get("beta_slow") or 1)
    if spec.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / ((high - low) or 0.001), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, float(attention)


def family_tensors(config: ModelConfig, w: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """A layer's family-specific tensors from Hugging Face names: fused q/k/v bias, o_proj bias, q/k norms."""
    a = prefix + "self_attn."
    out = {}
    if config.attention_bias:
        out["bqkv"] = torch.cat([w[a + f"{n}_proj.bias"] for n in "qkv"])
    if config.output_bias:
        out["bo"] = w[a + "o_proj.bias"]
    if config.qk_norm:
        out["q_norm"], out["k_norm"] = w[a + "q_norm.weight"], w[a + "k_norm.weight"]
    return out
