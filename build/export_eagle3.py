"""Export an EAGLE-3 head (runtime/engines/eagle3.py) as its own **batched graph**, the draft beside a target graph
exported with `features` (build/export.py), as TensorRT-LLM runs EAGLE-3: the target returns the captured layers'
hidden states next to its logits, the head is an engine of its own over them.

Its inputs are the target graph's (runtime/engines/batch_inputs.py: packed tokens, per-request lengths, position
offsets, packed tree masks, past lengths, window offsets, slots, span, the head's own one-layer KV pool), so one
`batch_inputs` builder serves both graphs, plus each row's input hidden, split by where it comes from:

| input             | dtype   | shape        |                                                                      |
|-------------------|---------|--------------|----------------------------------------------------------------------|
| `target_features` | float32 | [F, 3 Ht]    | the first F packed rows: committed tokens' target features     |
| `hidden_states`   | float32 | [N - F, H]   | the other rows: drafted nodes' parent rows' output hidden            |

| output       | dtype      | shape          |                                                                |
|--------------|------------|----------------|----------------------------------------------------------------|
| `logits`     | float32    | [N, Kd]        | draft vocabulary: column i is target id i + d2t[i] (d2t file) |
| `new_k/new_v`| float32/16 | [1, Hkv, N, D] | as the target graph's: the runtime writes them into the pool   |
| `hidden_out` | float32    | [N, H]         | each row's output hidden: the next draft level's `hidden_states` |

The head's math is `Eagle3Head._forward`'s (fc, cat(norm(embed), norm(g)), one attention + MLP layer, norm, the
draft-vocabulary LM head); the embedding is the target's (SpecForge heads carry none), copied into this graph so the
draft directory stands alone. fp16 graphs keep the residual stream, norms, softmax and logits in fp32, as the target's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from spectrt.build.export import GRAPH_DTYPES, BatchAttention, example_inputs, trace_graph
from spectrt.runtime.engines.batch_inputs import HEAD_INPUT_NAMES, HEAD_OUTPUT_NAMES
from spectrt.runtime.engines.eagle3 import LAYER_WEIGHTS, PREFIX, Eagle3Config, draft_ids, read_weights
from spectrt.runtime.engines.families import rope_frequencies
from spectrt.runtime.engines.model import ModelConfig, rms_norm
from torch import nn

HEAD_EXPORT_VERSION = 1  # bump when the head graph changes: engines built by an older exporter are rebuilt


def head_io_spec(config: Eagle3Config, precision: str) -> dict:
    """The head graph's outputs in build/export.py `io_spec`'s form (its inputs are the target graph's + two)."""
    c = config.model
    kv = "float16" if precision == "fp16" else "float32"
    new = [1, c.num_kv_heads, "N", c.head_dim]
    return {"logits": {"dtype": "float32", "shape": ["N", config.draft_vocab_size]},
            "new_k": {"dtype": kv, "shape": new}, "new_v": {"dtype": kv, "shape": new},
            "hidden_out": {"dtype": "float32", "shape": ["N", c.hidden_size]}}


class Eagle3GraphModel(nn.Module):
    """The head as a pure function of (tokens, positions, masks, its KV pool, row inputs): see the module doc."""

    def __init__(self, config: Eagle3Config, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 dtype: torch.dtype = torch.float32):
        super().__init__()
        c = config.model
        self.config, self.head_config, self.dtype = c, config, dtype
        missing = [n for n in [PREFIX + w for w in LAYER_WEIGHTS] + ["fc.weight", "norm.weight", "lm_head.weight"]
                   if n not in weights]
        if missing:
            raise ValueError(f"not an EAGLE-3 head in SpecForge's layout: missing {missing}")
        draft_ids(weights, config)  # refuses a d2t/t2d that does not fit before anything is traced

        def linear(*names: str) -> nn.Linear:
            w = torch.cat([weights[n] for n in names])
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=dtype)
            lin.weight.data.copy_(w)
            return lin

        p = PREFIX
        self.fc = linear("fc.weight")
        self.wqkv = linear(*(p + f"self_attn.{n}_proj.weight" for n in "qkv"))
        self.wo = linear(p + "self_attn.o_proj.weight")
        self.w13 = linear(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        self.w2 = linear(p + "mlp.down_proj.weight")
        self.head = linear("lm_head.weight")
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.embed.weight.data.copy_(weights.get("embed_tokens.weight", embed))
        for name, key in (("input_norm", "input_layernorm"), ("hidden_norm", "hidden_norm"),
                          ("post_norm", "post_attention_layernorm")):
            self.register_buffer(name, weights[p + key + ".weight"].float().clone())
        self.register_buffer("norm", weights["norm.weight"].float().clone())
        inv_freq, self.rope_scale = rope_frequencies(c)
        self.register_buffer("inv_freq", inv_freq)

    @classmethod
    def load(cls, head: Path, target: Path, dtype: torch.dtype = torch.float32) -> Eagle3GraphModel:
        """The head checkpoint `head` for the target checkpoint `target` (whose embedding it reads)."""
        from safetensors import safe_open

        config = Eagle3Config.from_dir(head, ModelConfig.from_dir(target))
        weights = read_weights(head)
        embed = weights.get("embed_tokens.weight")
        if embed is None:
            for shard in sorted(Path(target).glob("*.safetensors")):
                with safe_open(shard, "pt") as f:
                    if "model.embed_tokens.weight" in f.keys():
                        embed = f.get_tensor("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(f"{target} has no model.embed_tokens.weight for the head {head} to read")
        return cls(config, weights, embed, dtype)

    def forward(self, input_ids, generation_lengths, position_offsets, packed_mask, past_lengths, window_offsets,
                slot_ids, cache_columns, pool_k, pool_v, target_features, hidden_states):
        c, dt = self.config, self.dtype
        at = BatchAttention(c, dt, self.inv_freq, self.rope_scale, input_ids.shape[0], generation_lengths,
                            position_offsets, packed_mask, past_lengths, window_offsets, slot_ids, cache_columns,
                            pool_k, pool_v)
        n, d, eps = at.n, c.head_dim, c.rms_norm_eps
        q_dim, kv_dim = c.num_heads * d, c.num_kv_heads * d
        g = torch.cat([self.fc(target_features.to(dt)).float(), hidden_states.float()])  # [N, H], fp32
        a = torch.cat([rms_norm(self.embed(input_ids).float(), self.input_norm, eps),
                       rms_norm(g, self.hidden_norm, eps)], -1).to(dt)
        qkv = self.wqkv(a)
        q = qkv[:, :q_dim].reshape(n, c.num_heads, d).transpose(0, 1)
        k = qkv[:, q_dim:q_dim + kv_dim].reshape(n, c.num_kv_heads, d).transpose(0, 1)
        v = qkv[:, q_dim + kv_dim:].reshape(n, c.num_kv_heads, d).transpose(0, 1)
        h = g + self.wo(at.attend(0, q, k, v)).float()
        gate, up = self.w13(rms_norm(h, self.post_norm, eps).to(dt)).chunk(2, dim=-1)
        h = h + self.w2(F.silu(gate) * up).float()
        logits = self.head(rms_norm(h, self.norm, eps).to(dt)).float()
        new_k, new_v = at.new_kv()
        return logits, new_k, new_v, h


def head_example_inputs(config: Eagle3Config, dtype: torch.dtype, features: int = 3) -> tuple[torch.Tensor, ...]:
    """build/export.py `example_inputs` (two requests, six rows) for the head, the first `features` rows from
    target features, the rest from hidden states."""
    base = example_inputs(config.model, dtype)
    n = base[0].shape[0]
    return (*base, torch.randn(features, 3 * config.target_hidden_size), torch.randn(n - features,
                                                                                    config.model.hidden_size))


def export_head_graph(head: Path, target: Path, out: Path, precision: str = "fp32", log=print) -> Path:
    """Export the EAGLE-3 head `head` (for the target checkpoint `target`) as its batched graph `out` (+ .data)."""
    if precision not in GRAPH_DTYPES:
        raise ValueError(f"graph precision {precision!r} is not exportable here: choose one of {sorted(GRAPH_DTYPES)}")
    start = time.perf_counter()
    dtype = GRAPH_DTYPES[precision]
    model = Eagle3GraphModel.load(Path(head), Path(target), dtype).eval()
    trace_graph(model, head_example_inputs(model.head_config, dtype), out, HEAD_INPUT_NAMES, HEAD_OUTPUT_NAMES,
                head_io_spec(model.head_config, precision),
                "spectrt EAGLE-3 head graph: " + json.dumps({"export_version": HEAD_EXPORT_VERSION}))
    log(f"  exported {Path(out).name} (EAGLE-3 head, {precision}) in {time.perf_counter() - start:.1f}s")
    return Path(out)


def save_draft_vocab(head: Path, out: Path) -> Path:
    """The head's d2t/t2d buffers (which target id each logits column is) as `out` (safetensors)."""
    from safetensors.torch import save_file

    weights = read_weights(head)
    save_file({k: weights[k].contiguous() for k in ("d2t", "t2d") if k in weights}, str(out))
    return out

