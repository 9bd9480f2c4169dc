"""INT8 execution of a quantized target (made by `spectrt quantize`, quant/quantize.py) in the torch engine.

A quantized checkpoint stores the ModelOpt-quantized tree-verify module's state: linear weights (smoothed,
for SmoothQuant), per-output-channel weight `amax`, and for W8A8 the calibrated per-tensor input `amax`
and the per-input-channel `pre_quant_scale`. Each projection then runs the arithmetic of ModelOpt's fake
quantizer, in integers where that is faster:

- **W8A8** (`int8_sq`): x * pre_quant_scale -> round(x * 127/amax) clamped to [-128, 127] -> `torch._int_mm`
  against the int8 weights (exact int32 accumulation) -> one per-channel multiply back to fp32. The int8
  operands are bit-identical to the fake quantizer's, so outputs match the fake-quantized model up to fp32
  rounding (tests/test_quant.py). Measured here (1 thread): 2-4x faster than fp32 `F.linear` at 5-32 rows.
- **weight-only** (`int8_wo`): the int8 weights are dequantized once at load and run by the fp32 kernels, the
  fake-quantized model's exact numerics. No speedup on this CPU: torch's int8-weight kernel
  (`_weight_int8pack_mm`) measured 7-35x slower than fp32 `F.linear`; weight-only pays off in the GPU plan.

The LM head, embeddings and norms stay fp32 (ModelOpt's INT8 recipes leave the head unquantized), and so
does any projection the recipe leaves unquantized (quant/quantize.py: the MLP down-projection under W8A8).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

QUANT_WEIGHTS = "quantized.safetensors"
MAX_BOUND = 127.0  # ModelOpt's INT8 quantizers: scale 127/amax, values saturated to [-128, 127]
MIN_BOUND = -128.0  # (narrow_range=False), as ONNX QuantizeLinear and TensorRT saturate
LINEARS = ("wqkv", "wo", "w13", "w2")
QFORMATS = ("int8_sq", "int8_wo")


def quant_format(checkpoint: Path) -> str | None:
    """The qformat of a quantized checkpoint (config.json's `spectrt_quant`), None for a plain one."""
    config = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    return (config.get("spectrt_quant") or {}).get("qformat")


def scale_of(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt's quantization scale 127/amax, 0 where amax is ~0 (such values quantize to 0)."""
    amax = amax.float()
    scale = torch.tensor(MAX_BOUND) / amax
    return torch.where(amax <= 1.0 / (1 << 24), torch.zeros_like(scale), scale)


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp((x * scale).round_(), MIN_BOUND, MAX_BOUND).to(torch.int8)


def dequantize_weight(weight: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The fake-quantized weight: round(w * 127/amax) / (127/amax), per output channel."""
    scale = scale_of(amax)
    return quantize(weight, scale).float() / torch.where(scale == 0, torch.ones_like(scale), scale)


class Int8Linear:
    """y = x W^T as W8A8: static per-tensor activation scale, per-channel weight scales, int32 GEMM."""

    def __init__(self, weight: torch.Tensor, weight_amax: torch.Tensor, input_amax: torch.Tensor,
                 pre_quant_scale: torch.Tensor | None):
        w_scale = scale_of(weight_amax.reshape(-1, 1))
        self.weight = quantize(weight.float(), w_scale)  # [N, K]; `.t()` is passed: _int_mm's fastest layout here
        self.input_scale = scale_of(input_amax.reshape(()))
        self.pre_quant_scale = pre_quant_scale.float() if pre_quant_scale is not None else None
        denom = self.input_scale * w_scale.reshape(-1)
        self.output_scale = torch.where(denom == 0, torch.zeros_like(denom), 1.0 / denom)

    @property
    def nbytes(self) -> int:
        vectors = [self.output_scale] + ([self.pre_quant_scale] if self.pre_quant_scale is not None else [])
        return self.weight.nbytes + sum(v.nbytes for v in vectors)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        return torch._int_mm(quantize(x, self.input_scale), self.weight.t()).float() * self.output_scale


def load_quantized(checkpoint: Path, config) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(HF-named fp32 tensors for `Transformer`, per layer the INT8 replacement of each fused projection);
    `config` is the checkpoint's runtime/model.ModelConfig. Biases and q/k norms stay fp32."""
    qformat = quant_format(checkpoint)
    if qformat not in QFORMATS:
        raise ValueError(f"{checkpoint}: unknown qformat {qformat!r} in config.json (expected one of {QFORMATS})")
    state = load_file(Path(checkpoint) / QUANT_WEIGHTS)
    weights = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm"]}
    if "head.weight" in state:
        weights["lm_head.weight"] = state["head.weight"]
    layers = []
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        weights[hf + "input_layernorm.weight"] = state[p + "attn_norm"]
        weights[hf + "post_attention_layernorm.weight"] = state[p + "mlp_norm"]
        if config.attention_bias:  # the fused module's bias, back under the names runtime/model.py reads
            for n, b in zip("qkv", state[p + "wqkv.bias"].split([q_dim, kv_dim, kv_dim]), strict=True):
                weights[hf + f"self_attn.{n}_proj.bias"] = b
        if config.output_bias:
            weights[hf + "self_attn.o_proj.bias"] = state[p + "wo.bias"]
        if config.qk_norm:
            weights[hf + "self_attn.q_norm.weight"] = state[p + "q_norm"]
            weights[hf + "self_attn.k_norm.weight"] = state[p + "k_norm"]
        layer = {}
        for name in LINEARS:
            w, amax = state[p + name + ".weight"], state.get(p + name + ".weight_quantizer._amax")
            if amax is None:  # a projection the recipe keeps in high precision
                layer[name] = w
            elif qformat == "int8_sq":
                layer[name] = Int8Linear(w, amax, state[p + name + ".input_quantizer._amax"],
                                         state.get(p + name + ".input_quantizer._pre_quant_scale"))
            else:
                layer[name] = dequantize_weight(w, amax)
        layers.append(layer)
    return weights, layers
