"""In-flight batching of token trees: many requests share each draft level and ONE target forward per step.

Each active request owns a slot (a target KV cache and a draft KV cache, allocated once at construction).
A step: prompts still being prefilled contribute a causal chunk (bounded per step, so a long prompt never
stalls the others); decoding requests draft their trees level by level, all requests' levels in one draft
forward; then one target forward verifies the whole forest (each segment attends only to its own cache)
and every request accepts, compacts its caches and emits its tokens. Requests join and leave between steps.

The speculation budget bounds the tree tokens of a step: when the requested trees do not fit, each tree is
cut to its first `budget // n` nodes in "top-1 first" order (path rank sum, then depth), so a cut tree stays
connected, keeps a prefix of every node's children in rank order (exact for sampled children too) and, at
one node, is plain batched decoding. Greedy outputs equal each request's sequential run (same arithmetic
up to GEMM shapes, so compare in fp32).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import torch
from spectrt.runtime.decoder import CHILD_MODES, GREEDY, DecodeStats
from spectrt.runtime.engine import Engine, Segment
from spectrt.runtime.sampling import SamplingParams, draw_children, sampling_probs, verify_sampled
from spectrt.runtime.tree import Tree, greedy_accept

ROOT_ONLY = Tree((-1,))


@lru_cache(maxsize=256)
def cut_tree(tree: Tree, nodes: int) -> Tree:
    """The first `nodes` nodes of `tree` in top-1-first order (path rank sum, depth, index), as a Tree.

    That order puts every parent and every earlier sibling before a node, so the cut is connected and
    each node keeps a rank-order prefix of its children (what drafting and verification assume).
    """
    if nodes >= len(tree):
        return tree
    rank_sum = [0] * len(tree)
    for i, p in enumerate(tree.parents[1:], start=1):
        rank_sum[i] = rank_sum[p] + tree.ranks[i]
    keep = sorted(sorted(range(len(tree)), key=lambda i: (rank_sum[i], tree.depths[i], i))[:max(nodes, 1)])
    index = {old: new for new, old in enumerate(keep)}
    return Tree(tuple(-1 if tree.parents[i] < 0 else index[tree.parents[i]] for i in keep))


def budget_from_profile(path: Path, slowdown: float = 2.0) -> int | None:
    """Largest verify size T whose measured target cost stays within `slowdown` x a one-token step.

    Reads `spectrt profile`'s {"target": {"<past>": {"<T>": ms}}} (the smallest past measured); None if absent.
    """
    if not path.is_file():
        return None
    target = json.loads(path.read_text(encoding="utf-8")).get("target") or {}
    if not target:
        return None
    costs = {int(t): float(ms) for t, ms in target[min(target, key=int)].items()}
    if 1 not in costs:
        return None
    fits = [t for t, ms in costs.items() if ms <= slowdown * costs[1]]
    return max(fits) if fits else 1


@dataclass
class Job:
    """One request in the batch: its inputs, callbacks and decode state."""

    prompt_ids: list[int]
    max_new_tokens: int
    tree: Tree | None = None
    params: SamplingParams = GREEDY
    children: str = "sample"
    eos_ids: set[int] | None = None  # None: the decoder's
    min_length: int = 0  # end-of-sequence is masked out of the target distribution before this many tokens
    stop_words: list[list[int]] = field(default_factory=list)  # stop after emitting any of these sequences
    bad_words: list[list[int]] = field(default_factory=list)  # never emitted (masked in the target distribution)
    on_tokens: Callable[[list[int]], None] | None = None
    tag: object = None  # the caller's handle (the Triton model: its request and row)
    # decode state
    out: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop", "length", "cancelled" or "error"
    stats: DecodeStats = field(default_factory=DecodeStats)
    proposed: int = 0  # draft nodes sent to verification
    slot: int = -1
    ids: list[int] = field(default_factory=list)
    draft_gen: torch.Generator | None = None
    verify_gen: torch.Generator | None = None
    started: float = 0.0


@dataclass
class StepInfo:
    active: int = 0
    prefill_tokens: int = 0
    tree_tokens: int = 0  # target rows spent on decoding trees (roots included)
    emitted: int = 0
    finished: list[Job] = field(default_factory=list)


class BatchDecoder:
    """Up to `max_active` requests decoded together; `add` between `step`s, `cancel` any time between steps."""

    def __init__(self, target: Engine, draft: Engine | None, eos_ids: set[int], max_seq_len: int = 2048,
                 max_tree_tokens: int = 64, max_active: int = 8, tree_budget: int | None = None,
                 prefill_budget: int | None = None):
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError("the draft's vocabulary differs from the target's: use a draft made from this target")
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        self.target, self.draft, self.eos_ids = target, draft, eos_ids
        self.max_seq_len, self.max_tree_tokens, self.max_active = max_seq_len, max_tree_tokens, max_active
        self.tree_budget = tree_budget or max_active * max_tree_tokens
        self.prefill_budget = prefill_budget or max_tree_tokens
        capacity = max_seq_len + max_tree_tokens
        self.target_caches = target.new_caches(max_active, capacity, max_tree_tokens)
        self.draft_caches = draft.new_caches(max_active, capacity, max_tree_tokens) if draft is not None \
            else [None] * max_active
        self.causal = torch.ones(max_tree_tokens, max_tree_tokens, dtype=torch.bool).tril()
        self.free = list(range(max_active))[::-1]
        self.active: list[Job] = []

    # ------------------------------------------------------------------------------------- membership
    def check(self, job: Job) -> None:
        """The decoder's input checks (ValueError naming the fix), before a job takes a slot."""
        if job.children not in CHILD_MODES:
            raise ValueError(f"children must be one of {CHILD_MODES}, got {job.children!r}")
        if not job.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if job.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {job.max_new_tokens}")
        if len(job.prompt_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(job.prompt_ids)} tokens but max_seq_len is {self.max_seq_len}: "
                             "shorten the prompt or raise max_seq_len")
        if job.tree is not None and len(job.tree) > self.max_tree_tokens:
            raise ValueError(f"the tree has {len(job.tree)} nodes, more than max_tree_tokens={self.max_tree_tokens}")

    def add(self, job: Job) -> None:
        """Give the job a slot (call only while `len(self.free)`); its prefill starts with the next step."""
        self.check(job)
        if not self.free:
            raise RuntimeError("no free slot: wait for a request to finish")
        job.slot = self.free.pop()
        job.tree = job.tree if job.tree is not None and self.draft is not None else ROOT_ONLY
        job.ids = list(job.prompt_ids)
        job.stats = DecodeStats(prompt_tokens=len(job.prompt_ids))
        seed = job.params.seed if job.params.seed is not None else random.SystemRandom().randrange(2**62)
        job.draft_gen = torch.Generator().manual_seed(2 * seed)  # independent drafting / verifying streams
        job.verify_gen = torch.Generator().manual_seed(2 * seed + 1)
        job.started = time.perf_counter()
        self.target_caches[job.slot].reset()
        if self.draft_caches[job.slot] is not None:
            self.draft_caches[job.slot].reset()
        self.active.append(job)

    def _release(self, job: Job, finish: str) -> None:
        job.finish = job.finish or finish
        job.stats.new_tokens = len(job.out)
        job.stats.seconds = time.perf_counter() - job.started
        if job in self.active:
            self.active.remove(job)
            self.free.append(job.slot)

    def cancel(self, job: Job) -> None:
        """Drop a job now (between steps): its slot is free for the next `add`."""
        self._release(job, "cancelled")

    def run(self, jobs: list[Job]) -> list[Job]:
        """Decode all jobs, admitting them in order as slots free up (in-process use and tests)."""
        waiting = list(jobs)
        while waiting or self.active:
            while waiting and self.free:
                self.add(waiting.pop(0))
            self.step()
        return jobs

    # ------------------------------------------------------------------------------------- one step
    def _prefilling(self, job: Job) -> bool:
        return self.target_caches[job.slot].length < len(job.ids) - 1

    def step(self) -> StepInfo:
        """One batched step over all active jobs; returns what it did (for metrics and schedulers)."""
        info = StepInfo(active=len(self.active))
        prefill, decode = [], []
        for job in self.active:
            (prefill if self._prefilling(job) else decode).append(job)
        trees = self._trees(decode)
        target_segments: list[Segment] = []
        budget = self.prefill_budget
        chunks = []
        for job in prefill:  # admission order: the oldest prompt advances first
            if budget <= 0:
                break
            cache = self.target_caches[job.slot]
            n = cache.length
            chunk = job.ids[n:min(len(job.ids) - 1, n + min(budget, self.max_tree_tokens))]
            budget -= len(chunk)
            t = len(chunk)
            target_segments.append((torch.tensor(chunk), torch.arange(n, n + t), self.causal[:t, :t], cache))
            chunks.append((job, t))
            info.prefill_tokens += t
        drafted = self._draft(decode, trees)
        for job in decode:
            tree, tokens = trees[job.slot], drafted[job.slot][0]
            cache = self.target_caches[job.slot]
            target_segments.append((tokens, tree.positions(cache.length), tree.mask, cache))
            info.tree_tokens += len(tree)
        logits = self.target.forward_many(target_segments) if target_segments else []
        for job, t in chunks:
            self.target_caches[job.slot].commit(t)
        for job, job_logits in zip(decode, logits[len(chunks):], strict=True):
            info.emitted += self._accept(job, trees[job.slot], drafted[job.slot], job_logits, info)
        return info

    def _trees(self, decode: list[Job]) -> dict[int, Tree]:
        """This step's tree per decoding job: its own, or cut to fit the speculation budget."""
        total = sum(len(j.tree) for j in decode)
        share = max(1, self.tree_budget // max(len(decode), 1))
        trees = {}
        for job in decode:
            tree = job.tree if total <= self.tree_budget else cut_tree(job.tree, share)
            room = self.max_seq_len - len(job.ids)  # a tree deeper than the room left only wastes rows
            if tree.max_depth > room:
                tree = cut_tree(tree, sum(d <= room for d in tree.depths))
            trees[job.slot] = tree
        return trees

    def _draft(self, decode: list[Job], trees: dict[int, Tree]) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """Per job: its tree's node tokens and, for sampled children, the draft q rows; all jobs per level batched."""
        out: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        drafting = []
        segments: list[Segment] = []
        for job in decode:
            tokens = torch.zeros(len(trees[job.slot]), dtype=torch.long)
            tokens[0] = job.ids[-1]
            out[job.slot] = (tokens, None)
            if len(trees[job.slot]) == 1:
                continue
            cache = self.draft_caches[job.slot]
            n = cache.length
            chunk = job.ids[n:n + self.max_tree_tokens]
            t = len(chunk)
            segments.append((torch.tensor(chunk), torch.arange(n, n + t), self.causal[:t, :t], cache))
            if n + t < len(job.ids):  # a draft that fell behind (trees cut to a root) catches up before drafting
                trees[job.slot] = ROOT_ONLY
                out[job.slot] = (tokens[:1], None)
                drafting.append(None)
            else:
                drafting.append(job)
        if not segments:
            return out
        logits = self.draft.forward_many(segments)
        for job, seg in zip(drafting, segments, strict=True):
            seg[3].commit(seg[2].shape[0])
            if job is not None:
                job.stats.draft_passes += 1
        level_logits = {job.slot: lg[-1:] for job, lg in zip(drafting, logits, strict=True) if job is not None}
        drafting = [j for j in drafting if j is not None]
        depth = 1
        while drafting:
            segments, next_drafting = [], []
            for job in drafting:
                tree = trees[job.slot]
                tokens = out[job.slot][0]
                level, parents = tree.levels[depth], tree.levels[depth - 1]
                parent_row, rank, k = tree.level_children[depth - 1]
                lg = level_logits[job.slot]
                if job.params.greedy or job.children == "topk":
                    top = lg.topk(k, dim=-1).indices
                else:
                    q = sampling_probs(lg, job.params)
                    node_q = out[job.slot][1]
                    if node_q is None:
                        node_q = torch.zeros(len(tree), lg.shape[-1])
                        out[job.slot] = (tokens, node_q)
                    node_q[parents[0]:parents[-1] + 1] = q
                    top = draw_children(q, k, job.draft_gen)
                tokens[level[0]:level[-1] + 1] = top[parent_row, rank]
                if depth < tree.max_depth:
                    cache = self.draft_caches[job.slot]
                    segments.append((tokens[level[0]:level[-1] + 1], torch.full((len(level),), cache.length + depth),
                                     tree.mask[level[0]:level[-1] + 1, 1:level[-1] + 1], cache))
                    next_drafting.append(job)
            if segments:
                level = self.draft.forward_many(segments)
                level_logits = {j.slot: lg for j, lg in zip(next_drafting, level, strict=True)}
                for job in next_drafting:
                    job.stats.draft_passes += 1
            drafting, depth = next_drafting, depth + 1
        return out

    def _constrain(self, job: Job, tree: Tree, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        """The request's target distribution at every node: end-of-sequence masked before min_length, bad words
        masked where their prefix matches. Verification uses this same distribution, so it stays lossless."""
        if not job.bad_words and len(job.out) >= job.min_length:
            return logits
        logits = logits.clone()
        eos = list(job.eos_ids if job.eos_ids is not None else self.eos_ids)
        longest = max((len(w) for w in job.bad_words), default=1)
        for i in range(len(tree)):
            path, node = [], i
            while node > 0:
                path.append(tokens[node])
                node = tree.parents[node]
            if len(job.out) + len(path) < job.min_length:
                logits[i, eos] = float("-inf")
            context = job.ids[-longest:] + path[::-1]
            for word in job.bad_words:
                if len(word) == 1 or context[len(context) - len(word) + 1:] == word[:-1]:
                    logits[i, word[-1]] = float("-inf")
        return logits

    def _accept(self, job: Job, tree: Tree, drafted, logits: torch.Tensor, info: StepInfo) -> int:
        tokens, node_q = drafted
        token_list = tokens.tolist()
        logits = self._constrain(job, tree, token_list, logits)
        stats = job.stats
        stats.target_passes += 1
        job.proposed += len(tree) - 1
        if job.params.greedy:
            path, bonus = greedy_accept(tree, token_list, logits.argmax(-1).tolist())
        else:
            q = node_q if len(tree) > 1 and job.children == "sample" else None
            path, bonus = verify_sampled(tree, tokens, sampling_probs(logits, job.params), q, job.verify_gen)
        stats.accepted.append(len(path) - 1)
        self.target_caches[job.slot].compact(path)
        if len(tree) > 1:
            self.draft_caches[job.slot].compact([i - 1 for i in path[1:] if tree.depths[i] < tree.max_depth])
        limit = min(job.max_new_tokens, self.max_seq_len - len(job.prompt_ids))
        new = ([token_list[i] for i in path[1:]] + [bonus])[:limit - len(job.out)]
        eos = job.eos_ids if job.eos_ids is not None else self.eos_ids
        finish, emitted = None, len(new)  # emitted counts an end-of-sequence token too (a target pass made it)
        for j, tok in enumerate(new):
            if tok in eos:
                new, finish, emitted = new[:j], "stop", j + 1
                break
            if any(len(w) <= len(job.out) + j + 1 and (job.out + new[:j + 1])[-len(w):] == w for w in job.stop_words):
                new, finish, emitted = new[:j + 1], "stop", j + 1
                break
        stats.emitted_tokens += emitted
        job.out.extend(new)
        job.ids.extend(new)
        if finish is None and len(job.out) >= limit:
            finish = "length"
        if new and job.on_tokens is not None:
            try:
                job.on_tokens(new)
            except Exception:  # a callback that fails (client gone) ends only its own request
                finish = "cancelled"
        if finish is not None:
            self._release(job, finish)
            info.finished.append(job)
        return len(new)
