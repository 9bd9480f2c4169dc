"""Token-tree topology, tree attention masks, position ids and greedy acceptance (pure functions).

A tree is stored flattened in breadth-first order: node 0 is the root (the last accepted token,
not yet verified), every parent comes before its children and siblings are ordered by draft rank.
Node i attends to itself and its ancestors (plus the whole committed prefix, implicit here);
its position id is prefix length + depth, so siblings share a position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch


class TreeError(ValueError):
    """A malformed tree specification; the message says the accepted form."""


AUTO = "auto"  # a tree argument: dynamic trees under the speculation policy
DEFAULT_TREE = "2,1"  # the static expansion used when a caller asks for a static tree without naming one
NO_TREE = ("none", "ar", "0")  # tree arguments for the target alone
MAX_PARSED_NODES = 4096  # a spec parsed without a deployment's limit: far above any tree a verify forward takes, and
# refused before "1000,1000,1000" builds a billion nodes


def parse_tree_arg(spec: str, max_depth: int | None = None, max_nodes: int | None = None) -> Tree | str | None:
    """The one reading of a tree argument (`--tree`, a request's `tree`, `Pipeline.generate`): "auto" -> AUTO,
    "none"/"ar"/"0" -> None (the target alone), anything else a bounded static `Tree.parse`."""
    spec = spec.strip()
    if spec.lower() == AUTO:
        return AUTO
    if spec.lower() in NO_TREE:
        return None
    return Tree.parse(spec, max_depth, max_nodes)


@dataclass(frozen=True)
class Tree:
    """A static tree topology: `parents[i]` is node i's parent index (-1 for the root)."""

    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.parents or self.parents[0] != -1:
            raise TreeError("a tree needs a root: parents[0] must be -1")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise TreeError(f"node {i} has parent {p}: parents must precede their children (BFS order)")
        if list(self.depths) != sorted(self.depths):
            raise TreeError("nodes must be in breadth-first order: every level after the one above it")

    @classmethod
    def from_expansion(cls, expansion: list[int] | tuple[int, ...]) -> Tree:
        """SpecInfer expansion vector: every node at depth d gets `expansion[d]` children (top-k ranks)."""
        if not expansion or any(int(k) < 1 for k in expansion):
            raise TreeError(f"expansion {list(expansion)} must be a non-empty list of integers >= 1, e.g. 3,2,2,1,1")
        parents, level = [-1], [0]
        for k in expansion:
            nxt = []
            for p in level:
                for _ in range(int(k)):
                    parents.append(p)
                    nxt.append(len(parents) - 1)
            level = nxt
        return cls(tuple(parents))

    @classmethod
    def parse(cls, spec: str, max_depth: int | None = None, max_nodes: int | None = None) -> Tree:
        """A SpecInfer expansion vector such as "3,2,2,1,1", refused past `max_depth` levels or `max_nodes` nodes
        (default `MAX_PARSED_NODES`) before any node is built (a request's tree is bounded by the deployment's
        limits)."""
        try:
            expansion = [int(x) for x in spec.replace(" ", "").split(",")]
        except ValueError:
            raise TreeError(f"tree {spec!r} is malformed: give branching per depth as integers, e.g. 3,2,2,1,1") \
                from None
        if any(k < 1 for k in expansion):
            raise TreeError(f"tree {spec!r}: every depth needs at least 1 child, e.g. 3,2,2,1,1")
        if max_depth is not None and len(expansion) > max_depth:
            raise TreeError(f"tree {spec!r} is {len(expansion)} deep, more than max_tree_depth={max_depth}: send a "
                            "shallower tree")
        total, width = 1, 1
        for k in expansion:
            width *= k
            total += width
            if max_nodes is not None and total > max_nodes:
                raise TreeError(f"tree {spec!r} has more than max_tree_tokens={max_nodes} nodes")
            if total > MAX_PARSED_NODES:
                raise TreeError(f"tree {spec!r} has more than {MAX_PARSED_NODES} nodes: give a smaller tree, e.g. "
                                "3,2,2,1,1")
        return cls.from_expansion(expansion)

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0] * len(self)
        for i, p in enumerate(self.parents[1:], start=1):
            depths[i] = depths[p] + 1
        return tuple(depths)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for i, p in enumerate(self.parents[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Each node's index among its siblings: the draft's top-k rank it takes."""
        ranks = [0] * len(self)
        for kids in self.children:
            for r, c in enumerate(kids):
                ranks[c] = r
        return tuple(ranks)

    @cached_property
    def levels(self) -> tuple[tuple[int, ...], ...]:
        """Node indices per depth, each level a contiguous block of the flattened order."""
        return tuple(tuple(i for i, d in enumerate(self.depths) if d == depth) for depth in range(self.max_depth + 1))

    @cached_property
    def level_children(self) -> tuple[tuple[torch.Tensor, torch.Tensor, int], ...]:
        """Per depth d >= 1: each node's parent row within level d-1, its sibling rank, and the top-k needed.

        Precomputed so the draft loop fills a level with one gather: tokens = topk(parent logits)[row, rank].
        """
        out = []
        for depth in range(1, self.max_depth + 1):
            level, first_parent = self.levels[depth], self.levels[depth - 1][0]
            rank = torch.tensor([self.ranks[i] for i in level])
            out.append((torch.tensor([self.parents[i] - first_parent for i in level]), rank, int(rank.max()) + 1))
        return tuple(out)

    @cached_property
    def mask(self) -> torch.Tensor:
        """Bool [N, N]: mask[i, j] is True when node i may attend node j (j is i or an ancestor of i)."""
        n = len(self)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents[1:], start=1):
            mask[i] |= mask[p]
        return mask

    @cached_property
    def depth_tensor(self) -> torch.Tensor:
        return torch.tensor(self.depths, dtype=torch.long)

    def positions(self, prefix_len: int) -> torch.Tensor:
        """Position ids of the nodes when the root sits at position `prefix_len`."""
        return self.depth_tensor + prefix_len


def path_tokens(parents: Sequence[int], tokens: Sequence[int]) -> list[list[int]]:
    """Each node's tokens below the root, its own last (the root's: none); parents[i] < i. What per-path rules
    (bad words, penalties) read a row by."""
    paths: list[list[int]] = [[]]
    for i in range(1, len(tokens)):
        paths.append(paths[parents[i]] + [int(tokens[i])])
    return paths


def greedy_accept(tree: Tree, tokens: list[int], target_argmax: list[int]) -> tuple[list[int], int]:
    """Longest root path whose tokens equal the target's argmax at their parent, plus the bonus token.

    `tokens[i]` is node i's token, `target_argmax[i]` the target's greedy next token after node i.
    Returns the accepted node indices (root first) and the bonus token (the target's token after
    the last accepted node), so the decoded output equals the target's own greedy decoding.
    """
    path = [0]
    node = 0
    while True:
        want = target_argmax[node]
        nxt = next((c for c in tree.children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


@lru_cache(maxsize=4096)
def shaped(parents: tuple[int, ...]) -> Tree:
    """The one `Tree` of a shape: a step's verified trie has one of few shapes, so its checks, mask and depth tensor
    are built once (a new Tree a step rebuilt them: ~5% of a batch-1 step's host work, py-spy)."""
    return Tree(parents)


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


class TokenTrie:
    """Candidates of several proposers merged into one token trie (SpecInfer's merge-based construction).

    Node 0 is the root (the last accepted token). `add` merges a candidate into an existing child with
    the same token, so shared prefixes appear once. Each node carries a score, the estimated probability
    that the target accepts the path to it, capped at its parent's so that any top-B selection (ties to
    the shallower node) stays connected. Flags say how verification must treat a node:
    `point` (a deterministic candidate: suffix match or draft top-k, verified as a point mass) and/or
    `sampled` (drawn without replacement from the draft's q at its parent, in creation order).
    `draft_slot` is the node's slot in the draft's uncommitted window once the draft has read it.
    """

    def __init__(self, root_token: int):
        self.tokens, self.parents, self.depths, self.scores = [int(root_token)], [-1], [0], [1.0]
        self.point, self.sampled, self.draft_slot = [False], [False], [-1]
        self.kids: list[dict[int, int]] = [{}]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, token: int, score: float, sampled: bool = False) -> int:
        """Merge one child candidate under `parent`; returns its node (new or the existing one)."""
        token, score = int(token), min(float(score), self.scores[parent])
        node = self.kids[parent].get(token)
        if node is None:
            node = len(self.tokens)
            self.kids[parent][token] = node
            self.kids.append({})
            self.tokens.append(token)
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.scores.append(score)
            self.point.append(False)
            self.sampled.append(False)
            self.draft_slot.append(-1)
        else:
            self.scores[node] = max(self.scores[node], score)
        if sampled:
            self.sampled[node] = True
        else:
            self.point[node] = True
        return node

    def add_path(self, tokens: list[int] | tuple[int, ...], scores: list[float] | tuple[float, ...]) -> list[int]:
        """A deterministic candidate continuation from the root (e.g. a suffix match): one node per token."""
        node, nodes = 0, []
        for tok, score in zip(tokens, scores, strict=True):
            node = self.add(node, tok, score)
            nodes.append(node)
        return nodes

    def expand(self, frontier: list[int], tokens: list[list[int]], probs: list[list[float]],
               edge: Callable[[float], float]) -> list[int]:
        """A draft level's children: under `frontier[r]`, token `tokens[r][j]` scored its parent's score times
        `edge(probs[r][j])` (`Calibration.draft_edge`); returns their nodes row by row."""
        nodes = []
        for parent, row, row_probs in zip(frontier, tokens, probs, strict=True):
            for tok, prob in zip(row, row_probs, strict=True):
                nodes.append(self.add(parent, tok, self.scores[parent] * edge(prob)))
        return nodes

    def best(self, budget: int) -> list[int]:
        """The root and the budget-1 highest-scoring other nodes (ties to the shallower, then the older)."""
        order = sorted(range(1, len(self)), key=lambda i: (-self.scores[i], self.depths[i], i))
        return [0] + order[:max(budget - 1, 0)]

    def sorted_scores(self, scale: float = 1.0) -> list[float]:
        """Non-root scores best first, each times `scale` (what the budget ranks)."""
        return [x * scale for x in sorted(self.scores[1:], reverse=True)]

    def picks(self, depth: int, width: int) -> tuple[list[int], float]:
        """A dynamic tree's next draft level: the `width` best nodes at `depth` whose parent is the root or read by
        the draft (ties to the older), and their scores' sum."""
        level = [i for i in range(1, len(self)) if self.depths[i] == depth
                 and (self.parents[i] == 0 or self.draft_slot[self.parents[i]] >= 0)]
        level = sorted(level, key=lambda i: (-self.scores[i], i))[:max(width, 0)]
        return level, sum(self.scores[i] for i in level)

    def feed(self, nodes: list[int], fed: int) -> tuple[tuple[int, ...], tuple[int, ...], list[int], int]:
        """Give `nodes` (one depth) the draft slots fed, fed + 1, ...: returns the level's mask entries (rows and
        columns: each node sees itself and its fed ancestors), the nodes' tokens and their depth."""
        rows, cols = [], []
        for row, node in enumerate(nodes):
            rows.append(row)
            cols.append(fed + row)
            anc = self.parents[node]
            while anc > 0:
                rows.append(row)
                cols.append(self.draft_slot[anc])
                anc = self.parents[anc]
        for row, node in enumerate(nodes):
            self.draft_slot[node] = fed + row
        return tuple(rows), tuple(cols), [self.tokens[i] for i in nodes], self.depths[nodes[0]]

    def read_slots(self, nodes: list[int]) -> list[int]:
        """The draft slots of `nodes` (a path) up to the first one the draft has not read."""
        slots = []
        for i in nodes:
            if self.draft_slot[i] < 0:
                break
            slots.append(self.draft_slot[i])
        return slots

    def subtree(self, nodes: list[int]) -> tuple[Tree, list[int], list[int]]:
        """The tree over `nodes` (which must contain each one's parent) in breadth-first order.

        Returns the Tree, for each of its nodes the trie node it is, and their tokens: siblings keep creation order,
        so sampled children stay in draw order.
        """
        keep = set(nodes)
        if 0 not in keep or any(self.parents[i] not in keep for i in keep if i):
            raise TreeError("a selection of trie nodes must contain the root and every selected node's parent")
        order, where, parents = [0], {0: 0}, [-1]
        for i in order:
            for child in sorted(c for c in self.kids[i].values() if c in keep):
                where[child] = len(order)
                order.append(child)
                parents.append(where[i])
        return shaped(tuple(parents)), order, [self.tokens[i] for i in order]
