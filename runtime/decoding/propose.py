"""Proposers: where each step's candidate tokens come from, for a whole batch of requests at once.

Every decoding request gets a `Candidates` record per step: a token trie rooted at its last accepted token, with a
score per node (the estimated probability that the target accepts the path to it). Proposers add to it:

- `SuffixProposer`: free candidates (no forward pass) from a per-request suffix index over prompt + output
  (prompt lookup / SuffixDecoding), merged into the trie as point-mass candidates.
- `DraftProposer`: a draft model. A request with a static SpecInfer tree gets that shape filled with the draft's
  children (top-k, or drawn without replacement from its q under sampling); a request with dynamic trees gets
  EAGLE-2 expansion of its best nodes, level by level, while another level is expected to pay for itself. Every
  request's level runs in ONE draft `forward_many`, and the expansion decisions weigh the whole batch's expected
  tokens against the batched verify (`policy.allocate`).

- `Eagle3Proposer`: an EAGLE-3 feature head (engines/eagle3.py), the same trees and expansion; it reads the target's
  features of every committed token, which the decoder hands it from the verify forward (`feature_layers`, `take`).

A proposer keeps its own per-slot state (`start` when a request takes a slot, `accept` after verification). The
decode loop (runtime/decoding/decoder.py) owns the order: suffix first (free), then the draft, then the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
import torch
from spectrt.runtime.decoding.policy import Policy, allocate, allocation_gain
from spectrt.runtime.decoding.sampling import draw_children, host_kernels, sampling_probs, top_tokens
from spectrt.runtime.decoding.suffix import SuffixIndex, new_index
from spectrt.runtime.decoding.tree import TokenTrie, Tree
from spectrt.runtime.engines.engine import Engine, HeadSegment, Segment, SegmentBuffers

if TYPE_CHECKING:  # the loop's request record; the loop imports this module
    from spectrt.runtime.decoding.decoder import Job


@dataclass(eq=False)  # identity: compared and looked up as objects
class Candidates:
    """One decoding request's candidates this step.

    `static`: this step's static tree shape (trie node i = tree node i), or None for a dynamic tree under
    `policy`; `q[node]`: the draft distribution the node's sampled children were drawn from; `keys[node]`: which
    proposer proposed it and how (`spectrt tune` measures acceptance from them).
    """

    job: Job
    trie: TokenTrie
    position: int  # RoPE position of the root (its prefix length): a node sits at position + depth
    static: Tree | None = None
    policy: Policy | None = None
    budget: int = 1  # most nodes this request may verify (root included)
    chosen: int = 1  # nodes the budget rule chose to verify (dynamic trees)
    drafted: bool = False  # a dynamic tree the draft expands this step (set by the proposer)
    expected: float = 0.0  # expected accepted tokens of the chosen nodes (their scores' sum)
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, list] = field(default_factory=dict)
    suffixed: set[int] = field(default_factory=set)  # nodes the suffix index proposed (the others: the draft's)

    @property
    def scores(self) -> list[float]:
        """Non-root node scores, best first (what the budget rule ranks)."""
        return self.trie.sorted_scores()

    def scaled_scores(self) -> list[float]:
        """`scores` times the job's score scale (`Job.score_scale`, read once): what the budget, the gate and the
        draft's level decision weigh."""
        return self.trie.sorted_scores(self.job.score_scale)


class SuffixProposer:
    """Per-slot suffix index over each request's prompt and accepted tokens; proposals cost no forward."""

    def __init__(self, slots: int):
        self.index: list[SuffixIndex | None] = [None] * slots
        self.native = host_kernels()  # its native index where the module builds here (`suffix.new_index`)

    def start(self, slot: int, ids: list[int]) -> None:
        self.index[slot] = new_index(ids, self.native)

    def stop(self, slot: int) -> None:
        self.index[slot] = None

    def accept(self, slot: int, tokens: list[int]) -> None:
        if self.index[slot] is not None:
            self.index[slot].extend(tokens)

    def propose(self, cand: Candidates, policy: Policy, room: int) -> None:
        """Merge the index's continuations into the trie as point masses, at most `room` tokens in all."""
        index = self.index[cand.job.slot]
        if index is None:
            return
        for tokens, match, share in index.propose(policy.suffix_depth):
            tokens = tokens[:room]
            if not tokens:
                break
            room -= len(tokens)
            scores = policy.calibration.suffix_path(match, share)
            nodes = cand.trie.add_path(tokens, scores[:len(tokens)])
            cand.suffixed.update(nodes)
            for k, node in enumerate(nodes):
                cand.keys.setdefault(node, []).append(("suffix", (match, k)))


@dataclass(eq=False)  # identity: compared and looked up as objects
class _Drafting:
    """One request's draft state during a step: the nodes fed to the draft so far (window order) and the level."""

    cand: Candidates
    logits: torch.Tensor | None = None  # draft logits of the frontier's rows
    frontier: list[int] = field(default_factory=lambda: [0])
    fed: list[int] = field(default_factory=list)
    top1: float = 0.0  # mean top-1 draft probability of the last level (how much the next level may add)


class DraftProposer:
    """A draft model over per-slot static KV caches: static trees and EAGLE-2 dynamic expansion, batched.

    The draft cache of a slot holds the request's accepted tokens (it catches up lazily, in the first draft pass of
    a step that drafts) and, during a step, the fed tree nodes in its uncommitted window; `accept` keeps the
    accepted fed nodes (`compact`). A node's draft slot is `trie.draft_slot[node]`.
    """

    feature_layers: tuple[int, ...] | None = None  # target features this proposer reads (Eagle3Proposer)
    vocab_ids: list[int] | None = None  # target id of each draft logit column (None: the full vocabulary)

    def __init__(self, engine: Engine, slots: int, capacity: int, window: int):
        self.engine, self.window = engine, window
        self.forward_seconds = 0.0  # wall time of this proposer's engine calls (the decoder's `StepClock`)
        self.caches = engine.new_caches(slots, capacity, window)
        self.buffers = SegmentBuffers(slots, window)  # every draft segment's tokens and positions

    def reuse(self, src: int, dst: int, length: int, bounded: bool = False) -> int:
        """Start slot `dst`'s draft from the rows slot `src` holds of the first `length` tokens of its sequence (the
        prefix cache: `dst` may be `src`, length 0 starts empty); returns how many target tokens may be reused: all
        of them (the draft catches up on the rest, a window a step), or with `bounded` only those the draft holds (a
        request whose steps must not depend on the cache: a catching-up draft decodes plain steps). Why reuse rather
        than re-read: the draft would read the whole history again (a window per step, ~1/4 of the target's cost per
        token for the 4-layer slice) before it can draft the new turn."""
        cache, keep = self.caches[dst], min(self.caches[src].length, length)
        if keep and src != dst:
            cache.copy_prefix(self.caches[src], keep)
        cache.length = keep
        return keep if bounded else length

    def lag(self, slot: int, ids: list[int]) -> int:
        """Tokens of `ids` the slot's draft cache has not read yet."""
        return len(ids) - self.caches[slot].length

    def chunk(self, slot: int, ids: list[int], end: int) -> Segment | None:
        """The causal segment that feeds ids[cache.length:end] (at most a window), or None if nothing to feed."""
        cache = self.caches[slot]
        n = cache.length
        t = min(end - n, self.window)
        if t <= 0:
            return None
        return Segment(*self.buffers.rows(slot, ids[n:n + t], n), self.buffers.causal[t], cache)

    def accept(self, slot: int, trie: TokenTrie, order: list[int], path: list[int]) -> None:
        """Keep the accepted nodes the draft has read (a prefix of the accepted path) as committed tokens."""
        self.caches[slot].compact(trie.read_slots([order[i] for i in path[1:]]))

    # ------------------------------------------------------------------------------------------- one step
    def propose(self, cands: list[Candidates], prefill: list[Segment], verify: Callable[[int], float],
                cost: Callable[[int, int], float], base_rows: int, plain: int = 0) -> float:
        """Fill every candidate record that drafts this step; returns the draft milliseconds spent (cost units).

        `prefill`: draft segments that feed prompt chunks of requests still prefilling (they share the first draft
        forward). `verify(rows)` is the step's batched target cost, `base_rows` the target rows paid anyway this step,
        `plain` the requests that decode plainly in it (`allocate`); `cost(rows, segments)` a draft forward's.
        """
        drafting, segments = [], list(prefill)
        for cand in cands:
            job = cand.job
            seg = self.chunk(job.slot, job.ids, len(job.ids))
            # .shape[0], not len(), on tensors in the step: Tensor.__len__ is a Python call (py-spy, batch 1: 5% of
            # a step's host work went to it)
            if seg is None or seg.tokens.shape[0] < self.lag(job.slot, job.ids):
                if seg is not None:  # more than a window behind: catch up now, draft from the next step
                    segments.append(seg)
                continue
            segments.append(seg)
            drafting.append(_Drafting(cand))
            cand.drafted = cand.static is None
        if not segments:
            return 0.0
        rows, prefill_rows = sum(s.tokens.shape[0] for s in segments), sum(s.tokens.shape[0] for s in prefill)
        sunk = cost(rows, len(segments)) - (cost(prefill_rows, len(prefill)) if prefill else 0.0)  # prompts: paid
        # logits of a drafting catch-up's last row only (its children's parent); none for prompt chunks or backlogs
        drafts_from = {id(self.caches[d.cand.job.slot]) for d in drafting}
        logits = self._run(segments, [1 if id(seg.cache) in drafts_from else 0 for seg in segments])
        for seg in segments:
            seg.cache.commit(seg.tokens.shape[0])
        by_cache = {id(seg.cache): lg for seg, lg in zip(segments, logits, strict=True)}
        for d in drafting:
            d.logits = by_cache[id(self.caches[d.cand.job.slot])]
            d.cand.job.stats.draft_passes += 1
        depth = 1
        while drafting:
            grow = [d for d in drafting if d.cand.static is None]
            self._children(drafting, depth)
            nxt = {id(d): self._next_static(d, depth) if d.cand.static is not None else [] for d in drafting}
            static_rows = sum(len(v) for v in nxt.values())
            if grow:
                static = sum(1 for v in nxt.values() if v)  # requests with a static level (their rows are fed anyway)
                self._next_dynamic(grow, depth, nxt, (static_rows, static), sunk, verify, cost, base_rows, plain)
            level = [d for d in drafting if nxt[id(d)]]
            if not level:
                break
            segments = [self._feed(d, nxt[id(d)]) for d in level]
            sunk += cost(sum(s.tokens.shape[0] for s in segments), len(segments))
            for d, lg in zip(level, self._run(segments), strict=True):
                d.logits = lg
                d.frontier = nxt[id(d)]
                d.cand.job.stats.draft_passes += 1
            drafting, depth = level, depth + 1
        return sunk

    def _run(self, segments: list[Segment], logit_rows: list[int | None] | None = None) -> list[torch.Tensor]:
        """One draft forward over the segments: logits per segment (its last `logit_rows[i]` rows: `forward_many`)."""
        return self._forward(segments, logit_rows)

    def _forward(self, segments: list[Segment], logit_rows: list[int | None] | None = None) -> list:
        start = time.perf_counter()
        try:
            # by name: a head's second parameter is `full_vocab`, where a full-vocabulary head (no draft subset) got
            # the rows asked for, and then drafted from a catch-up's first row, not its last
            if self.vocab_ids is not None:
                return self.engine.forward_many(segments, full_vocab=False, logit_rows=logit_rows)
            return self.engine.forward_many(segments, logit_rows=logit_rows)
        finally:
            self.forward_seconds += time.perf_counter() - start

    def _children(self, drafting: list[_Drafting], depth: int) -> None:
        """Add this level's children under each request's frontier (one softmax/top-k for the batch where possible)."""
        for d in drafting:
            cand, job = d.cand, d.cand.job
            params = job.params
            if cand.static is not None:
                tree = cand.static
                if depth > tree.max_depth:
                    continue
                parent_row, rank, k = tree.level_children[depth - 1]
                level, parents = tree.levels[depth], tree.levels[depth - 1]
                sampled = not params.greedy and job.children == "sample"
                if sampled:
                    q = sampling_probs(self._full_rows(d.logits), params)
                    for row, node in enumerate(parents):
                        cand.q[node] = q[row]
                    top = draw_children(q, k, job.draft_gen)
                else:
                    top = torch.tensor(self._top(d.logits, k)[0])
                tokens = top[parent_row, rank].tolist()
                for node, tok in zip(level, tokens, strict=True):
                    got = cand.trie.add(tree.parents[node], tok, 1.0, sampled=sampled)
                    assert got == node, "a static tree fills trie nodes in its own order"
                continue
            policy = cand.policy
            cal = policy.calibration
            if params.greedy:
                toks, probs = self._top(d.logits, policy.width)
            else:
                top = sampling_probs(self._full_rows(d.logits), params).topk(policy.width, dim=-1)
                probs, toks = top.values.tolist(), top.indices.tolist()
            d.top1 = sum(p[0] for p in probs) / len(probs)
            nodes = cand.trie.expand(d.frontier, toks, probs, cal.draft_edge)
            width = len(toks[0])
            for j, node in enumerate(nodes):
                prob = probs[j // width][j % width]
                cand.keys.setdefault(node, []).append(("draft", (depth, j % width, prob)))

    def _top(self, logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """`top_tokens` of draft logits, as target ids (a draft vocabulary is sorted: ties still go to the lower id)."""
        toks, probs = top_tokens(logits, k)
        if self.vocab_ids is not None:
            ids = self.vocab_ids
            toks = [[ids[t] for t in row] for row in toks]
        return toks, probs

    def _full_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits as full-vocabulary rows (sampling compares the draft's q with the target's p)."""
        return logits if self.vocab_ids is None else self.engine.full_rows(logits)

    @staticmethod
    def _next_static(d: _Drafting, depth: int) -> list[int]:
        """A static tree's next level to feed: every node of this level unless it is the last one."""
        tree = d.cand.static
        return list(tree.levels[depth]) if depth < tree.max_depth else []

    def _next_dynamic(self, grow: list[_Drafting], depth: int, nxt: dict, static: tuple[int, int], sunk: float,
                      verify: Callable[[int], float], cost: Callable[[int, int], float], base_rows: int,
                      plain: int) -> None:
        """EAGLE-2's next level for the dynamic requests, if the whole batch expects it to pay (sets `nxt`).

        Each request would read its `width` best unread nodes of this depth whose parent the draft has read; the
        next level is expected to add about what this one added per unit of parent score. The level runs when the
        batch's expected tokens per ms with it (the extra draft rows and the larger verify) beat the current best
        allocation; a request at its policy's depth stops.
        """
        cands = [d.cand for d in grow]
        if all(depth >= c.policy.depth for c in cands):  # the last level: no allocation to weigh (~40 us, cold)
            return
        budgets = [min(c.policy.budget, c.budget) for c in cands]
        scores = [c.scaled_scores() for c in cands]  # as the budget weighs them
        sizes, rate = allocate(scores, budgets, sunk, verify, base_rows, plain)
        gain = allocation_gain(scores, sizes, plain)
        want, added, rows = {}, 0.0, 0
        for d, c, b, cap in zip(grow, cands, sizes, budgets, strict=True):
            if depth >= c.policy.depth:
                continue
            picks, picked = c.trie.picks(depth, c.policy.width)
            if not picks or len(d.fed) + len(picks) > self.window:
                continue
            added += picked * c.policy.calibration.draft_edge(d.top1) * c.job.score_scale
            want[id(d)] = picks
            rows += min(b + len(picks), cap) - b
        if not want:
            return
        (static_rows, static_segments), dynamic_rows = static, sum(len(v) for v in want.values())
        extra = cost(static_rows + dynamic_rows, static_segments + len(want)) - \
            (cost(static_rows, static_segments) if static_rows else 0.0)
        total = base_rows + sum(sizes) + plain + rows
        if (gain + added) / (sunk + extra + verify(total)) > rate:
            nxt.update(want)

    def _feed(self, d: _Drafting, nodes: list[int]) -> Segment:
        """The draft segment of one request's next level: each node sees its fed ancestors and itself."""
        fed = len(d.fed)
        rows, cols, tokens, depth = d.cand.trie.feed(nodes, fed)
        mask = level_mask(len(nodes), fed + len(nodes), rows, cols)
        d.fed.extend(nodes)
        tokens, positions = self.buffers.rows(d.cand.job.slot, tokens, d.cand.position + depth,
                                              self.buffers.zeros[:len(nodes)])
        return Segment(tokens, positions, mask, self.caches[d.cand.job.slot])


class Eagle3Proposer(DraftProposer):
    """An EAGLE-3 head as the draft: a head row at position p reads token p and the target's features of p - 1
    (`project`ed), a drafted node reads its parent row's output hidden instead (what the head was trained on).

    So the head's committed rows lag the target by one position: slot j of its cache is the row at position j + 1,
    and after each verify the decoder hands over the accepted rows' target features (`take`). Drafted rows are
    dropped at `accept` (they read the head's own hidden, not the target's); the next step's first pass re-reads the
    accepted tokens and the bonus token with their true features (the catch-up) and drafts from the last row.
    """

    def __init__(self, head, slots: int, capacity: int, window: int, target: Engine):
        if not hasattr(target, "forward_features"):
            raise ValueError(f"an EAGLE-3 head needs the target's features: {type(target).__name__} does not return "
                             "them (use the torch or native target engine)")
        super().__init__(head, slots, capacity, window)
        self.feature_layers = tuple(head.feature_layers)
        # the head's logits over its draft vocabulary only (8,192 of 49,152 ids for the shipped head): no -inf fill
        # and a 6x narrower top-k per drafted row; full rows only where a sampled request needs the draft's q
        if len(head.head_ids) < head.config.model.vocab_size:
            self.vocab_ids = head.head_ids.tolist()
        self.base = [0] * slots  # position of the first pending feature row
        self.count = [0] * slots  # pending feature rows: `pending` and then `arrived`, in position order
        self.no_rows = torch.empty(0, head.feature_width)
        self.pending = [self.no_rows for _ in range(slots)]
        # rows taken since the head last read: joined only when it reads (`_pending`). Why: concatenating at every
        # take copied a request's whole backlog each step while its draft was off (0.36 ms a step at batch 8 after
        # 64 tokens, bf16; quadratic in a long answer's length)
        self.arrived: list[list[torch.Tensor]] = [[] for _ in range(slots)]
        # id(cache) -> trie node -> its row's output hidden: (the pass's output [T, H], the node's row in it)
        self.node_hidden: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}
        self.fed_nodes: dict[int, list[int]] = {}  # id(cache) -> the nodes of the segment fed now

    def reuse(self, src: int, dst: int, length: int, bounded: bool = False) -> int:
        """The head's rows of the prefix (row j reads token j + 1: at most length - 1 rows) and the pending target
        features of the prefix; the target reuses only tokens whose features the head still has or holds rows for,
        because a reused target row is never recomputed and so never yields its features again (so always
        `bounded`)."""
        rows = max(min(self.caches[src].length, length - 1), 0)
        base, pending = self.base[src], self._pending(src)
        if rows >= base:  # features of [base, base + len(pending)) are still to be read: keep those of the prefix
            length = min(length, base + len(pending))
            pending = pending[:length - base]
        else:  # the features after `rows` were read and dropped: the target recomputes from there
            base, length, pending = rows, rows, pending[:0]
        super().reuse(src, dst, rows)
        self.base[dst], self.pending[dst], self.arrived[dst], self.count[dst] = base, pending, [], len(pending)
        return length

    def _pending(self, slot: int) -> torch.Tensor:
        """The slot's pending feature rows as one tensor (joining what arrived since the last read)."""
        arrived = self.arrived[slot]
        if arrived:  # the steady state, one step's rows and nothing pending: taken as they are, no copy
            alone = len(arrived) == 1 and not self.pending[slot].shape[0]
            self.pending[slot] = arrived[0] if alone else torch.cat([self.pending[slot], *arrived])
            self.arrived[slot] = []
        return self.pending[slot]

    def take(self, slot: int, position: int, features: torch.Tensor) -> None:
        """Target features of committed tokens at `position`, `position + 1`, ... (a re-fed position replaces the
        old rows: a step retried after a failure feeds its rows again)."""
        keep = position - self.base[slot]
        if not 0 <= keep <= self.count[slot]:
            raise RuntimeError(f"target features at position {position} do not follow the pending ones "
                               f"({self.base[slot]}..{self.base[slot] + self.count[slot]})")
        if keep < self.count[slot]:  # re-fed rows replace the old ones from there
            self.pending[slot] = self._pending(slot)[:keep]
        self.arrived[slot].append(features if features.dtype == torch.float32 else features.float())
        self.count[slot] = keep + features.shape[0]

    def lag(self, slot: int, ids: list[int]) -> int:
        return len(ids) - 1 - self.caches[slot].length

    def chunk(self, slot: int, ids: list[int], end: int) -> HeadSegment | None:
        """The causal head segment of rows at positions cache.length + 1 .. end - 1 whose features are known."""
        cache = self.caches[slot]
        n = cache.length
        read = min(n - self.base[slot], self.pending[slot].shape[0])
        if read > 0:  # drop the joined rows the head has read before joining what arrived: no copy of them. Why:
            # joining first copied them every step, ~40 us a step at batch 1 (bf16, the caches cold after a forward)
            left = self.pending[slot]
            self.pending[slot] = left[read:] if read < left.shape[0] else self.no_rows  # all read: no slicing op
            self.base[slot], self.count[slot] = self.base[slot] + read, self.count[slot] - read
        pending = self._pending(slot)
        if n > self.base[slot]:  # rows before the committed length are read: drop them
            self.pending[slot] = pending = pending[n - self.base[slot]:]
            self.base[slot], self.count[slot] = n, pending.shape[0]
        t = min(end - 1, self.base[slot] + pending.shape[0]) - n
        t = min(t, self.window)
        if t <= 0:
            return None
        self.fed_nodes.pop(id(cache), None)
        skip = n - self.base[slot]  # the head's forward projects the features (fc); all of them: no slicing op
        features = pending if skip == 0 and t == pending.shape[0] else pending[skip:skip + t]
        return HeadSegment(*self.buffers.rows(slot, ids[n + 1:n + 1 + t], n + 1), self.buffers.causal[t], cache,
                           features)

    def accept(self, slot: int, trie: TokenTrie, order: list[int], path: list[int]) -> None:
        """Nothing to keep: the drafted rows sit uncommitted after the committed ones, and the next pass's catch-up
        writes over them (a `compact([])` per request, a no-op, cost ~2 us each a step at batch 8)."""

    def _run(self, segments: list[HeadSegment], logit_rows: list[int | None] | None = None) -> list[torch.Tensor]:
        logits = []
        for seg, (lg, hidden) in zip(segments, self._forward(segments, logit_rows), strict=True):
            nodes = self.fed_nodes.pop(id(seg.cache), None)
            if nodes is None:  # a catch-up: its last row is the root's (the next token's position)
                self.node_hidden[id(seg.cache)] = {0: (hidden, hidden.shape[0] - 1)}
            else:
                rows = self.node_hidden[id(seg.cache)]
                for j, node in enumerate(nodes):
                    rows[node] = (hidden, j)
            logits.append(lg)
        return logits

    def _feed(self, d: _Drafting, nodes: list[int]) -> HeadSegment:
        tokens, positions, mask, cache = super()._feed(d, nodes)
        rows = self.node_hidden[id(cache)]
        self.fed_nodes[id(cache)] = nodes
        return HeadSegment(tokens, positions, mask, cache, gather_rows([rows[d.cand.trie.parents[i]] for i in nodes]))


@lru_cache(maxsize=4096)
def level_mask(nodes: int, window: int, rows: tuple[int, ...], cols: tuple[int, ...]) -> torch.Tensor:
    """Bool [nodes, window], True at (rows[i], cols[i]): a draft level's mask, made once per pattern (read only, by
    the forwards). Why: a level's mask is one of few patterns, and making it each time (numpy's zeros, indexed write
    and from_numpy) cost ~20 us a level on the caches a draft pass had flushed (line_profiler, batch 1)."""
    mask = np.zeros((nodes, window), dtype=bool)
    mask[list(rows), list(cols)] = True
    return torch.from_numpy(mask)


def gather_rows(rows: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The given (tensor, row index) rows stacked [n, H]: one numpy gather where all are rows of one fp32 tensor (a
    level's parents are the previous pass's output), else a torch stack. Why: indexing each row and stacking them
    dispatched n + 1 torch ops a draft level on the caches the target forward had just flushed."""
    source = rows[0][0]
    if source.dtype == torch.float32 and not source.requires_grad and all(t is source for t, _ in rows):
        index = [j for _, j in rows]
        first = index[0]
        if index == list(range(first, first + len(index))):  # consecutive rows (a level's parents in feed order):
            return source[first:first + len(index)]  # a view, no copy: 12 against 24 us on cold caches
        return torch.from_numpy(source.numpy()[index])
    return torch.stack([t[j] for t, j in rows])
