"""The speculative decode loop: build a token tree, verify it in one target pass, accept, compact.

Each step's tree comes from one place, `_build`: a per-request suffix index (free candidates) and the
draft model, merged into one `TokenTrie`. With a `Policy` the tree is dynamic (EAGLE-2): the draft
expands the best-scoring nodes level by level and the step verifies the B best nodes, B chosen from the
policy's cost curve so that a step with no candidate worth a verify is plain autoregressive decoding.
With an explicit static `Tree` (SpecInfer expansion vector) the draft fills that shape and suffix
candidates are merged in. Autoregressive decoding is the root-only tree, so the baseline runs on exactly
the engine, cache and kernels that speculation uses. Both caches are allocated once here.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from spectrt.runtime.engine import Engine
from spectrt.runtime.policy import Policy, best_size
from spectrt.runtime.sampling import SamplingParams, draw_children, sampling_probs, verify_sampled
from spectrt.runtime.suffix import SuffixIndex
from spectrt.runtime.tree import TokenTrie, Tree, greedy_accept

GREEDY = SamplingParams()
CHILD_MODES = ("sample", "topk")

ROOT_ONLY = Tree((-1,))


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    emitted_tokens: int = 0  # new tokens plus the end-of-sequence token, which a target pass also produced
    target_passes: int = 0
    draft_passes: int = 0
    prefill_seconds: float = 0.0
    seconds: float = 0.0  # prefill + decode
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per target pass
    verified: list[int] = field(default_factory=list)  # tree nodes verified per target pass (1 = plain AR step)
    trace: list[tuple] = field(default_factory=list)  # with SpecDecoder.record: (kind, key, parent ok, accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass (accepted draft tokens + the target's own token)."""
        return self.emitted_tokens / max(self.target_passes, 1)

    @property
    def decode_seconds(self) -> float:
        """Time after the prompt's prefill: what speedups compare (prefill is the same work with or without a tree)."""
        return max(self.seconds - self.prefill_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Decode tokens per second (prefill excluded)."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def acceptance_per_depth(self, depth: int) -> list[float]:
        """Fraction of target passes whose accepted path reached each depth 1..depth."""
        passes = max(len(self.accepted), 1)
        return [sum(a >= d for a in self.accepted) / passes for d in range(1, depth + 1)]

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "draft_passes": self.draft_passes,
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),  # decode only
            "tau": round(self.tau, 4),
            "mean_tree_nodes": round(sum(self.verified) / max(len(self.verified), 1), 3),
            "speculative_passes": sum(v > 1 for v in self.verified),
        }


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token) or "length" (max_new_tokens / max_seq_len)
    stats: DecodeStats


class SpecDecoder:
    """Tree speculative decoding (greedy or lossless sampling) over a target and an optional draft engine.

    With sampling, a node's children are either drawn without replacement from the draft's
    distribution ("sample", verified by recursive rejection sampling against that distribution) or
    are the draft's top-k ("topk", verified by the point-mass rule); both are exact.
    """

    def __init__(self, target: Engine, draft: Engine | None, eos_ids: set[int], max_seq_len: int = 2048,
                 max_tree_tokens: int = 64):
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}): use a draft made from this target"
            )
        self.target, self.draft = target, draft
        self.eos_ids = eos_ids
        self.max_seq_len = max_seq_len
        self.max_tree_tokens = max_tree_tokens
        capacity = max_seq_len + max_tree_tokens
        self.target_cache = target.new_cache(capacity, max_tree_tokens)
        self.draft_cache = draft.new_cache(capacity, max_tree_tokens) if draft is not None else None
        self.causal = torch.ones(max_tree_tokens, max_tree_tokens, dtype=torch.bool).tril()
        self.node_tokens = torch.zeros(max_tree_tokens, dtype=torch.long)
        self.node_q = torch.zeros(max_tree_tokens, target.config.vocab_size) if draft is not None else None
        self.record = False  # fill DecodeStats.trace (what `spectrt tune` measures acceptance from)

    def _catch_up(self, engine: Engine, cache, ids: list[int]) -> torch.Tensor:
        """Feed ids[cache.length:] causally in window-sized chunks; return the last token's logits."""
        logits = None
        while cache.length < len(ids):
            n = cache.length
            chunk = ids[n:n + self.max_tree_tokens]
            t = len(chunk)
            logits = engine.forward(torch.tensor(chunk), torch.arange(n, n + t), self.causal[:t, :t], cache)
            cache.commit(t)
        return logits[-1]

    def _draft_tree(self, tree: Tree, ids: list[int], n: int, stats: DecodeStats, params: SamplingParams,
                    children: str, generator: torch.Generator) -> None:
        """Fill node_tokens[1:] with the draft's children, one draft pass per tree level."""
        logits = self._catch_up(self.draft, self.draft_cache, ids)[None]
        stats.draft_passes += 1
        for depth in range(1, tree.max_depth + 1):
            level, parents = tree.levels[depth], tree.levels[depth - 1]
            first, last = level[0], level[-1]
            parent_row, rank, k = tree.level_children[depth - 1]
            if params.greedy or children == "topk":
                top = logits.topk(k, dim=-1).indices
            else:
                q = sampling_probs(logits, params)
                self.node_q[parents[0]:parents[-1] + 1] = q
                top = draw_children(q, k, generator)
            self.node_tokens[first:last + 1] = top[parent_row, rank]
            if depth < tree.max_depth:
                logits = self.draft.forward(
                    self.node_tokens[first:last + 1], torch.full((len(level),), n + depth),
                    tree.mask[first:last + 1, 1:last + 1], self.draft_cache,
                )
                stats.draft_passes += 1

    def _draft_dynamic(self, trie: TokenTrie, ids: list[int], n: int, policy: Policy, params: SamplingParams,
                       stats: DecodeStats, keys: dict) -> float:
        """EAGLE-2 expansion: each level, the draft reads the `width` best unread nodes whose parent it has
        read and adds their top-`width` children; it stops at `depth` or when another level is not expected
        to pay. Returns the draft time spent, in the policy's cost units."""
        cal, verify, dcost = policy.calibration, policy.verify_cost, policy.draft_cost
        budget = min(policy.budget, self.max_tree_tokens)
        sunk, frontier, fed = dcost(len(ids) - self.draft_cache.length), [0], []
        free = sorted(trie.scores[1:], reverse=True)
        b, rate = best_size(free, 0.0, verify, budget)
        if (1 + sum(free[:b - 1]) + cal.draft[-1]) / (sunk + verify(min(b + 1, budget))) <= rate:
            return 0.0  # even a sure-to-be-accepted draft token would not pay for the draft pass
        logits = self._catch_up(self.draft, self.draft_cache, ids)[None]
        stats.draft_passes += 1
        for depth in range(1, policy.depth + 1):
            q = logits.softmax(-1) if params.greedy else sampling_probs(logits, params)
            top = q.topk(policy.width, dim=-1)
            probs, toks = top.values.tolist(), top.indices.tolist()
            for row, parent in enumerate(frontier):
                for rank, (prob, tok) in enumerate(zip(probs[row], toks[row], strict=True)):
                    node = trie.add(parent, tok, trie.scores[parent] * cal.draft_edge(prob))
                    keys.setdefault(node, []).append(("draft", (depth, rank, prob)))
            if depth == policy.depth:
                break
            ranked = trie.best(len(trie))[1:]
            scores = [trie.scores[i] for i in ranked]
            b, rate = best_size(scores, sunk, verify, budget)
            nxt = [i for i in ranked if trie.depths[i] == depth
                   and (trie.parents[i] == 0 or trie.draft_slot[trie.parents[i]] >= 0)][:policy.width]
            # the next level is expected to add about what this one added per unit of parent score
            edge = cal.draft_edge(float(top.values[:, 0].mean()))
            gain = 1 + sum(scores[:b - 1]) + sum(trie.scores[i] for i in nxt) * edge
            if (not nxt or len(fed) + len(nxt) > self.max_tree_tokens
                    or gain / (sunk + dcost(len(nxt)) + verify(min(b + len(nxt), budget))) <= rate):
                break
            mask = torch.zeros(len(nxt), len(fed) + len(nxt), dtype=torch.bool)
            for row, node in enumerate(nxt):
                mask[row, len(fed) + row] = True
                anc = trie.parents[node]
                while anc > 0:
                    mask[row, trie.draft_slot[anc]] = True
                    anc = trie.parents[anc]
            for node in nxt:
                trie.draft_slot[node] = len(fed)
                fed.append(node)
            logits = self.draft.forward(torch.tensor([trie.tokens[i] for i in nxt]),
                                        torch.full((len(nxt),), n + depth), mask, self.draft_cache)
            stats.draft_passes += 1
            sunk += dcost(len(nxt))
            frontier = nxt
        return sunk

    def _add_suffix(self, trie: TokenTrie, index: SuffixIndex, policy: Policy, room: int, keys: dict) -> None:
        """Merge the suffix index's candidates (point masses) into the trie, at most `room` tokens in all."""
        for cand in index.propose(policy.suffix_depth):
            tokens = cand.tokens[:room]
            if not tokens:
                break
            room -= len(tokens)
            scores = policy.calibration.suffix_path(cand.match, cand.share)
            for k, node in enumerate(trie.add_path(tokens, scores[:len(tokens)])):
                keys.setdefault(node, []).append(("suffix", (cand.match, k)))

    def _build(self, ids: list[int], n: int, static: Tree | None, policy: Policy | None, index: SuffixIndex | None,
               use_draft: bool, params: SamplingParams, children: str, stats: DecodeStats,
               draft_gen: torch.Generator) -> tuple[TokenTrie, list[int], dict, torch.Tensor | None]:
        """This step's candidates, from every proposer, merged into one trie; which nodes to verify.

        Returns the trie, the nodes to verify (root first), each node's proposer keys (for tuning) and,
        for a static tree of sampled children, the draft distributions they were drawn from (trie order).
        """
        trie, keys = TokenTrie(ids[-1]), {}
        if static is None:  # dynamic: free candidates first, then the draft extends the best nodes
            # `budget` bounds the draft's tree; suffix candidates cost no forward and may add up to suffix_depth
            # nodes when their own scores pay for the larger verify (measured: a 4-node cap held the repetitive
            # set at 1.47x AR while suffix candidates alone reached 1.62x)
            room = max(policy.budget, 1 + policy.suffix_depth) if policy.suffix else policy.budget
            budget = min(room, self.max_tree_tokens)
            if index is not None:
                self._add_suffix(trie, index, policy, budget - 1, keys)
            sunk = self._draft_dynamic(trie, ids, n, policy, params, stats, keys) if use_draft else 0.0
            b, _ = best_size(sorted(trie.scores[1:], reverse=True), sunk, policy.verify_cost, budget)
            return trie, trie.best(b), keys, None
        static_q = None
        if len(static) > 1:  # the static shape first (trie node i = tree node i, sampled children in draw order)
            self.node_tokens[0] = ids[-1]
            self._draft_tree(static, ids, n, stats, params, children, draft_gen)
            sampled = not params.greedy and children == "sample"
            for i in range(1, len(static)):
                node = trie.add(static.parents[i], int(self.node_tokens[i]), 1.0, sampled=sampled)
                trie.draft_slot[node] = i - 1 if static.depths[i] < static.max_depth else -1
            static_q = self.node_q[:len(static)] if sampled else None
        if index is not None:  # all merged in: pruning by score would make the point set depend on the draws
            self._add_suffix(trie, index, policy, self.max_tree_tokens - len(static), keys)
        return trie, list(range(len(trie))), keys, static_q

    def generate(self, prompt_ids: list[int], max_new_tokens: int, tree: Tree | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, params: SamplingParams = GREEDY,
                 children: str = "sample", policy: Policy | None = None) -> DecodeResult:
        """Decode. `tree` (with a draft): that static shape, plus suffix candidates if `policy.suffix`;
        `policy` alone: dynamic trees from the suffix index and (if `policy.draft`) the draft;
        neither (or a draft-less decoder given only a tree): plain autoregressive decoding."""
        static = tree if (tree is not None and self.draft is not None) else None
        if static is None and policy is None:
            static = ROOT_ONLY
        use_draft = self.draft is not None and (static is not None and len(static) > 1
                                                or static is None and policy.draft and policy.depth > 0)
        if children not in CHILD_MODES:
            raise ValueError(f"children must be one of {CHILD_MODES}, got {children!r}")
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**62)
        # drafting and verification draw from independent streams (a shared stream would bias acceptance)
        draft_gen = torch.Generator().manual_seed(2 * seed)
        verify_gen = torch.Generator().manual_seed(2 * seed + 1)
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if len(prompt_ids) >= self.max_seq_len:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens but max_seq_len is {self.max_seq_len}: "
                "shorten the prompt or raise --max-seq-len"
            )
        if static is not None and len(static) > self.max_tree_tokens:
            raise ValueError(f"the tree has {len(static)} nodes, more than max_tree_tokens={self.max_tree_tokens}")

        stats = DecodeStats(prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        ids = list(prompt_ids)
        self.target_cache.reset()
        self._catch_up(self.target, self.target_cache, ids[:-1])
        if use_draft:
            self.draft_cache.reset()
            self._catch_up(self.draft, self.draft_cache, ids[:-1])
        index = SuffixIndex(ids) if policy is not None and policy.suffix else None
        stats.prefill_seconds = time.perf_counter() - start

        limit = min(max_new_tokens, self.max_seq_len - len(prompt_ids))
        out: list[int] = []
        finish = "length"
        while len(out) < limit:
            n = self.target_cache.length
            trie, nodes, keys, static_q = self._build(ids, n, static, policy, index, use_draft, params, children,
                                                      stats, draft_gen)
            step_tree, order = (ROOT_ONLY, [0]) if len(nodes) == 1 else trie.subtree(nodes)
            tokens = torch.tensor([trie.tokens[i] for i in order])
            logits = self.target.forward(tokens, step_tree.positions(n), step_tree.mask, self.target_cache)
            stats.target_passes += 1
            stats.verified.append(len(step_tree))
            if params.greedy:
                path, bonus = greedy_accept(step_tree, tokens.tolist(), logits.argmax(-1).tolist())
            else:
                q = point = sampled = None
                if static_q is not None:  # static tree rows first, in their own order (trie nodes 0..len-1)
                    # rows of nodes without sampled children are never read: any valid distribution will do
                    q = static_q[[i if i < len(static) and static.children[i] else 0 for i in order]]
                    point = [trie.point[i] for i in order]
                    sampled = [trie.sampled[i] for i in order]
                path, bonus = verify_sampled(step_tree, tokens, sampling_probs(logits, params), q, verify_gen,
                                             point, sampled)
            stats.accepted.append(len(path) - 1)
            if self.record:
                self._trace(stats, step_tree, order, path, keys)
            self.target_cache.compact(path)
            if use_draft:
                slots = []
                for i in path[1:]:
                    if trie.draft_slot[order[i]] < 0:
                        break
                    slots.append(trie.draft_slot[order[i]])
                self.draft_cache.compact(slots)
            new = [int(tokens[i]) for i in path[1:]] + [bonus]
            new = new[:limit - len(out)]
            eos = next((j for j, tok in enumerate(new) if tok in self.eos_ids), None)
            stats.emitted_tokens += len(new) if eos is None else eos + 1
            if eos is not None:
                new, finish = new[:eos], "stop"
            out.extend(new)
            ids.extend(new)
            if index is not None:
                index.extend(new)
            if on_tokens is not None and new:
                on_tokens(new)
            if finish == "stop":
                break
        stats.new_tokens = len(out)
        stats.seconds = time.perf_counter() - start
        return DecodeResult(out, finish, stats)

    @staticmethod
    def _trace(stats: DecodeStats, tree: Tree, order: list[int], path: list[int], keys: dict) -> None:
        """Record, for each verified candidate, whether its parent was accepted and whether it was (for tuning)."""
        on_path = set(path)
        for i in range(1, len(tree)):
            for kind, key in keys.get(order[i], ()):
                stats.trace.append((kind, key, tree.parents[i] in on_path, i in on_path))
