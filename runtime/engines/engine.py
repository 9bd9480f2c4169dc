"""The one engine interface shared by draft and target, and loading of a draft/target pair.

Every backend implements `forward_many(segments) -> logits per segment` (a segment: tokens, positions, tree mask,
cache) over static caches it allocates once (`new_caches`: one per concurrent request); the decoder never sees
which backend it drives. `forward` is the one-segment case.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np
import torch
from spectrt.runtime.engines.model import KVCache, ModelConfig, Transformer

# --dtype -> the weights' torch dtype. bf16dot: bf16 weights and bf16 GEMM inputs summed in k pairs (the native
# forward only: cpu_kernels.cpp `dot_block`); an exact mode of its own (row invariant), whose outputs are not bf16's.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16dot": torch.bfloat16}


class Segment(NamedTuple):
    """One request's rows in a forward (a tuple: engines unpack it): its new tokens [T], their positions [T], which
    of its cache's uncommitted window slots each row sees [T, W] (the committed prefix always), and its cache."""

    tokens: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    cache: KVCache


class HeadSegment(NamedTuple):
    """A segment of an EAGLE-3 head (engines/eagle3.py): a `Segment` plus each row's input: the target's features of a
    committed token [T, 3 * Ht] (the head projects them), or a drafted node's parent row's output hidden [T, H]."""

    tokens: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    cache: KVCache
    hidden: torch.Tensor


class SegmentBuffers:
    """Static per-slot token and position rows for the segments a decode step builds, each slot's view of every
    length made once, and a contiguous causal mask of every size: a segment's tensors then cost two numpy writes and
    no torch op (gpt-fast's static buffers, on the host side). Why: a forward streams every weight through the
    caches, and each torch op the host path dispatches after it runs cold (in the loop ~10-20 us, ~2 warm); a step
    made two or three small tensors per request (`torch.tensor`, `torch.arange`, a sliced mask the native forward
    then copied). A slot's views hold what its last `rows` call wrote: a step reads its segments within that step.
    """

    SMALL = 16  # rows written one by one through memoryviews; numpy above (a prompt chunk)

    def __init__(self, slots: int, width: int):
        self.width = width
        self.tokens = torch.zeros(slots, width, dtype=torch.long)
        self.positions = torch.zeros(slots, width, dtype=torch.long)
        self._tokens, self._positions = self.tokens.numpy(), self.positions.numpy()
        # per-slot memoryviews of the same rows. Why: a step's few rows written item by item through CPython's own
        # buffer code cost 4 us on the caches a forward had flushed, numpy's slice assignment and add 12-20 us
        # (Zen 4, after a 64 MB sweep; 2.4 calls a batch-1 step)
        self._token_rows = [memoryview(self._tokens[s]) for s in range(slots)]
        self._position_rows = [memoryview(self._positions[s]) for s in range(slots)]
        self._ramp = np.arange(width, dtype=np.int64)
        self.zeros = (0,) * width  # offsets of rows that share one position (a draft level)
        self._views = [[(self.tokens[s, :n], self.positions[s, :n]) for n in range(width + 1)] for s in range(slots)]
        self.causal = [torch.ones(n, n, dtype=torch.bool).tril() for n in range(width + 1)]

    def rows(self, slot: int, tokens: Sequence[int], start: int, offsets: Sequence[int] | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, positions) of one segment in `slot`'s buffers: positions `start + offsets` (default 0, 1, ...:
        a causal chunk; a tree passes its depths)."""
        n = len(tokens)
        if n > self.width:
            raise ValueError(f"a segment of {n} rows exceeds the {self.width}-row window")
        if n <= self.SMALL:
            token_row, position_row = self._token_rows[slot], self._position_rows[slot]
            for i in range(n):
                token_row[i] = tokens[i]
                position_row[i] = start + (i if offsets is None else offsets[i])
        else:
            self._tokens[slot, :n] = tokens
            np.add(self._ramp[:n] if offsets is None else offsets, start, out=self._positions[slot, :n])
        return self._views[slot][n]


class Engine(Protocol):
    config: ModelConfig
    # None when a verified tree row computes what an autoregressive step of that token computes (so greedy tree
    # decoding gives this engine's own AR output), else why not and the fix: the decoder refuses speculation then
    inexact: str | None

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list[KVCache]:
        """One static cache per concurrent request, allocated once (one pool per engine)."""

    def new_cache(self, capacity: int, max_window: int) -> KVCache: ...

    def forward_many(self, segments: list[Segment], logit_rows: Sequence[int | None] | None = None
                     ) -> list[torch.Tensor]:
        """Logits [T_i, V] per segment, each a tensor of its own (never a view a later forward overwrites) and an
        ordinary one (not an inference tensor): the decode loop masks rows in place. With `logit_rows`, segment i's
        last `logit_rows[i]` rows only (None: all; kernels.logit_counts): the loop reads no prefill chunk's logits,
        and the native forward then skips their LM head."""

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor: ...


def load_engine(checkpoint: Path, backend: str = "torch", dtype: str = "fp32", measure_kernels: bool = True) -> Engine:
    """Load one model for the given backend (torch is the reference and the CPU path). `measure_kernels=False`
    fixes the torch reference path's GEMM formulation instead of timing it at load (reproducible numerics)."""
    dtype = resolve_dtype(dtype, backend, checkpoint)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported: choose auto or one of {sorted(DTYPES)}")
    if backend == "onnxruntime":  # `checkpoint` is a model of an engines dir: engines/<name>/{target,draft}
        if dtype != "fp32":
            raise ValueError("--backend onnxruntime runs the exported fp32 graph: use --dtype fp32")
        from spectrt.runtime.engines.onnx_engine import OnnxEngine

        return OnnxEngine.load(Path(checkpoint))
    if backend == "tensorrt":  # precision is the plan's (manifest.json), not --dtype
        from spectrt.runtime.engines.trt_engine import TensorRTEngine

        return TensorRTEngine.load(Path(checkpoint))
    if backend != "torch":
        raise ValueError(f"--backend {backend!r} is not available: choose torch, onnxruntime or tensorrt")
    return load_transformer(Path(checkpoint), dtype, measure_kernels)


def load_transformer(checkpoint: Path, dtype: str, measure_kernels: bool = True) -> Transformer:
    """The torch backend's engine for a --dtype name (fp32, bf16, bf16dot)."""
    return Transformer.load(Path(checkpoint), DTYPES[dtype], measure_kernels, pair_dots=dtype == "bf16dot")


def resolve_dtype(dtype: str, backend: str = "torch", checkpoint: Path | None = None) -> str:
    """`auto` (the default everywhere), on the native CPU forward: bf16dot where it runs on AMX tiles, else bf16;
    fp32 elsewhere (the torch reference path is not row invariant in bf16; exported graphs run fp32) and for an INT8
    `checkpoint` (its non-GEMM ops run in fp32). Each is exact (row invariant: tree decoding equals that precision's
    AR). bf16 (bf16 weights, fp32 arithmetic) streams half fp32's bytes: 2x faster. bf16dot on AMX (bf16 GEMM inputs,
    kernels.py `amx_enabled`) runs AR at bf16's speed and verifies trees and batches far cheaper; measured on an Intel
    Xeon with AMX (2 cores, one process, prompts interleaved, `scripts/precision_vs_precision.py`): its default policy
    1.75x bf16 AR on chat and 2.30x on repetitive work, against bf16's own 1.58x / 1.95x. Its answers are its own (the
    AMX tile unit's sums), not bf16's, which every CPU computes alike: `--dtype bf16` where answers must match another
    machine's."""
    if dtype != "auto":
        return dtype
    from spectrt.runtime.engines.int8 import quant_format
    from spectrt.runtime.engines.kernels import amx_enabled, native_unavailable

    if checkpoint is not None and (Path(checkpoint) / "config.json").is_file() and quant_format(Path(checkpoint)):
        return "fp32"
    if backend != "torch" or native_unavailable() is not None:
        return "fp32"
    return "bf16dot" if amx_enabled(pairs=True) else "bf16"


def fallback_notice(backend: str) -> str | None:
    """The line `spectrt generate` and `spectrt serve` print once (stderr) when the torch reference path runs
    instead of the native forward: a slower engine is never a silent one."""
    from spectrt.runtime.engines.kernels import native_unavailable

    why = native_unavailable() if backend == "torch" else None
    if why is None:
        return None
    return (f"spectrt: the native CPU forward is unavailable ({why}): the torch reference path runs (slow: 2-4x the "
            "native forward's time per token; speculation needs --dtype fp32 there)")


def draft_dtype(backend: str, dtype: str) -> str:
    """The draft's precision: bf16 weights on the native CPU forward (half the memory traffic per draft step, fp32
    arithmetic; the target verifies, so the output never changes), else the target's dtype."""
    from spectrt.runtime.engines.kernels import native_unavailable

    return "bf16" if backend == "torch" and native_unavailable() is None else dtype


def _vocabulary_fingerprint(checkpoint: Path) -> str:
    """Hash of the tokenizer's token->id map, so differently formatted files with one vocabulary agree."""
    tokenizer_json = Path(checkpoint) / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"{checkpoint} has no tokenizer.json: copy the target's tokenizer files next to the weights")
    model = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = model.get("model", {}).get("vocab", {})
    added = {t["content"]: t["id"] for t in model.get("added_tokens", [])}
    canonical = json.dumps([sorted(vocab.items()) if isinstance(vocab, dict) else vocab, sorted(added.items())])
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_draft_matches(target: Path, draft: Path) -> None:
    """Refuse a draft whose vocabulary differs from the target's: its token ids would mean other tokens."""
    t_cfg, d_cfg = ModelConfig.from_dir(target), ModelConfig.from_dir(draft)
    if t_cfg.vocab_size != d_cfg.vocab_size or _vocabulary_fingerprint(target) != _vocabulary_fingerprint(draft):
        raise ValueError(
            f"draft {draft} does not share the target's tokenizer/vocabulary (vocab sizes {d_cfg.vocab_size} vs "
            f"{t_cfg.vocab_size}): make a draft from this target with `spectrt draft --target {target}`"
        )
