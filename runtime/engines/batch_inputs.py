"""Inputs of the batched tree-verify graph (build/export.py), in TensorRT-LLM's speculative-decoding language.

One graph run serves B requests. Request b brings T_b new tokens (a prompt chunk, a draft level, a whole tree or
one decode token) that attend to its own KV slot only. The tokens are packed (request b's rows follow request
b-1's: N = sum T_b rows, no padding in the GEMMs, TensorRT-LLM's `remove_input_padding` layout); the per-request
tensors are padded to T = max T_b (and M mask words):

| input                              | shape     | meaning                                                  |
|------------------------------------|-----------|----------------------------------------------------------|
| `input_ids`                        | [N]       | the new tokens, packed                                   |
| `spec_decoding_generation_lengths` | [B]       | T_b, the new tokens of request b (>= 1)                  |
| `spec_decoding_position_offsets`   | [B, T]    | RoPE position = past length + offset (tree: the depth)   |
| `spec_decoding_packed_mask`        | [B, T, M] | bit j % 32 of word j // 32, row i: node i sees window slot j |
| `past_key_value_lengths`           | [B]       | committed tokens of request b: always visible            |
| `window_offsets`                   | [B]       | window slots already in the cache (earlier draft levels) |
| `slot_ids`                         | [B]       | request b's slot of the KV pool                          |
| `cache_columns`                    | [S]       | 0..S-1: the cache slots attention covers (S >= past + window) |
| `pool_k`, `pool_v`                 | [P, L, Hkv, C, D] | the runtime's KV pool (P slots), read in place   |

A request's uncommitted *window* starts at its past length: window slot j is cache slot past + j. The new tokens
are window slots [window_offset, window_offset + T_b); earlier window slots were written by earlier forwards (a
draft expanding a tree level by level). A segment's tree mask `[T_b, W_b]` over the window is therefore exactly
the packed mask's bit matrix, and `window_offset = W_b - T_b`; a target verify or a prompt chunk has offset 0 and
then the mask is TensorRT-LLM's `spec_decoding_packed_mask` (a chain's row i is (1 << (i + 1)) - 1).

Everything here is a pure function of the segments; the engines bind the result and copy the returned new K/V into
the pool slots `kv_writes` names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INPUT_NAMES = ("input_ids", "spec_decoding_generation_lengths", "spec_decoding_position_offsets",
               "spec_decoding_packed_mask", "past_key_value_lengths", "window_offsets", "slot_ids", "cache_columns",
               "pool_k", "pool_v")
OUTPUT_NAMES = ("logits", "new_k", "new_v")
FEATURES = "features"  # the target graph's extra output when exported for an EAGLE-3 head (build/export.py)
# the EAGLE-3 head graph's (build/export_eagle3.py): the same inputs plus each row's input hidden, split by source
HEAD_INPUT_NAMES = (*INPUT_NAMES, "target_features", "hidden_states")
HEAD_OUTPUT_NAMES = (*OUTPUT_NAMES, "hidden_out")
WORD_BITS = 32
INT32_LIMIT = 2**31


def mask_words(width: int) -> int:
    """int32 words per packed row for `width` window slots (at least one)."""
    return max(1, -(-width // WORD_BITS))


def pack_mask(mask: torch.Tensor, words: int | None = None) -> torch.Tensor:
    """bool [..., W] -> int32 [..., words] (default ceil(W/32)): bit j % 32 of word j // 32 is mask[..., j]."""
    width = mask.shape[-1]
    words = words or mask_words(width)
    if words * WORD_BITS < width:
        raise ValueError(f"{width} mask columns need {mask_words(width)} words, not {words}")
    bits = torch.zeros(*mask.shape[:-1], words * WORD_BITS, dtype=torch.int64)
    bits[..., :width] = mask.to(torch.int64)
    weights = torch.ones(WORD_BITS, dtype=torch.int64) << torch.arange(WORD_BITS)
    packed = (bits.view(*mask.shape[:-1], words, WORD_BITS) * weights).sum(-1)  # in [0, 2^32)
    return torch.where(packed >= INT32_LIMIT, packed - 2 * INT32_LIMIT, packed).to(torch.int32)  # two's complement


def unpack_mask(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., M] -> int32 0/1 [..., 32 M], the inverse of `pack_mask` (padding columns 0).

    Written with Div/Mul/Sub only, because the graph runs it: ONNX opset 17 (what ModelOpt's Q/DQ export and
    TensorRT's parser take) has no bitwise operators. The sign bit (bit 31) is split off first, so every
    division is of a non-negative number (truncating and flooring division agree).
    """
    negative = packed < 0
    low = torch.where(negative, packed - (-INT32_LIMIT), packed)  # bits 0..30, in [0, 2^31)
    powers = torch.ones(WORD_BITS - 1, dtype=torch.int32) << torch.arange(WORD_BITS - 1, dtype=torch.int32)
    quotients = torch.div(low.unsqueeze(-1), powers, rounding_mode="trunc")  # low >> j, j = 0..30
    bits = torch.cat([quotients[..., :-1] - 2 * quotients[..., 1:], quotients[..., -1:],
                      negative.unsqueeze(-1).to(torch.int32)], dim=-1)
    return bits.flatten(-2)


@dataclass
class BatchInputs:
    """One graph run's inputs (INPUT_NAMES but the pool) and where its outputs go."""

    input_ids: torch.Tensor
    generation_lengths: torch.Tensor
    position_offsets: torch.Tensor
    packed_mask: torch.Tensor
    past_lengths: torch.Tensor
    window_offsets: torch.Tensor
    slot_ids: torch.Tensor
    cache_columns: torch.Tensor
    rows: list[tuple[int, int]]  # per segment: its packed rows [start, end) of logits / new K/V
    kv_writes: list[tuple[int, int, int]]  # per segment: (slot, first cache slot, end) its new K/V go to

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.input_ids, self.generation_lengths, self.position_offsets, self.packed_mask, self.past_lengths,
                self.window_offsets, self.slot_ids, self.cache_columns)


def batch_inputs(segments: list[tuple], columns: int | None = None, max_rows: int | None = None) -> BatchInputs:
    """Pad a list of (tokens [T], positions [T], tree_mask [T, W], cache) segments into one run's inputs.

    All caches must be slots of one pool (the graph reads one pool) and distinct (a request appears once per run).
    `columns`: the attention span S (TensorRT binds the whole capacity so only B, T and N vary); default the
    smallest that covers every request's prefix and window (the new tokens included: they sit at their slots).
    """
    if not segments:
        raise ValueError("a batched forward needs at least one segment")
    pool = segments[0][3].pool_k
    slots = [seg[3].slot for seg in segments]
    if any(seg[3].pool_k is not pool for seg in segments):
        raise ValueError("segments of one batched forward must use caches of one pool (engine.new_caches)")
    if len(set(slots)) != len(slots):
        raise ValueError(f"a cache appears twice in one batched forward (slots {slots})")
    lengths, rows, writes = [], [], []
    start = 0
    for tokens, positions, tree_mask, cache in segments:
        t = tree_mask.shape[0]
        if t < 1 or tokens.shape[0] != t or positions.shape[0] != t:
            raise ValueError(f"a segment needs T >= 1 tokens, positions and tree-mask rows alike, got "
                             f"{tokens.shape[0]}, {positions.shape[0]}, {t}")
        first, end = cache.new_slots(tokens, tree_mask, max_rows)
        lengths.append(t)
        rows.append((start, start + t))
        writes.append((cache.slot, first, end))
        start += t
    # T >= 2: ONNX Runtime's batched GEMM takes another path for one row than for several (measured: a 1-row
    # attention product differs in the last bits from the same row among 2..16), so one padding row keeps every
    # request's attention on the row-invariant path and its logits the same alone, batched or verified in a tree
    b, t_max = len(segments), max(max(lengths), 2)
    words = mask_words(max(seg[2].shape[1] for seg in segments))
    offsets = torch.zeros(b, t_max, dtype=torch.int32)
    packed = torch.zeros(b, t_max, words, dtype=torch.int32)
    past = torch.tensor([seg[3].length for seg in segments], dtype=torch.int32)
    widths = torch.tensor([seg[2].shape[1] for seg in segments], dtype=torch.int32)
    window = widths - torch.tensor(lengths, dtype=torch.int32)
    for i, (_, positions, tree_mask, cache) in enumerate(segments):
        t = tree_mask.shape[0]
        offsets[i, :t] = positions - cache.length
        packed[i, :t] = pack_mask(tree_mask, words)
    span = int((past + widths).max())
    if columns is None:
        columns = max(span, 1)
    elif columns < span:
        raise ValueError(f"an attention span of {columns} columns cannot hold a prefix + window of {span}")
    return BatchInputs(
        input_ids=torch.cat([seg[0].reshape(-1) for seg in segments]).to(torch.int32),
        generation_lengths=torch.tensor(lengths, dtype=torch.int32),
        position_offsets=offsets, packed_mask=packed, past_lengths=past, window_offsets=window,
        slot_ids=torch.tensor(slots, dtype=torch.int32),
        cache_columns=torch.arange(columns, dtype=torch.int32), rows=rows, kv_writes=writes)

