"""The torch backend: a LLaMA-family decoder with a static KV cache and tree attention.

gpt-fast style: weights are plain tensors (q/k/v and gate/up fused so each layer runs 4 GEMMs),
the cache is allocated once, and each projection uses the kernel measured fastest for its shape
on this machine at load time (see `KernelChoice`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from spectrt.runtime.engines.families import (
    check_supported,
    family_features,
    family_tensors,
    rope_frequencies,
    rope_parameters,
    rope_scaling_spec,
)
from spectrt.runtime.engines.int8 import load_quantized, quant_format
from spectrt.runtime.engines.kernels import NativeModel, huge_page_zeros, last_rows, native_unavailable

# Rows per fp GEMM call in row-invariant mode (Transformer._project). Measured on the INT8 SmoothQuant target
# (1 thread, ms FP32 -> INT8): 1 row keeps AR steps at M=1, T=1 48 -> 30 (1.6x), T=5 76 -> 52 (1.46x);
# 8 rows speed up a 5-node verify, T=5 77 -> 51 (1.52x), but pad every AR step, T=1 48 -> 38 (1.27x).
ROW_BLOCK = 1
# A vocabulary-subset draft head (FR-Spec, EAGLE-3's d2t map), saved next to the draft's other tensors:
# the head's K rows and the target id of each row (config.json: spectrt_draft.vocab_subset = K).
SUBSET_HEAD, SUBSET_IDS = "draft_head.weight", "draft_head.ids"


def subset_head(weights: dict[str, torch.Tensor], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(head rows [K, H], their target ids [K]) of a vocabulary-subset draft, or None for a full head."""
    if SUBSET_IDS not in weights and SUBSET_HEAD not in weights:
        return None
    head, ids = weights.get(SUBSET_HEAD), weights.get(SUBSET_IDS)
    if head is None or ids is None or ids.dim() != 1 or ids.is_floating_point() or head.shape[0] != ids.shape[0]:
        raise ValueError(f"a subset draft head needs {SUBSET_HEAD} [K, H] and integer {SUBSET_IDS} [K]: "
                         "rebuild the draft with `spectrt draft --force`")
    ids = ids.long()
    if len(ids.unique()) != len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"{SUBSET_IDS} must be distinct target ids in [0, {vocab_size}): rebuild the draft")
    return head, ids


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name the forward reads, with the shape its config implies."""
    H, V, hd = config.hidden_size, config.vocab_size, config.head_dim
    q, kv, inter = config.num_heads * hd, config.num_kv_heads * hd, config.intermediate_size
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                       p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                       p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                       p + "mlp.down_proj.weight": (H, inter)})
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.output_bias:
            shapes[p + "self_attn.o_proj.bias"] = (H,)
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)})
    return shapes


def check_shapes(config: ModelConfig, weights: dict[str, torch.Tensor], checkpoint: Path | str) -> None:
    """Refuse a checkpoint whose tensors disagree with its config.json (or lack one the forward reads), naming the
    tensor. Why: the native forward sizes every loop from the config, so an edited `intermediate_size` or
    `vocab_size` read weights out of bounds (garbage or a segfault), where this names the problem at load."""
    for name, shape in expected_shapes(config).items():
        tied = config.tie_word_embeddings and name not in weights
        if name == "lm_head.weight" and (tied or SUBSET_HEAD in weights):
            continue  # tied to the embedding, or a vocabulary-subset draft head (checked by `subset_head`)
        if name not in weights:
            raise ValueError(f"{checkpoint} has no tensor {name}, which its config.json implies: the checkpoint is "
                             "incomplete or of another architecture (re-export it, e.g. with transformers' "
                             "save_pretrained)")
        if tuple(weights[name].shape) != shape:
            raise ValueError(f"{checkpoint}: tensor {name} has shape {list(weights[name].shape)}, but config.json "
                             f"implies {list(shape)}: the config does not describe these weights (restore the "
                             "checkpoint's own config.json)")
    if SUBSET_HEAD in weights and weights[SUBSET_HEAD].shape[1:] != (config.hidden_size,):
        raise ValueError(f"{checkpoint}: tensor {SUBSET_HEAD} has shape {list(weights[SUBSET_HEAD].shape)}, but "
                         f"config.json implies [K, {config.hidden_size}]: restore the checkpoint's own config.json")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and family features of a LLaMA-family decoder. Families differ only by data: `attention_bias`
    (q/k/v biases: Qwen2, Llama/Qwen3 with attention_bias), `output_bias` (o_proj bias: Llama/Qwen3 with
    attention_bias), `qk_norm` (per-head RMSNorm on q and k before RoPE: Qwen3) and `rope_scaling`
    ((key, value) pairs of a RoPE scaling that `rope_frequencies` turns into one fixed table; () = plain RoPE)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    attention_bias: bool = False
    output_bias: bool = False
    qk_norm: bool = False
    rope_scaling: tuple = ()

    def __post_init__(self):  # JSON (engine manifests) turns the pairs into lists: one canonical form
        object.__setattr__(self, "rope_scaling", tuple(sorted(tuple(p) for p in self.rope_scaling)))

    @classmethod
    def from_dir(cls, checkpoint: Path) -> ModelConfig:
        raw = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
        check_supported(raw, str(checkpoint))
        rope = rope_parameters(raw)
        heads = raw["num_attention_heads"]
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            **family_features(raw),
            rope_scaling=rope_scaling_spec(raw, str(checkpoint)),
        )


class KVCache:
    """One request's static K/V buffers for `capacity` positions: a slot of a pool allocated once (`pool`) and
    reused for every request that takes the slot.

    Slots [0, length) hold committed tokens. Uncommitted "window" slots after them hold the tree
    being drafted or verified; `compact` moves an accepted path into contiguous slots and commits it.
    `k`/`v` [layers, kv_heads, capacity, head_dim] are views of the pool's [slots, ...] tensors (`pool_k`,
    `pool_v`, this cache at index `slot`), so a batched graph can take the whole pool as one input.
    `attention` is a static bool buffer for the attention mask of one forward (torch reference path).
    """

    def __init__(self, pool_k: torch.Tensor, pool_v: torch.Tensor, slot: int, max_window: int, kernels=None):
        self.pool_k, self.pool_v, self.slot = pool_k, pool_v, slot
        self.kernels = kernels  # the native module whose `compact_cache` moves rows (a native engine's fp32 pool)
        self.k, self.v = pool_k[slot], pool_v[slot]
        self.capacity = self.k.shape[2]
        self.attention = torch.zeros(max_window, self.capacity, dtype=torch.bool, device=self.k.device)
        self.max_window = max_window
        self.length = 0

    @classmethod
    def pool(cls, config: ModelConfig, slots: int, capacity: int, max_window: int,
             dtype: torch.dtype, huge_pages: bool = False, kernels=None) -> list[KVCache]:
        """`slots` caches backed by one [slots, layers, kv_heads, capacity, head_dim] K and V tensor each
        (`huge_pages`: host memory on 2 MB pages, kernels.huge_page_zeros, for the native forward, every page faulted
        in here: a 2 MB page's first fault compacts memory, and left to the first request in each slot it cost that
        request 55-80 ms (measured copying a 40-token prefix into a fresh slot; 0.1 ms once faulted)); `kernels`: the
        native module of a native engine (fp32 K/V), whose `compact_cache` then compacts."""
        if slots < 1 or capacity < 1 or not 1 <= max_window <= capacity:
            raise ValueError(f"a KV pool needs slots >= 1 and 1 <= max_window <= capacity, got slots={slots}, "
                             f"capacity={capacity}, max_window={max_window}")
        shape = (slots, config.num_layers, config.num_kv_heads, capacity, config.head_dim)
        zeros = huge_page_zeros if huge_pages else torch.zeros
        k, v = zeros(shape, dtype=dtype), zeros(shape, dtype=dtype)
        if huge_pages:
            k.zero_(), v.zero_()  # static allocation: the pages now, not inside a request
        return [cls(k, v, s, max_window, kernels) for s in range(slots)]

    def reset(self) -> None:
        self.length = 0

    def commit(self, count: int) -> None:
        """Window slots [0, count) become part of the committed prefix."""
        self.length += count

    def new_slots(self, tokens: torch.Tensor, tree_mask: torch.Tensor, max_rows: int | None = None) -> tuple[int, int]:
        """Absolute slots [start, end) a forward of `tokens` under `tree_mask` [T, W] writes; refuses overflow."""
        t, window = tree_mask.shape
        start, end = self.length + window - t, self.length + window
        if end > self.capacity or t > min(self.max_window, max_rows or t) or tokens.shape[0] != t or window < t:
            raise ValueError(
                f"forward of {t} tokens in a {window}-slot window after {self.length} exceeds the static cache"
            )
        return start, end

    def copy_prefix(self, source: KVCache, length: int) -> None:
        """Rows [0, length) of `source` (another slot of this pool) become this cache's (prefix reuse)."""
        self.k[:, :, :length] = source.k[:, :, :length]
        self.v[:, :, :length] = source.v[:, :, :length]

    def compact(self, window_indices: list[int]) -> None:
        """Keep the given window slots (ascending) as the next committed tokens; the rest are dropped.

        Only slots after the leading run already in place (0, 1, ...) move: natively for a native engine's pool
        (`cpu_kernels.cpp` compact_cache), else with numpy's indexed copy where the buffers are fp32 and torch's where
        not. Why: torch's took ~2.5x numpy's (266 vs 109 us for two moved slots right after a cache flush, 79 vs 27 us
        warm), and numpy's 74 us right after a target forward against the native copy's ~10, a cost of nearly every
        accepted tree step."""
        n, keep = self.length, len(window_indices)
        first = next((i for i, w in enumerate(window_indices) if w != i), keep)
        if first < keep and self.kernels is not None:
            self.kernels.compact_cache(self.k, self.v, n, window_indices)
        elif first < keep:
            src = [n + w for w in window_indices[first:]]
            for buf in (self.k, self.v):
                a = buf.numpy() if buf.dtype == torch.float32 else buf
                a[:, :, n + first:n + keep] = a[:, :, src]
        self.length += keep


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in at least fp32, back in x's dtype, then scaled (the torch reference path of every engine)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., head_dim] for `positions` [...], the halves repeated (Hugging Face's rotate-half layout)."""
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding applied to x [..., head_dim] (rotate-half)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class KernelChoice:
    """Per weight shape, the fastest GEMM formulation for one row and for several rows, measured at load.

    On some CPUs MKL's single-row `F.linear` is several times slower than `mm(W, X^T)` on a
    duplicated row (the LM head above all), while small projections prefer `F.linear`.
    """

    def __init__(self, measure: bool = True):
        self.measure = measure
        self.choice: dict[tuple, bool] = {}

    @staticmethod
    def _mm_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return torch.mm(w, x.expand(2, -1).contiguous().T)[:, :1].T
        return torch.mm(w, x.T).T

    def _fastest(self, w: torch.Tensor, rows: int) -> bool:
        x = torch.randn(rows, w.shape[1], dtype=w.dtype)
        timings = []
        for fn in (F.linear, self._mm_t):
            fn(x, w)
            start = time.perf_counter()
            for _ in range(5):
                fn(x, w)
            timings.append(time.perf_counter() - start)
        return timings[1] < timings[0]

    def prepare(self, weights: list) -> None:
        """Measure every fp weight shape now (at load), so no request pays for it inside its own timing."""
        for w in weights:
            if isinstance(w, torch.Tensor):
                for single in (True, False):
                    key = (tuple(w.shape), w.dtype, single)
                    if key not in self.choice:
                        self.choice[key] = self.measure and self._fastest(w, 1 if single else 8)

    def __call__(self, x: torch.Tensor, w) -> torch.Tensor:
        if not isinstance(w, torch.Tensor):  # an INT8 projection (runtime/engines/int8.py) brings its own kernel
            return w(x)
        key = (tuple(w.shape), w.dtype, x.shape[0] == 1)
        use_mm = self.choice.get(key)
        if use_mm is None:
            use_mm = self.choice[key] = self.measure and self._fastest(w, 1 if key[2] else 8)
        return self._mm_t(x, w) if use_mm else F.linear(x, w)


class Transformer:
    """LLaMA forward over new tokens with explicit positions and a tree mask, writing into a KVCache."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 measure_kernels: bool = True, projections: list[dict] | None = None, native: bool | None = None,
                 packed_dtype: torch.dtype | None = None, pair_dots: bool = False):
        """`projections`: per layer, replacements for the fused projections (an INT8 target's).

        `native`: run the native CPU forward (runtime/engines/kernels.py; None = whenever it can run here). It is row
        invariant and several times cheaper per verified row; the torch path stays the reference and the INT8 path.
        `packed_dtype`: the native forward's fp weights (default `dtype`; an INT8 recipe's bf16 kept weights).
        `pair_dots`: bf16dot, bf16 weights and GEMM inputs summed in k pairs (native only: `NativeModel`).
        """
        self.config = config
        self.dtype = dtype
        w = {k: v.to(dtype) for k, v in weights.items()}
        self.embed = w["model.embed_tokens.weight"]
        self.head = w.get("lm_head.weight", self.embed) if config.tie_word_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        # subset draft head: logits over K ids, scattered into a full-vocabulary row of -inf (`_logits`)
        subset = subset_head(weights, config.vocab_size)
        self.head_ids = subset[1] if subset else None
        self.head = subset[0].to(dtype) if subset else self.head
        self.layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            layer = {"attn_norm": w[p + "input_layernorm.weight"], "mlp_norm": w[p + "post_attention_layernorm.weight"],
                     **family_tensors(config, w, p)}
            layer.update(projections[i] if projections else {
                "wqkv": torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
                "wo": w[p + "self_attn.o_proj.weight"],
                "w13": torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
                "w2": w[p + "mlp.down_proj.weight"],
            })
            self.layers.append(layer)
        self.linear = KernelChoice(measure_kernels)
        # A target whose activations are quantized must compute each row exactly as when that token is decoded
        # alone; see `_row_invariant_attention`. Its int8 GEMMs are exact; fp projections use fixed row blocks.
        self.row_invariant = bool(projections) and any(not isinstance(w, torch.Tensor)
                                                       for layer in projections for w in layer.values())
        self.inv_freq, self.rope_scale = rope_frequencies(config)
        # fp64 stays on the reference path (exactness tests); W8A8 runs natively on every ISA (simd.h dot4)
        native_ok = dtype in (torch.float32, torch.bfloat16)
        if native is None:
            native = native_ok and native_unavailable() is None
        elif native and (not native_ok or native_unavailable()):
            reason = native_unavailable() or f"it runs fp32/bf16 weights (and W8A8), not {dtype}"
            raise ValueError(f"the native CPU forward cannot run this engine: {reason}")
        if pair_dots and not native:
            raise ValueError("--dtype bf16dot runs on the native CPU forward only "
                             f"({native_unavailable() or 'native=False'}): use --dtype bf16")
        self.native = NativeModel(config, self.embed, self.norm, self.head, self.layers, self.inv_freq,
                                  self.rope_scale, packed_dtype or dtype, self.head_ids, pair_dots) if native else None
        if self.native is None and measure_kernels:  # the reference path's kernel choice, timed at load
            self.linear.prepare([self.head] + [w for layer in self.layers for k, w in layer.items()
                                               if k in ("wqkv", "wo", "w13", "w2")])

    @classmethod
    def load(cls, checkpoint: Path, dtype: torch.dtype = torch.float32, measure_kernels: bool = True,
             native: bool | None = None, pair_dots: bool = False) -> Transformer:
        config = ModelConfig.from_dir(checkpoint)
        if quant_format(checkpoint):
            if dtype != torch.float32:
                raise ValueError(f"{checkpoint} is an INT8 checkpoint: its non-GEMM ops run in fp32, use --dtype fp32")
            weights, projections, packed = load_quantized(checkpoint, config)
            return cls(config, weights, dtype, measure_kernels, projections, native=native, packed_dtype=packed)
        weights = {}
        for shard in sorted(Path(checkpoint).glob("*.safetensors")):
            with safe_open(shard, "pt") as f:
                for name in f.keys():
                    weights[name] = f.get_tensor(name)
        check_shapes(config, weights, checkpoint)
        return cls(config, weights, dtype, measure_kernels, native=native, pair_dots=pair_dots)

    @property
    def inexact(self) -> str | None:
        """None where tree verification is exact (engine.py `Engine.inexact`): the native forward and the INT8 torch
        path compute every row alone; the fp32 torch path's rows move by ~1e-7 with the batch shape, which changes
        no output in the decoder tests (greedy tree == AR, run on this path). In bf16 the torch path's rows round
        differently per tree shape: default speculation matched bf16 AR on 2 of 12 bench prompts."""
        if self.native is not None or self.row_invariant or self.dtype in (torch.float32, torch.float64):
            return None
        why = native_unavailable()
        native = f"the native forward (unavailable here: {why})" if why else "the native forward (native=None)"
        return (f"the torch reference path is not row invariant in {str(self.dtype).removeprefix('torch.')} (a "
                "verified row rounds differently from the same token decoded alone), so tree decoding would not "
                f"equal AR: use --dtype fp32, or {native}")

    @property
    def exact_rows(self) -> bool:
        """A row's K/V and logits do not depend on the other rows of its forward (the native forward, the INT8 row
        invariant path): a KV row reused from an earlier request equals a recomputed one bitwise."""
        return self.native is not None or self.row_invariant

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list[KVCache]:
        """`slots` static caches (one per concurrent request), allocated once as one pool."""
        if self.native is not None:  # fp32 K/V whatever the weights' dtype; tables sized once, here
            self.native.reserve(max_window, capacity)
            return KVCache.pool(self.config, slots, capacity, max_window, torch.float32, huge_pages=True,
                                kernels=self.native.kernels)
        return KVCache.pool(self.config, slots, capacity, max_window, self.dtype)

    def new_cache(self, capacity: int, max_window: int) -> KVCache:
        """One cache (a pool of one): single-request tools and tests."""
        return self.new_caches(1, capacity, max_window)[0]

    def forward_many(self, segments: list[tuple], logit_rows: Sequence[int | None] | None = None
                     ) -> list[torch.Tensor]:
        """Logits per (tokens, positions, tree_mask, cache) segment; with the native forward all segments' rows
        share each GEMM (one weight stream for a batch of requests), and the result is the same as one `forward`
        per segment. `logit_rows`: only each segment's last `logit_rows[i]` rows' logits (kernels.logit_counts)."""
        if self.native is not None:
            return self.native.forward_many(segments, logit_rows)
        return last_rows([self.forward(*segment) for segment in segments], logit_rows)

    def forward_features(self, segments: list[tuple], feature_layers: Sequence[int],
                         logit_rows: Sequence[int | None] | None = None
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(logits, features) per segment: features [T, len(feature_layers) * hidden] fp32 are the residual stream
        entering each listed layer (the output of the layer before; `num_layers` = the last layer's output, before
        the final norm), concatenated in the listed order: EAGLE-3's low/mid/high target features; logits as
        `forward_many` gives them."""
        layers = [int(j) for j in feature_layers]
        if not layers or any(not 0 <= j <= self.config.num_layers for j in layers):
            raise ValueError(f"feature layers must lie in [0, {self.config.num_layers}], got {layers}")
        if self.native is not None:  # no autograd context: see `forward`
            return self.native.forward_features(segments, layers, logit_rows)
        with torch.no_grad():  # not inference_mode: see `forward`
            out = [self._forward(*segment, feature_layers=layers) for segment in segments]
        return last_rows([o[0] for o in out], logit_rows), [o[1] for o in out]

    def argmax_of(self, logits: list[torch.Tensor]) -> list[list[int]] | None:
        """The argmax of rows of the last forward's logits as that forward computed them (native forward), else None:
        the caller reduces the rows itself (`sampling.argmax_rows`)."""
        return self.native.argmax_of(logits) if self.native is not None else None

    def weight_bytes(self) -> int:
        """Bytes of all weights held (a tied head counted once)."""
        tensors = [self.embed, self.norm] + ([self.head] if self.head is not self.embed else [])
        tensors += [t for layer in self.layers for t in layer.values()]
        return sum(t.nbytes for t in tensors)

    def _project(self, x: torch.Tensor, w) -> torch.Tensor:
        if self.row_invariant and isinstance(w, torch.Tensor):
            # An fp GEMM's row results depend on how many rows it has, not on what the other rows hold
            # (checked bitwise at 1 and 2 threads), so fixed-size zero-padded row blocks make them invariant.
            t = x.shape[0]
            if t % ROW_BLOCK:
                x = F.pad(x, (0, 0, 0, -t % ROW_BLOCK))
            if x.shape[0] == ROW_BLOCK:  # one block (every AR step): no split, no copy
                return self.linear(x, w)[:t]
            return torch.cat([self.linear(block, w) for block in x.split(ROW_BLOCK)])[:t]
        return self.linear(x, w)

    @staticmethod
    def _visible_rows(mask: torch.Tensor) -> tuple[list[int | None], torch.Tensor, list[int]]:
        """Per row, the end of its visible slots if they are one prefix [0, end) (a view suffices), else None;
        plus one index of all other rows' visible slots, concatenated, and their lengths."""
        ends, cols, sizes = [], [], []
        for row in mask:
            idx = row.nonzero().squeeze(1)
            contiguous = int(idx[-1]) + 1 == len(idx)
            ends.append(len(idx) if contiguous else None)
            if not contiguous:
                cols.append(idx)
                sizes.append(len(idx))
        return ends, torch.cat(cols) if cols else torch.empty(0, dtype=torch.long), sizes

    @staticmethod
    def _row_invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible) -> torch.Tensor:
        """Attention where each row sees exactly its visible slots, in slot order, in its own call.

        That is the same call on the same values as when the row's token was decoded alone (prefix + its
        ancestors), so a verified row is bit-identical to an autoregressive step. Batched kernels are not
        (row results depend on the batch shape by ~1e-7), which is harmless in floating point but not with
        quantized activations: a flipped rounding moves a value by a whole int8 step and cascades through
        the layers (measured: INT8 tree decoding left the INT8 target's own AR output on 7 of 8 prompts).
        """
        ends, cols, sizes = visible
        gathered_k = k[:, cols].split(sizes, dim=1) if sizes else ()
        gathered_v = v[:, cols].split(sizes, dim=1) if sizes else ()
        rows, g = [], 0
        for r, end in enumerate(ends):
            if end is not None:
                kr, vr = k[:, :end], v[:, :end]
            else:
                kr, vr = gathered_k[g], gathered_v[g]
                g += 1
            rows.append(F.scaled_dot_product_attention(q[None, :, r:r + 1], kr[None], vr[None], enable_gqa=True))
        return torch.cat(rows, dim=2)[0]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Logits [T, V] for `tokens` [T]; their K/V land in the last T slots of a W-slot window.

        `tree_mask` [T, W] says which window slots each new token sees (the committed prefix is
        always visible); the new tokens occupy window slots [W - T, W).

        Under no_grad, not inference_mode: the logits are ordinary tensors whichever path made them, because the
        decode loop masks them in place (`Decoder._constrain`: min_length, bad words) and an inference tensor
        refuses that outside inference mode (every constrained request failed on the torch path, and with an
        EAGLE-3 head on the native one too). Measured on the torch path, T=1: 43.6 vs 44.4 ms, no cost. The native
        forward runs outside any autograd context: it records no graph, and entering and leaving no_grad was ~7% of
        a batch-1 step's host work in the loop (py-spy, bf16), the caches cold after the forward.
        """
        if self.native is not None:
            return self.native.forward_many([(tokens, positions, tree_mask, cache)])[0]
        with torch.no_grad():
            return self._forward(tokens, positions, tree_mask, cache)[0]

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache: KVCache,
                 feature_layers: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reference forward: logits and, for `feature_layers`, the residual stream entering those layers."""
        c = self.config
        t = tree_mask.shape[0]
        n = cache.length
        start, end = cache.new_slots(tokens, tree_mask)
        mask = cache.attention[:t, :end]
        mask[:, :n] = True
        mask[:, n:] = tree_mask
        cos, sin = rope_tables(positions, self.inv_freq, self.rope_scale, self.dtype)
        eps = c.rms_norm_eps
        x = self.embed[tokens]
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        visible = self._visible_rows(mask) if self.row_invariant else None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in feature_layers:
                captured[i] = x.float()
            h = rms_norm(x, layer["attn_norm"], eps)
            qkv = self._project(h, layer["wqkv"])
            if c.attention_bias:
                qkv = qkv + layer["bqkv"]
            q = qkv[:, :q_dim].view(t, c.num_heads, c.head_dim).transpose(0, 1)
            k = qkv[:, q_dim:q_dim + kv_dim].view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            v = qkv[:, q_dim + kv_dim:].view(t, c.num_kv_heads, c.head_dim).transpose(0, 1)
            if c.qk_norm:
                q, k = rms_norm(q, layer["q_norm"], eps), rms_norm(k, layer["k_norm"], eps)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            cache.k[i, :, start:end] = k
            cache.v[i, :, start:end] = v
            if visible is not None:
                o = self._row_invariant_attention(q, cache.k[i], cache.v[i], visible)
            else:
                o = F.scaled_dot_product_attention(
                    q[None], cache.k[i, None, :, :end], cache.v[i, None, :, :end], attn_mask=mask, enable_gqa=True
                )[0]
            o = self._project(o.transpose(0, 1).reshape(t, q_dim), layer["wo"])
            x = x + (o + layer["bo"] if c.output_bias else o)
            h = rms_norm(x, layer["mlp_norm"], eps)
            gate, up = self._project(h, layer["w13"]).chunk(2, dim=-1)
            x = x + self._project(F.silu(gate) * up, layer["w2"])
        captured[c.num_layers] = x.float()
        features = torch.cat([captured[j] for j in feature_layers], dim=-1) if feature_layers else None
        return self._logits(rms_norm(x, self.norm, eps)), features

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits [T, V], a fresh tensor (callers keep rows of several forwards at once). A subset
        head's ids get its scores, every other id -inf (probability 0), so top-k and sampling over the row are exact."""
        logits = self.linear(h, self.head).float()
        if self.head_ids is None:
            return logits
        return torch.full((len(h), self.config.vocab_size), -torch.inf).index_copy_(1, self.head_ids, logits)
