"""INT8 execution of a quantized target (made by `spectrt quantize`, quant/quantize.py) in the torch engine.

A quantized checkpoint stores the ModelOpt-quantized tree-verify module's state: linear weights (smoothed,
for SmoothQuant), per-output-channel weight `amax`, and for W8A8 the calibrated per-tensor input `amax`
and the per-input-channel `pre_quant_scale`; config.json's `spectrt_quant` says how to run it (the recipe's
run-time fields, quant/recipes.py). Each projection runs the arithmetic of ModelOpt's fake quantizer, in
integers where that is faster:

- **W8A8** (`int8_sq`, `int8_sq_static`): x * pre_quant_scale -> round(x * s) clamped to [-128, 127] ->
  `torch._int_mm` against the int8 weights (exact int32 accumulation) -> one per-channel multiply back to fp32
  (and 1/s per row). s is the calibrated 127/amax (`activations: static`) or each row's own 127/max|x_row|
  (`per_token`). The int8 operands are bit-identical to the fake quantizer's, so outputs match the
  fake-quantized model up to fp32 rounding (tests/test_quant.py). The native forward (runtime/engines/cpu_kernels.cpp)
  runs the same arithmetic with VNNI.
- **weight-only** (`int8_wo`): the int8 weights are dequantized once at load and run by the fp32 kernels, the
  fake-quantized model's exact numerics.

Embeddings and norms stay fp32; the LM head and any projection the recipe leaves unquantized keep the recipe's
`kept_dtype` (fp32, or bf16 values: half the bytes on the native forward, exact to widen).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

QUANT_WEIGHTS = "quantized.safetensors"
MAX_BOUND = 127.0  # ModelOpt's INT8 quantizers: scale 127/amax, values saturated to [-128, 127]
MIN_BOUND = -128.0  # (narrow_range=False), as ONNX QuantizeLinear and TensorRT saturate
PROJECTIONS = ("wqkv", "wo", "w13", "w2")  # fused q/k/v, attention output, gate/up, down: what a recipe quantizes
KEPT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def quant_spec(checkpoint: Path) -> dict:
    """config.json's `spectrt_quant` (the recipe a checkpoint was made with), {} for a plain checkpoint."""
    config = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    return config.get("spectrt_quant") or {}


def quant_format(checkpoint: Path) -> str | None:
    """The qformat (recipe name) of a quantized checkpoint, None for a plain one."""
    return quant_spec(checkpoint).get("qformat")


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
    """y = x W^T as W8A8 with int32 GEMMs. Weights: one scale per output channel (ModelOpt's `weight_amax`) or, with
    `group`, one per (channel, group of `group` input channels), computed here from `weight`. Activations: one
    static per-tensor scale (calibrated `input_amax`) or, `per_token`, each row's own scale per group (the whole
    row without `group`): 127 / max|x|."""

    def __init__(self, weight: torch.Tensor, weight_amax: torch.Tensor | None, input_amax: torch.Tensor | None,
                 pre_quant_scale: torch.Tensor | None, per_token: bool = False, group: int | None = None):
        n, k = weight.shape
        if group is not None and (group % 4 or not per_token):
            raise ValueError(f"a scale group of {group} input channels needs per-token activations and a multiple of 4")
        self.group = group if group is not None and group < k else k
        self.per_token = per_token
        self.pre_quant_scale = pre_quant_scale.float() if pre_quant_scale is not None else None
        bounds = [(k0, min(k0 + self.group, k)) for k0 in range(0, k, self.group)]
        if self.group == k and weight_amax is not None:  # ModelOpt's per-channel weight scales
            w_scale = scale_of(weight_amax.reshape(-1, 1)).expand(n, 1)
        else:
            w_scale = torch.cat([scale_of(weight[:, a:b].float().abs().amax(1, keepdim=True)) for a, b in bounds], 1)
        full = torch.cat([w_scale[:, [i]].expand(n, b - a) for i, (a, b) in enumerate(bounds)], 1)
        self.weight = quantize(weight.float(), full)  # [N, K]
        self.bounds = bounds
        self._blocks: list[torch.Tensor] | None = None  # per group [G, N] operands of the torch path, made on first use
        # static: the input scale folded into the output scale; per-token: 1/s_row applied per row (and group)
        self.input_scale = None if per_token else scale_of(input_amax.reshape(()))
        denom = w_scale if per_token else self.input_scale * w_scale
        self.output_scale = torch.where(denom == 0, torch.zeros_like(denom), 1.0 / denom).t().contiguous()  # [G, N]

    @property
    def nbytes(self) -> int:
        vectors = [self.output_scale] + ([self.pre_quant_scale] if self.pre_quant_scale is not None else [])
        return self.weight.nbytes + sum(v.nbytes for v in vectors)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale
        if self._blocks is None:  # `.t()` of a contiguous [N, G]: _int_mm's fastest layout here
            self._blocks = [self.weight.t()] if len(self.bounds) == 1 else [
                self.weight[:, a:b].contiguous().t() for a, b in self.bounds]
        out = None
        for (a, b), block, out_scale in zip(self.bounds, self._blocks, self.output_scale, strict=True):
            xs = x[:, a:b]
            scale = scale_of(xs.abs().amax(-1, keepdim=True)) if self.per_token else self.input_scale
            v = torch._int_mm(quantize(xs, scale), block).float() * out_scale
            if self.per_token:
                v = v * torch.where(scale == 0, torch.zeros_like(scale), 1.0 / scale)
            out = v if out is None else out + v
        return out


def load_quantized(checkpoint: Path, config) -> tuple[dict[str, torch.Tensor], list[dict], torch.dtype]:
    """(HF-named fp32 tensors for `Transformer`, per layer the INT8 replacement of each fused projection, the
    dtype the native forward packs unquantized weights in); `config` is the checkpoint's ModelConfig.

    Run-time fields absent from config.json (checkpoints made before recipes had them) mean ModelOpt's own
    semantics: static activation scales, per-channel weight scales (ModelOpt's), fp32 for everything unquantized.
    With a `group`, the weight scales per (channel, group) are computed here from the smoothed weights. Biases and
    q/k norms stay fp32."""
    spec = quant_spec(checkpoint)
    activations, kept = spec.get("activations", "static"), spec.get("kept_dtype", "fp32")
    group = spec.get("group")
    if spec.get("qformat") is None or activations not in ("static", "per_token") or kept not in KEPT_DTYPES:
        raise ValueError(f"{checkpoint}: config.json's spectrt_quant {spec} is not a recipe this engine runs "
                         "(activations static|per_token, kept_dtype fp32|bf16): re-run spectrt quantize")
    state = load_file(Path(checkpoint) / QUANT_WEIGHTS)

    def kept_weight(w: torch.Tensor) -> torch.Tensor:  # bf16 values in fp32: what a bf16 pack computes, exactly
        return w.to(KEPT_DTYPES[kept]).float()

    weights = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm"]}
    if "head.weight" in state or kept != "fp32":  # a tied head rounded to bf16 leaves the embeddings exact
        weights["lm_head.weight"] = kept_weight(state.get("head.weight", state["embed.weight"]))
    layers = []
    q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        weights[hf + "input_layernorm.weight"] = state[p + "attn_norm"]
        weights[hf + "post_attention_layernorm.weight"] = state[p + "mlp_norm"]
        if config.attention_bias:  # the fused module's bias, back under the names runtime/engines/model.py reads
            for n, b in zip("qkv", state[p + "wqkv.bias"].split([q_dim, kv_dim, kv_dim]), strict=True):
                weights[hf + f"self_attn.{n}_proj.bias"] = b
        if config.output_bias:
            weights[hf + "self_attn.o_proj.bias"] = state[p + "wo.bias"]
        if config.qk_norm:
            weights[hf + "self_attn.q_norm.weight"] = state[p + "q_norm"]
            weights[hf + "self_attn.k_norm.weight"] = state[p + "k_norm"]
        layer = {}
        for name in PROJECTIONS:
            w, amax = state[p + name + ".weight"], state.get(p + name + ".weight_quantizer._amax")
            input_amax = state.get(p + name + ".input_quantizer._amax")
            if amax is None:  # a projection the recipe keeps in high precision
                layer[name] = kept_weight(w)
            elif input_amax is not None:  # W8A8
                layer[name] = Int8Linear(w, amax, input_amax, state.get(p + name + ".input_quantizer._pre_quant_scale"),
                                         per_token=activations == "per_token", group=group)
            else:  # weight-only: dequantized fp32 weights
                if kept != "fp32":
                    raise ValueError(f"{checkpoint}: weight-only projections dequantize to fp32 values; "
                                     "kept_dtype must be fp32")
                layer[name] = dequantize_weight(w, amax)
        layers.append(layer)
    return weights, layers, KEPT_DTYPES[kept]
