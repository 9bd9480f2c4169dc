"""The speculative decode loop: draft a token tree level by level, verify it in one target pass.

Autoregressive decoding is the same loop with a root-only tree (no draft pass, one token per
target pass), so the baseline runs on exactly the engine, cache and kernels that speculation uses.
Both caches are allocated once here; a request only moves their committed lengths.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from spectrt.runtime.engine import Engine
from spectrt.runtime.sampling import SamplingParams, draw_children, sampling_probs, verify_sampled
from spectrt.runtime.tree import Tree, greedy_accept

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
    seconds: float = 0.0
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted per target pass

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass (accepted draft tokens + the target's own token)."""
        return self.emitted_tokens / max(self.target_passes, 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0

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
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),
            "tau": round(self.tau, 4),
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

    def generate(self, prompt_ids: list[int], max_new_tokens: int, tree: Tree | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None, params: SamplingParams = GREEDY,
                 children: str = "sample") -> DecodeResult:
        """Decode; `tree=None` (or a draft-less decoder) is plain autoregressive decoding."""
        tree = tree if (tree is not None and self.draft is not None) else ROOT_ONLY
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
        if len(tree) > self.max_tree_tokens:
            raise ValueError(f"the tree has {len(tree)} nodes, more than max_tree_tokens={self.max_tree_tokens}")

        stats = DecodeStats(prompt_tokens=len(prompt_ids))
        start = time.perf_counter()
        ids = list(prompt_ids)
        self.target_cache.reset()
        self._catch_up(self.target, self.target_cache, ids[:-1])
        if len(tree) > 1:
            self.draft_cache.reset()
            self._catch_up(self.draft, self.draft_cache, ids[:-1])
        stats.prefill_seconds = time.perf_counter() - start

        limit = min(max_new_tokens, self.max_seq_len - len(prompt_ids))
        out: list[int] = []
        finish = "length"
        while len(out) < limit:
            n = self.target_cache.length
            self.node_tokens[0] = ids[-1]
            if len(tree) > 1:
                self._draft_tree(tree, ids, n, stats, params, children, draft_gen)
            tokens = self.node_tokens[:len(tree)]
            logits = self.target.forward(tokens, tree.positions(n), tree.mask, self.target_cache)
            stats.target_passes += 1
            if params.greedy:
                path, bonus = greedy_accept(tree, tokens.tolist(), logits.argmax(-1).tolist())
            else:
                q = self.node_q[:len(tree)] if len(tree) > 1 and children == "sample" else None
                path, bonus = verify_sampled(tree, tokens, sampling_probs(logits, params), q, verify_gen)
            stats.accepted.append(len(path) - 1)
            self.target_cache.compact(path)
            if len(tree) > 1:
                self.draft_cache.compact([i - 1 for i in path[1:] if tree.depths[i] < tree.max_depth])
            new = [int(self.node_tokens[i]) for i in path[1:]] + [bonus]
            new = new[:limit - len(out)]
            eos = next((j for j, tok in enumerate(new) if tok in self.eos_ids), None)
            stats.emitted_tokens += len(new) if eos is None else eos + 1
            if eos is not None:
                new, finish = new[:eos], "stop"
            out.extend(new)
            ids.extend(new)
            if on_tokens is not None and new:
                on_tokens(new)
            if finish == "stop":
                break
        stats.new_tokens = len(out)
        stats.seconds = time.perf_counter() - start
        return DecodeResult(out, finish, stats)
