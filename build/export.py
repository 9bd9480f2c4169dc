"""Export a LLaMA-family checkpoint as a **tree-verify graph** (ONNX), the graph every non-torch backend runs.

Graph contract (the same for draft and target, for ONNX Runtime and for TensorRT):

| input            | dtype          | shape            | meaning                                              |
|------------------|----------------|------------------|------------------------------------------------------|
| `input_ids`      | int32          | [T]              | the new tokens (a prompt chunk, a tree level, a tree) |
| `position_ids`   | int32          | [T]              | their positions (siblings share one)                 |
| `attention_mask` | bool           | [T, S]           | which of the S context columns each new token sees   |
| `cache_k`        | float32/16     | [L, Hkv, C, D]   | the static K cache (the runtime's `KVCache.k`)       |
| `cache_v`        | float32/16     | [L, Hkv, C, D]   | the static V cache                                   |

| output   | dtype      | shape           |                                                    |
|----------|------------|-----------------|----------------------------------------------------|
| `logits` | float32    | [T, V]          |                                                    |
| `new_k`  | float32/16 | [L, Hkv, T, D]  | the new tokens' K (RoPE applied); the runtime writes them into its cache |
| `new_v`  | float32/16 | [L, Hkv, T, D]  |                                                    |

The attention context of a layer is `cache[:, :S-T]` followed by the new tokens' own K/V, so column j < S-T of
the mask is cache slot j and the last T columns are the new tokens. Both ways of driving it are exact:

- **dynamic span** (ONNX Runtime): S = committed length + window, the columns are exactly the used slots;
- **static span** (TensorRT + CUDA graphs): S = C, every shape except T is fixed, so one CUDA graph per T
  can be captured; stale slots are simply masked out.

Why the whole static cache is an input rather than a growing past K/V (chosen by measurement): with the
cache as an input the runtime binds `KVCache.k/.v` once by address (no copy, no allocation per step, shapes
static except T and S); a past-K/V graph needs `cache[:, :, :P]` made contiguous every step (the cache is
[L, Hkv, capacity, D], so that slice is strided) and its shape changes every step, which defeats CUDA
graphs. Measured with ONNX Runtime on the embedded target (1 thread, busy 2-core machine, medians):
past 200: 87 vs 76 ms (T=1, within noise); past 1000: 66 vs 76 ms (T=1), 123 vs 129 ms (T=8);
past 2000: 114 vs 167 ms (T=1), 178 vs 263 ms (T=8) for static cache vs copied past K/V. The graph returns
only the T new K/V rows; copying them into their cache slots is a few KB.

FP16 graphs (for TensorRT, whose RTX edition builds strongly typed networks only: precision comes from the
graph, not from a builder flag) keep the residual stream, RMSNorm, softmax and logits in fp32 and run the
GEMMs, K/V and attention matmuls in fp16.
"""

from __future__ import annotations

import json
import math
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from spectrt.runtime.model import ModelConfig, rope_frequencies, subset_head
from torch import nn

INPUT_NAMES = ("input_ids", "position_ids", "attention_mask", "cache_k", "cache_v")
OUTPUT_NAMES = ("logits", "new_k", "new_v")
GRAPH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
OPSET = 17  # what the legacy exporter, ModelOpt's Q/DQ export and TensorRT's ONNX parser all accept
EXPORT_VERSION = 1  # bump when the graph changes: engines built by an older exporter are rebuilt


def io_spec(config: ModelConfig, precision: str) -> dict:
    """Names, dtypes and (symbolic) shapes of the graph's inputs and outputs, as recorded in manifest.json."""
    kv = "float16" if precision == "fp16" else "float32"
    cache = [config.num_layers, config.num_kv_heads, "C", config.head_dim]
    new = [config.num_layers, config.num_kv_heads, "T", config.head_dim]
    return {
        "inputs": {
            "input_ids": {"dtype": "int32", "shape": ["T"]},
            "position_ids": {"dtype": "int32", "shape": ["T"]},
            "attention_mask": {"dtype": "bool", "shape": ["T", "S"]},
            "cache_k": {"dtype": kv, "shape": cache},
            "cache_v": {"dtype": kv, "shape": cache},
        },
        "outputs": {
            "logits": {"dtype": "float32", "shape": ["T", config.vocab_size]},
            "new_k": {"dtype": kv, "shape": new},
            "new_v": {"dtype": kv, "shape": new},
        },
    }


ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64", 9: "bool", 3: "int8"}


def graph_io(graph: Path) -> dict:
    """Inputs/outputs of an ONNX file in `io_spec`'s form (symbolic dims by name), without loading weights."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)

    def one(v):
        t = v.type.tensor_type
        return {"dtype": ONNX_DTYPES.get(t.elem_type, str(t.elem_type)),
                "shape": [d.dim_param or d.dim_value for d in t.shape.dim]}

    return {"inputs": {v.name: one(v) for v in proto.graph.input},
            "outputs": {v.name: one(v) for v in proto.graph.output}}


def graph_files(graph: Path) -> list[Path]:
    """The ONNX file and the external data files it references."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    return [Path(graph)] + [Path(graph).parent / loc for loc in sorted(locations)]


def adopt_graph(src: Path, out: Path) -> Path:
    """Take a graph made elsewhere (e.g. a Q/DQ INT8 export) into an engines dir as `out` + `out.data`,
    refusing it unless it has the tree-verify contract's inputs and outputs."""
    import onnx

    io = graph_io(src)
    if list(io["inputs"]) != list(INPUT_NAMES) or list(io["outputs"]) != list(OUTPUT_NAMES):
        raise ValueError(f"{src} is not a tree-verify graph: inputs {list(io['inputs'])}, outputs "
                         f"{list(io['outputs'])}; expected {list(INPUT_NAMES)} -> {list(OUTPUT_NAMES)} "
                         "(see build/export.py)")
    proto = onnx.load(str(src))  # with its external data, wherever it lives
    for stale in (out, out.with_name(out.name + ".data")):
        stale.unlink(missing_ok=True)
    onnx.save_model(proto, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=0)
    return out


class TreeVerifyModel(nn.Module):
    """The LLaMA forward of `runtime/model.py` as a pure function of (tokens, positions, mask, cache).

    Projections are `nn.Linear` modules (q/k/v fused, gate/up fused, as in the torch engine) so a
    quantizer that swaps linear layers (ModelOpt) can produce a Q/DQ graph with the same contract.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor] | None,
                 dtype: torch.dtype = torch.float32):
        """`weights` are a HF checkpoint's tensors; None leaves them uninitialised for `load_state_dict`
        (how a quantized checkpoint is restored, see quant/quantize.py)."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        c = config
        w = weights or {}

        def linear(*names: str, out_features: int, in_features: int, bias: bool = False) -> nn.Linear:
            """`names` are HF weight names; with `bias` their `.bias` tensors are fused the same way."""
            lin = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
            if weights is not None:
                lin.weight.data.copy_(torch.cat([w[n] for n in names]))
                if bias:
                    lin.bias.data.copy_(torch.cat([w[n.removesuffix("weight") + "bias"] for n in names]))
            return lin

        def vector(name: str, size: int) -> torch.Tensor:  # norms stay fp32: they scale the fp32 residual stream
            return w[name].float().clone() if weights is not None else torch.ones(size)

        q_out, kv_out = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        h, f = c.hidden_size, c.intermediate_size
        self.embed = nn.Embedding(c.vocab_size, h, dtype=dtype)
        if weights is not None:
            self.embed.weight.data.copy_(w["model.embed_tokens.weight"])
        self.layers = nn.ModuleList()
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            layer = nn.Module()
            layer.wqkv = linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"),
                                out_features=q_out + 2 * kv_out, in_features=h, bias=c.attention_bias)
            layer.wo = linear(p + "self_attn.o_proj.weight", out_features=h, in_features=q_out, bias=c.output_bias)
            layer.w13 = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", out_features=2 * f, in_features=h)
            layer.w2 = linear(p + "mlp.down_proj.weight", out_features=h, in_features=f)
            layer.register_buffer("attn_norm", vector(p + "input_layernorm.weight", h))
            layer.register_buffer("mlp_norm", vector(p + "post_attention_layernorm.weight", h))
            if c.qk_norm:  # per-head RMSNorm of q and k (Qwen3)
                layer.register_buffer("q_norm", vector(p + "self_attn.q_norm.weight", c.head_dim))
                layer.register_buffer("k_norm", vector(p + "self_attn.k_norm.weight", c.head_dim))
            self.layers.append(layer)
        self.register_buffer("norm", vector("model.norm.weight", h))
        subset = subset_head(w, c.vocab_size) if weights is not None else None
        self.head = nn.Linear(h, c.vocab_size if subset is None else len(subset[1]), bias=False, dtype=dtype)
        # a subset draft head scores K ids; the graph scatters them into a row of -inf, so the contract
        # (logits [T, V]) and every engine stay unchanged (see runtime/model.py `_logits`)
        self.register_buffer("head_ids", subset[1] if subset else None)
        self.register_buffer("neg_row", torch.full((1, c.vocab_size), -torch.inf) if subset else None)
        if subset is not None:
            self.head.weight.data.copy_(subset[0])
        elif c.tie_word_embeddings:
            self.head.weight = self.embed.weight  # one initializer in the graph, not two
        elif weights is not None:
            self.head.weight.data.copy_(w["lm_head.weight"])
        inv_freq, self.rope_scale = rope_frequencies(c)
        self.register_buffer("inv_freq", inv_freq)

    @classmethod
    def load(cls, checkpoint: Path, dtype: torch.dtype = torch.float32) -> TreeVerifyModel:
        from spectrt.build.slice import load_state_dict

        return cls(ModelConfig.from_dir(checkpoint), load_state_dict(Path(checkpoint)), dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # x is fp32; same arithmetic as runtime/model.py in fp32
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, input_ids, position_ids, attention_mask, cache_k, cache_v):
        c, dt = self.config, self.dtype
        t = input_ids.shape[0]
        past = attention_mask.shape[1] - t  # context columns taken from the cache
        group = c.num_heads // c.num_kv_heads
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        scale = 1.0 / math.sqrt(c.head_dim)

        freqs = position_ids.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = (emb.cos() * self.rope_scale).to(dt), (emb.sin() * self.rope_scale).to(dt)
        # [T, S] -> [1, 1, T, S], broadcast over kv heads and the query heads sharing each
        visible = attention_mask[None, None]
        hidden = ~visible
        neg = torch.finfo(torch.float32).min

        x = self.embed(input_ids).float()  # residual stream in fp32
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.attn_norm).to(dt)
            qkv = layer.wqkv(h)
            q = qkv[:, :q_dim].reshape(-1, c.num_heads, c.head_dim).transpose(0, 1)
            k = qkv[:, q_dim:q_dim + kv_dim].reshape(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = qkv[:, q_dim + kv_dim:].reshape(-1, c.num_kv_heads, c.head_dim).transpose(0, 1)
            if c.qk_norm:
                q = self._rms_norm(q.float(), layer.q_norm).to(dt)
                k = self._rms_norm(k.float(), layer.k_norm).to(dt)
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
            new_k.append(k)
            new_v.append(v)
            keys = torch.cat([cache_k[i, :, :past], k], dim=1)  # [Hkv, S, D]
            values = torch.cat([cache_v[i, :, :past], v], dim=1)
            # grouped-query attention without repeating K/V: [Hkv, G, T, D] x [Hkv, 1, D, S]
            qg = q.reshape(c.num_kv_heads, group, -1, c.head_dim)
            scores = torch.matmul(qg, keys.transpose(1, 2)[:, None]).float() * scale
            probs = torch.softmax(scores.masked_fill(hidden, neg), dim=-1).to(dt)
            o = torch.matmul(probs, values[:, None])  # [Hkv, G, T, D]
            o = o.reshape(c.num_heads, -1, c.head_dim).transpose(0, 1).reshape(-1, q_dim)
            x = x + layer.wo(o).float()
            h = self._rms_norm(x, layer.mlp_norm).to(dt)
            gate, up = layer.w13(h).chunk(2, dim=-1)
            x = x + layer.w2(F.silu(gate) * up).float()
        logits = self.head(self._rms_norm(x, self.norm).to(dt)).float()
        if self.head_ids is not None:
            logits = self.neg_row.expand(t, -1).scatter(1, self.head_ids.expand(t, -1), logits)
        return logits, torch.stack(new_k), torch.stack(new_v)


def example_inputs(config: ModelConfig, dtype: torch.dtype, t: int = 3, past: int = 5, capacity: int = 16):
    """Small inputs for tracing: a causal chunk of t tokens after `past` cached ones."""
    mask = torch.ones(t, past + t, dtype=torch.bool)
    mask[:, past:] = torch.ones(t, t, dtype=torch.bool).tril()
    shape = (config.num_layers, config.num_kv_heads, capacity, config.head_dim)
    return (
        torch.arange(t, dtype=torch.int32) + 7,
        torch.arange(past, past + t, dtype=torch.int32),
        mask,
        torch.randn(shape).to(dtype),
        torch.randn(shape).to(dtype),
    )


DYNAMIC_AXES = {
    "input_ids": {0: "T"},
    "position_ids": {0: "T"},
    "attention_mask": {0: "T", 1: "S"},
    "cache_k": {2: "C"},
    "cache_v": {2: "C"},
    "logits": {0: "T"},
    "new_k": {2: "T"},
    "new_v": {2: "T"},
}


def export_module(model: nn.Module, config: ModelConfig, out: Path, dtype: torch.dtype = torch.float32,
                  transform: Callable | None = None) -> Path:
    """Trace `model` (a TreeVerifyModel, or a quantized copy of one) into `out` (+ `out.data` for weights);
    `transform(proto)` may rewrite the graph before it is saved (quant/quantize.py folds weight quantizers).

    The legacy TorchScript exporter is used on purpose: ModelOpt's quantized modules export Q/DQ only
    through it, so fp32, fp16 and INT8 graphs come from one code path.
    """
    import onnx

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out.parent / (out.name + ".tmp")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        raw = tmp_dir / "raw.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter is chosen on purpose
            torch.onnx.export(
                model, example_inputs(config, dtype), str(raw), input_names=list(INPUT_NAMES),
                output_names=list(OUTPUT_NAMES), dynamic_axes=DYNAMIC_AXES, opset_version=OPSET,
                do_constant_folding=True, dynamo=False,
            )
        proto = onnx.load(str(raw))
        _tie_head(proto, config)
        _name_output_dims(proto, config)
        if transform is not None:
            transform(proto)
        proto.producer_name = "spectrt"
        proto.doc_string = "spectrt tree-verify graph: " + json.dumps({"export_version": EXPORT_VERSION})
        data = out.name + ".data"
        for stale in (out, out.parent / data):
            stale.unlink(missing_ok=True)
        onnx.save_model(proto, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out


def _tie_head(proto, config: ModelConfig) -> None:
    """Make a tied LM head read the embedding table (Gemm transB=1) instead of a folded transposed copy.

    The exporter folds `x @ embed.T` into a second [hidden, vocab] initializer, doubling the biggest
    tensor of the graph (113 MB for SmolLM2); this rewrites it back to one shared initializer.
    """
    import numpy as np
    from onnx import helper, numpy_helper

    if not config.tie_word_embeddings:
        return
    inits = {i.name: i for i in proto.graph.initializer}
    gathers = [n for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in inits]
    embed = next((inits[n.input[0]] for n in gathers if list(inits[n.input[0]].dims) ==
                  [config.vocab_size, config.hidden_size]), None)
    if embed is None:
        return
    for idx, node in enumerate(proto.graph.node):
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        b = inits[node.input[1]]
        if list(b.dims) != [config.hidden_size, config.vocab_size]:
            continue
        if not np.array_equal(numpy_helper.to_array(b), numpy_helper.to_array(embed).T):
            continue
        gemm = helper.make_node("Gemm", [node.input[0], embed.name], list(node.output), name=node.name + "_tied",
                                transB=1)
        proto.graph.node.remove(node)
        proto.graph.node.insert(idx, gemm)
        proto.graph.initializer.remove(b)
        return


def _name_output_dims(proto, config: ModelConfig) -> None:
    """Give the outputs the contract's shapes (the exporter leaves generated names for static dims)."""
    from onnx import TensorShapeProto

    want = {"logits": ["T", config.vocab_size],
            "new_k": [config.num_layers, config.num_kv_heads, "T", config.head_dim],
            "new_v": [config.num_layers, config.num_kv_heads, "T", config.head_dim]}
    for out in proto.graph.output:
        dims = out.type.tensor_type.shape.dim
        del dims[:]
        for d in want[out.name]:
            dim = TensorShapeProto.Dimension()
            if isinstance(d, str):
                dim.dim_param = d
            else:
                dim.dim_value = d
            dims.append(dim)


def export_graph(checkpoint: Path, out: Path, precision: str = "fp32", log=print) -> Path:
    """Export `checkpoint` as a tree-verify graph in fp32 (ONNX Runtime, parity) or fp16 (TensorRT)."""
    if precision not in GRAPH_DTYPES:
        raise ValueError(f"graph precision {precision!r} is not exportable here: choose one of {sorted(GRAPH_DTYPES)}")
    start = time.perf_counter()
    dtype = GRAPH_DTYPES[precision]
    model = TreeVerifyModel.load(Path(checkpoint), dtype).eval()
    export_module(model, model.config, out, dtype)
    log(f"  exported {out.name} ({precision}) in {time.perf_counter() - start:.1f}s")
    return out
