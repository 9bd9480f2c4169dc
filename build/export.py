"""Export a LLaMA-family checkpoint as the **batched tree-verify graph** (ONNX) every non-torch backend runs.

One graph run verifies (or drafts, or prefills) B requests at once, each with its own token tree, in TensorRT-LLM's
speculative-decoding interface; runtime/engines/batch_inputs.py defines the inputs and builds them from segments:

| input                              | dtype      | shape                  |                                           |
|------------------------------------|------------|------------------------|-------------------------------------------|
| `input_ids`                        | int32      | [N]                    | the new tokens of all requests, packed    |
| `spec_decoding_generation_lengths` | int32      | [B]                    | T_b: request b's rows are the next T_b    |
| `spec_decoding_position_offsets`   | int32      | [B, T]                 | RoPE position = past length + offset      |
| `spec_decoding_packed_mask`        | int32      | [B, T, M]              | bit j of row i: node i sees window slot j |
| `past_key_value_lengths`           | int32      | [B]                    | committed prefix (always visible)         |
| `window_offsets`                   | int32      | [B]                    | window slots already cached (draft levels)|
| `slot_ids`                         | int32      | [B]                    | request b's slot of the pool              |
| `cache_columns`                    | int32      | [S]                    | 0..S-1: the span attention covers         |
| `pool_k`, `pool_v`                 | float32/16 | [P, L, Hkv, C, D]      | the runtime's KV pool (P slots), read only|

| output   | dtype      | shape          |                                                            |
|----------|------------|----------------|------------------------------------------------------------|
| `logits` | float32    | [N, V]         | packed like input_ids: no padding row is ever returned     |
| `new_k`  | float32/16 | [L, Hkv, N, D] | the new tokens' K (RoPE applied); the runtime writes them into the pool |
| `new_v`  | float32/16 | [L, Hkv, N, D] |                                                            |
| `features` | float32    | [N, 3 Ht]      | exported for an EAGLE-3 head only: its captured layers' inputs |

Inside, every projection, norm and the LM head run on the N packed rows (no padding in the GEMMs, which are the
cost); only attention uses the padded [B, T] layout. Request b's context is its own pool slot's columns [0, S) in
slot order, with the batch's new tokens of request b put at their own slots (past + window offset + i): a column is
visible if committed, or if its window slot's bit is set in the row's mask; stale slots and padding never are.
Padded query rows are computed and dropped: they never reach an output. Requests never see each other: each reads
only its own slot and its own new tokens. Because a row's context is the same columns in the same places whatever
the batch (a bigger batch only adds masked columns after them), and ONNX Runtime's GEMMs are row invariant, a
request's logits are bitwise the same alone or batched, and a verified tree row the same as that token decoded
alone (tested in tests/test_batch_graph.py).

Cached K/V are read with one gather per layer of exactly the B requests' [0, S) rows of the pool (a flat row index
(slot, layer, head, column)), so a step reads B x S rows whatever the pool's size; the runtime binds the pool by
address (ONNX Runtime on a CPU: the `KVCache.pool_k/pool_v` tensors themselves; TensorRT: device memory), so no
cache is copied per step. New K/V are returned rather than written in place: ONNX has no in-place update of an
input (opset 17), and the copy into the pool is small (each new token's K and V: L x Hkv x D values) next to the
forward (measured in runtime/engines/onnx_engine.py). S is an input dimension (`cache_columns`): ONNX Runtime passes the
batch's longest span (attention cost follows the real context), TensorRT the whole capacity (only B, T and N vary,
as its optimization profiles and CUDA graphs want).

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
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from spectrt.runtime.engines.batch_inputs import FEATURES, INPUT_NAMES, OUTPUT_NAMES, pack_mask, unpack_mask
from spectrt.runtime.engines.model import ModelConfig, rms_norm, rope_frequencies, rope_tables, rotate, subset_head
from torch import nn

GRAPH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
OPSET = 17  # what the legacy exporter, ModelOpt's Q/DQ export and TensorRT's parser all accept
EXPORT_VERSION = 2  # bump when the graph changes: engines built by an older exporter are rebuilt


def io_spec(config: ModelConfig, precision: str, feature_layers: Sequence[int] = ()) -> dict:
    """Names, dtypes and (symbolic) shapes of the graph's inputs and outputs, as recorded in manifest.json."""
    kv = "float16" if precision == "fp16" else "float32"
    pool = ["P", config.num_layers, config.num_kv_heads, "C", config.head_dim]
    new = [config.num_layers, config.num_kv_heads, "N", config.head_dim]
    shapes = {"input_ids": ["N"], "spec_decoding_generation_lengths": ["B"],
              "spec_decoding_position_offsets": ["B", "T"], "spec_decoding_packed_mask": ["B", "T", "M"],
              "past_key_value_lengths": ["B"], "window_offsets": ["B"], "slot_ids": ["B"], "cache_columns": ["S"]}
    outputs = {"logits": {"dtype": "float32", "shape": ["N", config.vocab_size]},
               "new_k": {"dtype": kv, "shape": new}, "new_v": {"dtype": kv, "shape": new}}
    if feature_layers:
        outputs[FEATURES] = {"dtype": "float32", "shape": ["N", len(feature_layers) * config.hidden_size]}
    return {
        "inputs": {**{name: {"dtype": "int32", "shape": shape} for name, shape in shapes.items()},
                   "pool_k": {"dtype": kv, "shape": pool}, "pool_v": {"dtype": kv, "shape": pool}},
        "outputs": outputs,
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
    if list(io["inputs"]) != list(INPUT_NAMES) or list(io["outputs"]) not in (list(OUTPUT_NAMES),
                                                                              [*OUTPUT_NAMES, FEATURES]):
        raise ValueError(f"{src} is not a tree-verify graph: inputs {list(io['inputs'])}, outputs "
                         f"{list(io['outputs'])}; expected {list(INPUT_NAMES)} -> {list(OUTPUT_NAMES)} "
                         f"(+ {FEATURES} for an EAGLE-3 head; see build/export.py)")
    proto = onnx.load(str(src))  # with its external data, wherever it lives
    for stale in (out, out.with_name(out.name + ".data")):
        stale.unlink(missing_ok=True)
    onnx.save_model(proto, str(out), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=out.name + ".data", size_threshold=0)
    return out


class TreeVerifyModel(nn.Module):
    """The LLaMA forward of `runtime/engines/model.py` as a pure function of (tokens, positions, mask, cache).

    Projections are `nn.Linear` modules (q/k/v fused, gate/up fused, as in the torch engine) so a
    quantizer that swaps linear layers (ModelOpt) can produce a Q/DQ graph with the same contract.
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor] | None,
                 dtype: torch.dtype = torch.float32, feature_layers: Sequence[int] = ()):
        """`weights` are a HF checkpoint's tensors; None leaves them uninitialised for `load_state_dict`
        (how a quantized checkpoint is restored, see quant/quantize.py). `feature_layers`: the residual streams an
        EAGLE-3 head reads (id j enters layer j; L is the last layer's output), returned as the `features` output."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.feature_layers = tuple(int(j) for j in feature_layers)
        if not all(0 <= j <= config.num_layers for j in self.feature_layers):
            raise ValueError(f"feature layers {list(self.feature_layers)} must lie in [0, {config.num_layers}]")
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
        # (logits [T, V]) and every engine stay unchanged (see runtime/engines/model.py `_logits`)
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
    def load(cls, checkpoint: Path, dtype: torch.dtype = torch.float32, feature_layers: Sequence[int] = ()
             ) -> TreeVerifyModel:
        from spectrt.build.slice import load_state_dict

        return cls(ModelConfig.from_dir(checkpoint), load_state_dict(Path(checkpoint)), dtype, feature_layers)

    def forward(self, input_ids, generation_lengths, position_offsets, packed_mask, past_lengths, window_offsets,
                slot_ids, cache_columns, pool_k, pool_v):
        c, dt = self.config, self.dtype
        at = BatchAttention(c, dt, self.inv_freq, self.rope_scale, input_ids.shape[0], generation_lengths,
                            position_offsets, packed_mask, past_lengths, window_offsets, slot_ids, cache_columns,
                            pool_k, pool_v)
        q_dim, kv_dim, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
        eps = c.rms_norm_eps  # the residual stream is fp32: the same arithmetic as the torch engine in fp32
        n = at.n

        x = self.embed(input_ids).float()  # residual stream in fp32, [N, H]
        captured = {}
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                captured[i] = x
            h = rms_norm(x, layer.attn_norm, eps).to(dt)
            qkv = layer.wqkv(h)
            q = qkv[:, :q_dim].reshape(n, c.num_heads, d).transpose(0, 1)
            k = qkv[:, q_dim:q_dim + kv_dim].reshape(n, c.num_kv_heads, d).transpose(0, 1)
            v = qkv[:, q_dim + kv_dim:].reshape(n, c.num_kv_heads, d).transpose(0, 1)
            if c.qk_norm:
                q = rms_norm(q.float(), layer.q_norm, eps).to(dt)
                k = rms_norm(k.float(), layer.k_norm, eps).to(dt)
            x = x + layer.wo(at.attend(i, q, k, v)).float()
            h = rms_norm(x, layer.mlp_norm, eps).to(dt)
            gate, up = layer.w13(h).chunk(2, dim=-1)
            x = x + layer.w2(F.silu(gate) * up).float()
        captured[c.num_layers] = x
        logits = self.head(rms_norm(x, self.norm, eps).to(dt)).float()
        if self.head_ids is not None:
            logits = self.neg_row.expand(n, -1).scatter(1, self.head_ids.expand(n, -1), logits)
        new_k, new_v = at.new_kv()
        if not self.feature_layers:
            return logits, new_k, new_v
        return logits, new_k, new_v, torch.cat([captured[j] for j in self.feature_layers], dim=-1)


class BatchAttention:
    """The batched graph's attention over the KV pool, shared by the target graph and the EAGLE-3 head graph: the
    packed/padded row maps, the visibility mask and the cache rows are computed once per forward, `attend` runs one
    layer's attention of the packed rows (RoPE applied here) and keeps their K/V for `new_kv`."""

    def __init__(self, c: ModelConfig, dt: torch.dtype, inv_freq: torch.Tensor, rope_scale: float, n: int,
                 generation_lengths, position_offsets, packed_mask, past_lengths, window_offsets, slot_ids,
                 cache_columns, pool_k, pool_v):
        self.c, self.dt, self.n = c, dt, n
        b, t = position_offsets.shape
        s = cache_columns.shape[0]
        hkv, d = c.num_kv_heads, c.head_dim
        self.b, self.t, self.s = b, t, s

        # packed row r belongs to request req[r] at index col[r]; padded (b, i) reads packed row pad[b, i]
        lengths = generation_lengths.long()
        ends = torch.cumsum(lengths, 0)
        starts = ends - lengths
        rows = torch.arange(n)
        req = (rows[:, None] >= ends[None, :]).long().sum(1)
        col = rows - starts[req]
        self.flat = req * t + col  # packed row -> padded position b * T + i
        steps = torch.arange(t)
        self.pad = (starts[:, None] + torch.minimum(steps[None, :], lengths[:, None] - 1)).reshape(-1)  # [B*T]

        # request b's context is its pool slot's columns [0, S) in slot order, the new tokens placed at their own
        # slots (past + window offset + i) before attention: column s of row i is visible iff s is committed
        # (s < past) or window slot s - past has row i's bit set (earlier draft levels, the new tokens), so stale
        # slots and padding columns never are. A row's context is the same columns whatever the batch (only more
        # masked columns after it), so with row-invariant GEMMs (MLAS) its result does not depend on the batch.
        bits = unpack_mask(packed_mask)  # [B, T, 32 M]
        past, window = past_lengths.long(), window_offsets.long()
        rel = cache_columns.long()[None, :] - past[:, None]  # [B, S]: window slot of each column
        width = (window + lengths)[:, None]
        window_bit = torch.gather(bits, 2, rel.clamp(0, bits.shape[2] - 1)[:, None, :].expand(b, t, s)) > 0
        visible = (rel < 0)[:, None, :] | (((rel >= 0) & (rel < width))[:, None, :] & window_bit)
        self.hidden = ~visible[:, None, None]  # [B, 1, 1, T, S]
        positions = past[req] + position_offsets.long().reshape(-1)[self.flat]

        # cached K/V of the B requests' slots, columns [0, S): one gather of rows (slot, layer, head, column); the
        # new tokens' rows are then put at their columns of that copy (their slots in the pool are written by the
        # runtime after the forward)
        self.capacity = capacity = pool_k.shape[3]
        heads = torch.arange(hkv)
        self.kv_rows = ((slot_ids.long()[:, None, None] * c.num_layers * hkv + heads[None, :, None]) * capacity
                        + cache_columns.long()[None, None, :]).reshape(-1)  # layer 0; layer l adds l * Hkv * C
        self.new_rows = ((req[None, :] * hkv + heads[:, None]) * s + (past + window)[req][None, :]
                         + col[None, :]).reshape(-1)  # [Hkv * N]: head-major, as k.reshape(-1, D)
        self.flat_k, self.flat_v = pool_k.reshape(-1, d), pool_v.reshape(-1, d)
        self.cos, self.sin = rope_tables(positions, inv_freq, rope_scale, dt)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [heads, N, D], k/v [kv_heads, N, D] of the packed rows (before RoPE) -> attention output [N, q_dim]."""
        c, b, t, s, d = self.c, self.b, self.t, self.s, self.c.head_dim
        hkv = c.num_kv_heads
        group = c.num_heads // hkv
        q, k = rotate(q, self.cos, self.sin), rotate(k, self.cos, self.sin)  # [heads, N, D]
        self.keys.append(k)
        self.values.append(v)
        layer_rows = self.kv_rows + layer * hkv * self.capacity
        keys = self.flat_k[layer_rows].index_put((self.new_rows,), k.reshape(-1, d)).reshape(b, hkv, s, d)
        values = self.flat_v[layer_rows].index_put((self.new_rows,), v.reshape(-1, d)).reshape(b, hkv, s, d)
        # grouped-query attention without repeating K/V: [B, Hkv, G, T, D] x [B, Hkv, 1, D, S]
        qg = q[:, self.pad].reshape(hkv, group, b, t, d).permute(2, 0, 1, 3, 4)
        scores = torch.matmul(qg, keys.transpose(2, 3)[:, :, None]).float() * (1.0 / math.sqrt(d))
        probs = torch.softmax(scores.masked_fill(self.hidden, torch.finfo(torch.float32).min), dim=-1).to(self.dt)
        o = torch.matmul(probs, values[:, :, None])  # [B, Hkv, G, T, D]
        return o.permute(0, 3, 1, 2, 4).reshape(b * t, c.num_heads * d)[self.flat]  # back to the packed rows

    def new_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The new rows' K (RoPE applied) and V of every layer attended: [L, Hkv, N, D] each."""
        return torch.stack(self.keys), torch.stack(self.values)


def pool_for(config: ModelConfig, dtype: torch.dtype, slots: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random K/V pool [slots, layers, kv_heads, capacity, head_dim] (tracing, tests)."""
    shape = (slots, config.num_layers, config.num_kv_heads, capacity, config.head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)


def sequence_inputs(config: ModelConfig, dtype: torch.dtype, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The graph's inputs for one causal sequence with an empty cache (calibration: a batch of one, past 0)."""
    t = ids.shape[0]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    empty = torch.zeros(1, config.num_layers, config.num_kv_heads, t, config.head_dim, dtype=dtype)
    zero = torch.zeros(1, dtype=torch.int32)
    return (ids.to(torch.int32), torch.tensor([t], dtype=torch.int32), torch.arange(t, dtype=torch.int32)[None],
            pack_mask(mask)[None], zero, zero, zero, torch.arange(t, dtype=torch.int32), empty, empty)


def example_inputs(config: ModelConfig, dtype: torch.dtype, t: int = 3, past: int = 5, capacity: int = 16):
    """Small inputs for tracing and tests: two requests in a pool of three slots, the first a causal chunk of t
    tokens after `past` cached ones (slot 2), the second a 3-node tree (slot 0) after past - 2 cached ones."""
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    chunk_mask = torch.ones(t, t, dtype=torch.bool).tril()
    offsets = torch.zeros(2, max(t, 3), dtype=torch.int32)
    offsets[0, :t] = torch.arange(t)
    offsets[1, :3] = torch.tensor([0, 1, 1])
    packed = torch.zeros(2, max(t, 3), 1, dtype=torch.int32)
    packed[0, :t] = pack_mask(chunk_mask)
    packed[1, :3] = pack_mask(tree_mask)
    return (
        torch.arange(t + 3, dtype=torch.int32) + 7,
        torch.tensor([t, 3], dtype=torch.int32),
        offsets,
        packed,
        torch.tensor([past, past - 2], dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
        torch.tensor([2, 0], dtype=torch.int32),
        torch.arange(past + t, dtype=torch.int32),
        *pool_for(config, dtype, 3, capacity),
    )


DYNAMIC_AXES = {
    "input_ids": {0: "N"},
    "spec_decoding_generation_lengths": {0: "B"},
    "spec_decoding_position_offsets": {0: "B", 1: "T"},
    "spec_decoding_packed_mask": {0: "B", 1: "T", 2: "M"},
    "past_key_value_lengths": {0: "B"},
    "window_offsets": {0: "B"},
    "slot_ids": {0: "B"},
    "cache_columns": {0: "S"},
    "pool_k": {0: "P", 3: "C"},
    "pool_v": {0: "P", 3: "C"},
    "logits": {0: "N"},
    "new_k": {2: "N"},
    "new_v": {2: "N"},
    FEATURES: {0: "N"},
    # an EAGLE-3 head's graph (build/export_eagle3.py): its row inputs (F + R = N rows) and its output hidden
    "target_features": {0: "F"},
    "hidden_states": {0: "R"},
    "hidden_out": {0: "N"},
}


def export_module(model: nn.Module, config: ModelConfig, out: Path, dtype: torch.dtype = torch.float32,
                  transform: Callable | None = None) -> Path:
    """Trace `model` (a TreeVerifyModel, or a quantized copy of one) into `out` (+ `out.data` for weights);
    `transform(proto)` may rewrite the graph before it is saved (quant/quantize.py folds weight quantizers)."""
    layers = getattr(model, "feature_layers", ())

    def edit(proto) -> None:
        _tie_head(proto, config)
        if transform is not None:
            transform(proto)

    outputs = (*OUTPUT_NAMES, FEATURES) if layers else OUTPUT_NAMES
    return trace_graph(model, example_inputs(config, dtype), out, INPUT_NAMES, outputs,
                       io_spec(config, "fp32", layers)["outputs"],
                       "spectrt tree-verify graph: " + json.dumps({"export_version": EXPORT_VERSION}), edit)


def trace_graph(model: nn.Module, inputs: tuple, out: Path, input_names: Sequence[str], output_names: Sequence[str],
                outputs: dict, doc: str, edit: Callable | None = None) -> Path:
    """Trace `model` on `inputs` into `out` (+ `out.data`): DYNAMIC_AXES for the named tensors, the outputs' shapes
    named as `outputs` (`io_spec`'s form) gives them, `edit(proto)` before saving. Every graph of the project comes
    through here (the target's, the Q/DQ target's, an EAGLE-3 head's: build/export_eagle3.py).

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
        names = [*input_names, *output_names]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter is chosen on purpose
            torch.onnx.export(
                model, inputs, str(raw), input_names=list(input_names), output_names=list(output_names),
                dynamic_axes={k: DYNAMIC_AXES[k] for k in names if k in DYNAMIC_AXES}, opset_version=OPSET,
                do_constant_folding=True, dynamo=False,
            )
        proto = onnx.load(str(raw))
        _name_output_dims(proto, outputs)
        if edit is not None:
            edit(proto)
        proto.producer_name = "spectrt"
        proto.doc_string = doc
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


def _name_output_dims(proto, outputs: dict) -> None:
    """Give the outputs the contract's shapes (`io_spec`'s; the exporter leaves generated names for static dims)."""
    from onnx import TensorShapeProto

    want = {name: spec["shape"] for name, spec in outputs.items()}
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


def export_graph(checkpoint: Path, out: Path, precision: str = "fp32", feature_layers: Sequence[int] = (),
                 log=print) -> Path:
    """Export `checkpoint` as a tree-verify graph in fp32 (ONNX Runtime, parity) or fp16 (TensorRT); with
    `feature_layers` (an EAGLE-3 head's) it also returns those layers' residual streams (`features`)."""
    if precision not in GRAPH_DTYPES:
        raise ValueError(f"graph precision {precision!r} is not exportable here: choose one of {sorted(GRAPH_DTYPES)}")
    start = time.perf_counter()
    dtype = GRAPH_DTYPES[precision]
    model = TreeVerifyModel.load(Path(checkpoint), dtype, feature_layers).eval()
    export_module(model, model.config, out, dtype)
    log(f"  exported {out.name} ({precision}) in {time.perf_counter() - start:.1f}s")
    return out
