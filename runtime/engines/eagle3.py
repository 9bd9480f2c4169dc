"""An EAGLE-3 feature head at inference: SpecForge's checkpoint layout, its own one-layer KV cache, tree drafting.

The head drafts from the target's own hidden states instead of re-deriving them (EAGLE-3, arXiv 2503.01840). One
row of the head takes a token x at position p and a hidden vector g that describes the context before it, and
returns the logits for the token at p + 1 plus its own output hidden, which the row's children consume as their g:

    g = fc(target features of position p - 1)          (a committed token: low/mid/high target layers, 3 * Ht wide)
      | the head's output hidden of the parent row      (a drafted tree node: deeper levels read the head itself)
    a = cat(input_layernorm(embed(x)), hidden_norm(g))  (2H wide: the layer's only difference from a LLaMA layer)
    h = g + o_proj(attention(q/k/v_proj(a)))            (RoPE, tree mask, this head's own KV cache)
    h = h + mlp(post_attention_layernorm(h))            -> the row's output hidden
    logits = lm_head(norm(h))                           (a draft vocabulary: target id = i + d2t[i])

Checkpoint layout (SpecForge `LlamaForCausalLMEagle3`, what users of SGLang / vLLM / TensorRT-LLM own): config.json
with `architectures: ["LlamaForCausalLMEagle3"]`, `num_hidden_layers: 1`, `draft_vocab_size`, the LLaMA shape keys,
optionally `target_hidden_size` and `eagle_aux_hidden_state_layer_ids` (top level or in `eagle_config`); weights
`fc.weight [H, 3Ht]`, `midlayer.self_attn.{q,k,v}_proj.weight [*, 2H]`, `midlayer.self_attn.o_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`norm.weight`, `lm_head.weight [Kd, H]`, buffers `d2t [Kd]` and `t2d [V]` (bool). `embed_tokens.weight` is optional:
SpecForge drops it from its checkpoints and the target's embedding is used, as SGLang does.

Feature layers follow vLLM's `eagle_aux_hidden_state_layer_ids` convention: id j is the residual stream entering
target layer j (equivalently the output of layer j - 1, SpecForge's `aux_hidden_states_layers` = j - 1), default
(2, L // 2, L - 3) as EAGLE-3 and SpecForge choose them. Positions are the engines' (a row sits at its token's
position); SpecForge places a row at its feature's position, one less: RoPE sees only position differences, so both
give the same attention.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from spectrt.runtime.engines.families import rope_frequencies
from spectrt.runtime.engines.kernels import (
    bound_arguments,
    contiguous,
    fp32_rows,
    head_rows,
    huge_page_arena,
    last_rows,
    linear,
    load_kernels,
    logit_counts,
    native_unavailable,
    pack,
    split_rows,
)
from spectrt.runtime.engines.model import KVCache, ModelConfig, rms_norm, rope_tables, rotate

ARCHITECTURE = "LlamaForCausalLMEagle3"
PREFIX = "midlayer."
LAYER_WEIGHTS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                 "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                 "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low/mid/high choice for a target of `num_layers` layers (vLLM's ids: the input of layer j)."""
    return (2, num_layers // 2, num_layers - 3)


def is_eagle3(checkpoint: Path) -> bool:
    """A checkpoint directory in SpecForge's EAGLE-3 layout (config.json architectures)."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return False
    return ARCHITECTURE in (json.loads(path.read_text(encoding="utf-8")).get("architectures") or [])


@dataclass(frozen=True)
class Eagle3Config:
    """The head's shape: `model` is its one LLaMA layer (num_layers 1, vocab_size = the target's vocabulary)."""

    model: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...]

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary (what the decoder checks a draft against)."""
        return self.model.vocab_size

    @classmethod
    def from_dir(cls, checkpoint: Path, target: ModelConfig) -> Eagle3Config:
        """Read config.json and check it against `target` (the model whose features the head reads)."""
        checkpoint = Path(checkpoint)
        raw = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
        if ARCHITECTURE not in (raw.get("architectures") or []):
            raise ValueError(f"{checkpoint} is not an EAGLE-3 head: config.json architectures must list {ARCHITECTURE}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ValueError(f"{checkpoint}: an EAGLE-3 head has num_hidden_layers 1, got {raw['num_hidden_layers']}")
        model = ModelConfig.from_dir(checkpoint)
        eagle = raw.get("eagle_config") or {}
        layers = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        layers = tuple(int(j) for j in layers) if layers else default_feature_layers(target.num_layers)
        config = cls(model, int(raw.get("draft_vocab_size") or raw["vocab_size"]),
                     int(raw.get("target_hidden_size") or raw["hidden_size"]), layers)
        config.check(target, str(checkpoint))
        return config

    def check(self, target: ModelConfig, name: str) -> None:
        """Refuse a head made for another target: vocabulary, feature width or feature layers that do not fit."""
        if self.model.vocab_size != target.vocab_size:
            raise ValueError(f"{name}: the head's vocabulary ({self.model.vocab_size}) differs from the target's "
                             f"({target.vocab_size}): use a head trained for this target")
        if self.target_hidden_size != target.hidden_size:
            raise ValueError(f"{name}: the head reads {self.target_hidden_size}-wide target features, the target's "
                             f"hidden size is {target.hidden_size}: use a head trained for this target")
        if len(self.feature_layers) != 3 or not all(0 <= j <= target.num_layers for j in self.feature_layers):
            raise ValueError(f"{name}: eagle_aux_hidden_state_layer_ids must be 3 ids in [0, {target.num_layers}], "
                             f"got {list(self.feature_layers)}")
        if not 0 < self.draft_vocab_size <= target.vocab_size:
            raise ValueError(f"{name}: draft_vocab_size must lie in [1, {target.vocab_size}], got "
                             f"{self.draft_vocab_size}")


def read_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint: safetensors files, else pytorch_model.bin (older EAGLE-3 releases)."""
    checkpoint = Path(checkpoint)
    weights: dict[str, torch.Tensor] = {}
    shards = sorted(checkpoint.glob("*.safetensors"))
    for shard in shards:
        with safe_open(shard, "pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name)
    if not shards and (checkpoint / "pytorch_model.bin").is_file():
        weights = torch.load(checkpoint / "pytorch_model.bin", weights_only=True, map_location="cpu")
    return weights


def draft_ids(weights: dict[str, torch.Tensor], config: Eagle3Config) -> torch.Tensor:
    """Target id of each draft-vocabulary row (i + d2t[i]), checked against `t2d`."""
    kd, vocab = config.draft_vocab_size, config.model.vocab_size
    d2t = weights.get("d2t")
    if d2t is None:  # a full-vocabulary head needs no map
        if kd != vocab:
            raise ValueError(f"a {kd}-id draft vocabulary needs the d2t buffer: the checkpoint lacks it")
        return torch.arange(vocab)
    ids = torch.arange(kd) + d2t.long()
    if d2t.shape != (kd,) or int(ids.min()) < 0 or int(ids.max()) >= vocab or len(ids.unique()) != kd:
        raise ValueError(f"d2t must map {kd} draft ids to distinct target ids in [0, {vocab}) (i + d2t[i])")
    t2d = weights.get("t2d")
    if t2d is not None and (t2d.shape != (vocab,) or int(t2d.sum()) != kd or not bool(t2d.bool()[ids].all())):
        raise ValueError("t2d disagrees with d2t: it must be True exactly at the draft vocabulary's target ids")
    return ids


def full_vocab_rows(logits: torch.Tensor, head_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft-vocabulary logits [T, len(head_ids)] -> full-vocabulary rows, -inf outside the draft vocabulary."""
    if len(head_ids) == vocab_size:
        return logits
    return torch.full((len(logits), vocab_size), -torch.inf).index_copy_(1, head_ids, logits)


class _NativeHead:
    """The head's weights packed for `cpu_kernels.eagle3_forward` (one C++ call per draft level: the midlayer, final
    norm and draft-vocabulary head with no per-op dispatch) and its static scratch, grown only by `reserve`."""

    def __init__(self, head: Eagle3Head):
        c, dtype = head.config.model, head.dtype
        self.kernels, self.config = load_kernels(), c
        self.embed = head.embed
        self.norms = [n.float().contiguous() for n in (head.input_norm, head.hidden_norm, head.post_norm, head.norm)]
        # on huge pages, as the target's weights (kernels.huge_page_arena)
        *projections, self.head, self.fc = huge_page_arena(
            [pack(w, dtype, amx=False) for w in (head.wqkv, head.wo, head.w13, head.w2, head.head, head.fc)])
        self.projections = [[w] for w in projections]
        self.draft_vocab = head.head.shape[0]
        self.inv_freq, self.rope_scale = head.inv_freq, head.rope_scale
        self.dims = [c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim]
        self.rows = self.positions = 0
        self.reserve(64, 2048 + 64)

    def reserve(self, rows: int, positions: int) -> None:
        if rows <= self.rows and positions <= self.positions:
            return
        self._bound = None  # new scratch and tables: bound again at the next forward (`bound`)
        c = self.config
        self.rows, self.positions = max(rows, self.rows), max(positions, self.positions)
        q_dim = c.num_heads * c.head_dim
        widths = [2 * c.hidden_size, c.hidden_size, q_dim + 2 * c.num_kv_heads * c.head_dim, q_dim,
                  2 * c.intermediate_size, c.intermediate_size]
        self.scratch = [torch.zeros(self.rows, w) for w in widths] + [
            torch.zeros(self.rows * c.num_heads, self.positions), torch.zeros(1, dtype=torch.uint8),
            torch.zeros(self.rows, c.hidden_size)]  # fc's output when the rows come with target features
        freqs = torch.arange(self.positions, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.rope_cos = (freqs.cos() * self.rope_scale).contiguous()
        self.rope_sin = (freqs.sin() * self.rope_scale).contiguous()

    def forward_many(self, segments, counts: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(logits of each segment's last `counts[i]` rows, output hidden of every row, rows per segment)."""
        rows = [s[0].shape[0] for s in segments]
        total = sum(rows)
        cat = len(segments) > 1
        tokens = torch.cat([s[0] for s in segments]) if cat else segments[0][0]
        positions = torch.cat([s[1] for s in segments]) if cat else segments[0][1]
        hidden = torch.cat([s[4] for s in segments]) if cat else segments[0][4]
        caches = [s[3] for s in segments]
        self.reserve(total, max(c.capacity for c in caches))
        logits = torch.empty(sum(counts), self.draft_vocab)
        out = torch.empty(total, self.config.hidden_size)
        self.kernels.eagle3_forward(
            self.bound, contiguous(tokens), contiguous(positions), rows, [c.length for c in caches],
            [contiguous(s[2]) for s in segments], [c.k for c in caches], [c.v for c in caches], fp32_rows(hidden),
            logits, head_rows(rows, counts), out)
        return logits, out, rows

    def bound_fields(self) -> dict:
        """The head's fields of `cpu_kernels.cpp` Bound (`kernels.bound_arguments`)."""
        return {"dims": self.dims, "eps": float(self.config.rms_norm_eps), "embed": self.embed, "norms": self.norms,
                "projs": self.projections, "head": self.head, "fc": self.fc, "rope_cos": self.rope_cos,
                "rope_sin": self.rope_sin, "scratch": self.scratch}

    bound = property(bound_arguments)  # the forward's per-call-invariant arguments, converted once


class Eagle3Head:
    """The head as an engine: `new_caches` like every engine, `forward_many` over (tokens, positions, tree_mask,
    cache, hidden) segments, `project` for the target features of committed tokens. On the native CPU forward when it
    can run here (fp32 or bf16 weights, fp32 arithmetic and KV, row invariant), else the torch path below."""

    def __init__(self, config: Eagle3Config, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 dtype: torch.dtype = torch.float32, native: bool | None = None):
        """`embed`: the target's input embedding [V, Ht] (used unless the checkpoint carries embed_tokens.weight).
        `native`: run on the native CPU forward (None: whenever it can run here)."""
        c = config.model
        missing = [n for n in [PREFIX + w for w in LAYER_WEIGHTS] + ["fc.weight", "norm.weight", "lm_head.weight"]
                   if n not in weights]
        if missing:
            raise ValueError(f"not an EAGLE-3 head in SpecForge's layout: missing {missing}")
        self.config, self.dtype = config, dtype
        w = {k: v.to(dtype) for k, v in weights.items() if v.is_floating_point()}
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        shapes = {"fc.weight": (c.hidden_size, 3 * config.target_hidden_size),
                  PREFIX + "self_attn.q_proj.weight": (q_dim, 2 * c.hidden_size),
                  PREFIX + "self_attn.k_proj.weight": (kv_dim, 2 * c.hidden_size),
                  PREFIX + "self_attn.o_proj.weight": (c.hidden_size, q_dim),
                  PREFIX + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
                  "lm_head.weight": (config.draft_vocab_size, c.hidden_size)}
        for name, shape in shapes.items():
            if tuple(w[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(w[name].shape)}, expected {shape} for this config")
        native_ok = dtype in (torch.float32, torch.bfloat16)
        if native is None:
            native = native_ok and native_unavailable() is None
        elif native and (not native_ok or native_unavailable()):
            raise ValueError(f"the native CPU forward cannot run this head: {native_unavailable() or dtype}")
        # the native forward reads an fp32 embedding (the target's own copy when it has one), the torch path `dtype`
        embed = weights.get("embed_tokens.weight", embed)
        self.embed = embed.float().contiguous() if native else embed.to(dtype)
        if self.embed.shape != (c.vocab_size, c.hidden_size):
            raise ValueError(f"the input embedding is {tuple(self.embed.shape)}, the head needs "
                             f"({c.vocab_size}, {c.hidden_size}): a head with another hidden size than its target "
                             "must carry embed_tokens.weight")
        self.fc = w["fc.weight"]
        p = PREFIX
        self.wqkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        self.wo = w[p + "self_attn.o_proj.weight"]
        self.w13 = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.w2 = w[p + "mlp.down_proj.weight"]
        self.input_norm, self.hidden_norm = w[p + "input_layernorm.weight"], w[p + "hidden_norm.weight"]
        self.post_norm, self.norm = w[p + "post_attention_layernorm.weight"], w["norm.weight"]
        self.head = w["lm_head.weight"]
        self.head_ids = draft_ids(weights, config)
        self.inv_freq, self.rope_scale = rope_frequencies(c)
        self.native = _NativeHead(self) if native else None

    @classmethod
    def load(cls, checkpoint: Path, target, dtype: torch.dtype = torch.float32, native: bool | None = None
             ) -> Eagle3Head:
        """A head checkpoint for `target` (a loaded engine: its embedding is the head's input embedding)."""
        config = Eagle3Config.from_dir(checkpoint, target.config)
        target_native = getattr(target, "native", None)
        embed = target_native.embed if target_native is not None else target.embed  # fp32 already: no second copy
        return cls(config, read_weights(checkpoint), embed, dtype, native)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def feature_width(self) -> int:
        """Width of the target feature rows `fc` reads (3 x the target's hidden size)."""
        return self.fc.shape[1]

    @property
    def exact_rows(self) -> bool:
        """Row invariant on the native forward only (prefix reuse keeps the head's rows: runtime/decoding/decoder.py)."""
        return self.native is not None

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list[KVCache]:
        """One static one-layer cache per concurrent request, allocated once as one pool."""
        if self.native is not None:  # fp32 K/V whatever the weights' dtype; tables sized once, here
            self.native.reserve(max_window, capacity)
            return KVCache.pool(self.config.model, slots, capacity, max_window, torch.float32, huge_pages=True,
                                kernels=self.native.kernels)
        return KVCache.pool(self.config.model, slots, capacity, max_window, self.dtype)

    def new_cache(self, capacity: int, max_window: int) -> KVCache:
        return self.new_caches(1, capacity, max_window)[0]

    @torch.no_grad()  # ordinary tensors out, as every engine (model.py `Transformer.forward`)
    def project(self, features: torch.Tensor) -> torch.Tensor:
        """fc: target features [T, 3 * Ht] (from `forward_features` with `feature_layers`) -> hidden inputs [T, H]."""
        if features.shape[-1] != self.fc.shape[1]:
            raise ValueError(f"target features must be [T, {self.fc.shape[1]}], got {tuple(features.shape)}")
        if self.native is not None:
            return linear(features.float(), self.native.fc, self.config.model.hidden_size)
        return F.linear(features.to(self.dtype), self.fc)

    def forward_many(self, segments: Sequence[tuple], full_vocab: bool = True,
                     logit_rows: Sequence[int | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logits [T, V], output hidden [T, H]) per (tokens, positions, tree_mask, cache, hidden) segment; on the
        native forward all segments' rows share each GEMM. With `logit_rows` the logits of each segment's last
        `logit_rows[i]` rows only (kernels.logit_counts: a catch-up drafts from its last row), the hidden of all.
        `hidden` is each row's input hidden [T, H], or in every segment the target features of committed tokens
        [T, 3 * Ht], which the call `project`s itself. Logits are full-vocabulary rows, -inf outside the draft
        vocabulary (its probability 0: top-k and sampling over a row are exact); with `full_vocab=False` the draft
        vocabulary's columns only ([T, len(head_ids)], column j is target id `head_ids[j]`), which is what the
        proposer reads: a 49,152-wide row per drafted node cost its fill and a 6x wider top-k scan."""
        c = self.config.model
        width = segments[0][4].shape[-1] if segments else c.hidden_size
        if width not in (c.hidden_size, self.fc.shape[1]):
            width = c.hidden_size  # named in the error below
        for tokens, _, mask, cache, hidden in segments:
            cache.new_slots(tokens, mask)
            if hidden.shape != (mask.shape[0], width):
                raise ValueError(f"hidden must be [{mask.shape[0]}, {c.hidden_size}] (or target features "
                                 f"[{mask.shape[0]}, {self.fc.shape[1]}] in every segment), got {tuple(hidden.shape)}")
        if self.native is None:
            with torch.no_grad():  # ordinary tensors out; the native path needs no context (`Transformer.forward`)
                if width != c.hidden_size:
                    segments = [(*s[:4], self.project(s[4])) for s in segments]
                out = [self._forward(*segment) for segment in segments]
            logits = last_rows([lg for lg, _ in out], logit_rows)
            return [(self.full_rows(lg) if full_vocab else lg, h) for lg, (_, h) in zip(logits, out, strict=True)]
        counts = logit_counts([s[0].shape[0] for s in segments], logit_rows)
        logits, out, rows = self.native.forward_many(segments, counts)
        if full_vocab:
            logits = self.full_rows(logits)
        return list(zip(split_rows(logits, counts), split_rows(out, rows), strict=True))

    def full_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return full_vocab_rows(logits, self.head_ids, self.config.model.vocab_size)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache: KVCache,
                hidden: torch.Tensor, full_vocab: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """One head pass over T rows: tokens [T], positions [T], tree_mask [T, W] over the cache's uncommitted
        window (as for every engine), hidden [T, H] (`project`ed target features or parent rows' outputs).
        Returns logits (as `forward_many`) and the rows' output hidden."""
        return self.forward_many([(tokens, positions, tree_mask, cache, hidden)], full_vocab)[0]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache: KVCache,
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference of one segment: draft-vocabulary logits and output hidden."""
        c = self.config.model
        t = tree_mask.shape[0]
        n = cache.length
        start, end = cache.new_slots(tokens, tree_mask)
        mask = cache.attention[:t, :end]
        mask[:, :n] = True
        mask[:, n:] = tree_mask
        eps = c.rms_norm_eps
        g = hidden.to(self.dtype)
        a = torch.cat([rms_norm(self.embed[tokens], self.input_norm, eps), rms_norm(g, self.hidden_norm, eps)], -1)
        qkv = F.linear(a, self.wqkv)
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[:, :q_dim].view(t, c.num_heads, c.head_dim).transpose(0, 1)
        k = qkv[:, q_dim:q_dim + kv_dim].view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = qkv[:, q_dim + kv_dim:].view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_scale, self.dtype)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        cache.k[0, :, start:end] = k
        cache.v[0, :, start:end] = v
        o = F.scaled_dot_product_attention(q[None], cache.k[0, None, :, :end], cache.v[0, None, :, :end],
                                           attn_mask=mask, enable_gqa=True)[0]
        h = g + F.linear(o.transpose(0, 1).reshape(t, q_dim), self.wo)
        gate, up = F.linear(rms_norm(h, self.post_norm, eps), self.w13).chunk(2, dim=-1)
        h = h + F.linear(F.silu(gate) * up, self.w2)
        return F.linear(rms_norm(h, self.norm, eps), self.head).float(), h.float()


def head_step_ms(head: Eagle3Head, nodes: int = 1, context: int = 128, repeats: int = 20) -> dict[str, float]:
    """Median ms of the head's work per speculative step, measured like `runtime/decoding/profile.py` measures engines:
    `level`: one draft level of `nodes` rows after `context` committed rows (draft-vocabulary logits, as the proposer
    reads them: what each tree level costs, the figure compared with a target step); `catch_up`: fc + one pass over
    `nodes` committed rows' target features (once per step, for the accepted tokens)."""
    import statistics
    import time

    c = head.config.model
    gen = torch.Generator().manual_seed(context)
    cache = head.new_cache(context + 64, 64)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    for start in range(0, context, 64):
        t = min(64, context - start)
        tokens = torch.randint(0, c.vocab_size, (t,), generator=gen)
        head.forward(tokens, torch.arange(start, start + t), causal[:t, :t], cache, torch.randn(t, c.hidden_size))
        cache.commit(t)
    tokens = torch.randint(0, c.vocab_size, (nodes,), generator=gen)
    positions = torch.full((nodes,), context)
    hidden = torch.randn(nodes, c.hidden_size, generator=gen)
    features = torch.randn(nodes, head.fc.shape[1], generator=gen)
    mask = torch.eye(nodes, dtype=torch.bool)

    def median_ms(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return round(statistics.median(times) * 1e3, 4)

    return {"level": median_ms(lambda: head.forward(tokens, positions, mask, cache, hidden, full_vocab=False)),
            "catch_up": median_ms(lambda: head.forward(tokens, positions, mask, cache, features, full_vocab=False))}
