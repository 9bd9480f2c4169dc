"""The prefix cache's index: which token sequence each KV pool slot holds, as a radix tree (pure: no tensors).

A finished request leaves its KV (prompt + output) in its pool slot; the decoder indexes the slot here by its
tokens, and a new request starts from the slot with its longest cached prefix (taking the slot over, or copying the
rows into another free slot) and prefills only the rest (runtime/decoding/decoder.py).

Why a radix tree and not vLLM's block hashes: a slot's rows are one contiguous range (the native forward reads each
slot's K/V contiguously; there is no block table to share pages through), so the unit stored and evicted is a
slot's whole sequence, a leaf of the tree. A block-hash index would find matches only at block boundaries (up to a
block of tokens recomputed per request) and hash every block of every prompt; the tree finds the exact longest
match in one walk over the prompt and holds one leaf per pool slot (bounded by the pool, no memory of its own).

Eviction: when a request needs a slot, an empty free slot goes first, then the least recently used indexed one.
Pinned entries (the prompts of active requests, which later requests may copy from) are never evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)  # identity: nodes are found by walking, compared as objects
class _Node:
    edge: list[int]  # tokens on the edge from the parent
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)  # first edge token -> child
    slots: set[int] = field(default_factory=set)  # slots whose sequence ends here


@dataclass(frozen=True)
class Match:
    slot: int
    length: int  # leading tokens of the query the slot holds
    whole: bool  # the slot's sequence is all matched: taking the slot over loses nothing


class PrefixIndex:
    """Token sequences of pool slots: `insert` when a slot's KV becomes reusable, `match` for a new prompt,
    `victim` for the slot a new request should overwrite, `remove` when a slot is overwritten."""

    def __init__(self):
        self.root = _Node([])
        self.ends: dict[int, _Node] = {}  # slot -> node where its sequence ends
        self.lengths: dict[int, int] = {}
        self.used: dict[int, int] = {}  # slot -> last insert or match (a logical clock: LRU order)
        self.pinned: set[int] = set()
        self.clock = 0

    def __contains__(self, slot: int) -> bool:
        return slot in self.ends

    def __len__(self) -> int:
        return len(self.ends)

    def _tick(self, slot: int) -> None:
        self.clock += 1
        self.used[slot] = self.clock

    def insert(self, slot: int, tokens: list[int], pinned: bool = False) -> None:
        """The slot now holds KV for `tokens` (replacing what it held); `pinned`: an active request's, never
        evicted."""
        self.remove(slot)
        if not tokens:
            return
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = _Node(list(tokens[i:]), node)
                node.children[tokens[i]] = child
                node, i = child, len(tokens)
                break
            k = _common(child.edge, tokens, i)
            if k < len(child.edge):  # split the edge at k
                middle = _Node(child.edge[:k], node, {child.edge[k]: child})
                node.children[tokens[i]] = middle
                child.edge, child.parent = child.edge[k:], middle
                child = middle
            node, i = child, i + k
        node.slots.add(slot)
        self.ends[slot], self.lengths[slot] = node, len(tokens)
        if pinned:
            self.pinned.add(slot)
        self._tick(slot)

    def remove(self, slot: int) -> None:
        """Forget the slot's sequence (it is about to be overwritten); prunes and re-merges the tree."""
        node = self.ends.pop(slot, None)
        if node is None:
            return
        del self.lengths[slot], self.used[slot]
        self.pinned.discard(slot)
        node.slots.discard(slot)
        while node is not self.root and not node.slots and len(node.children) <= 1:
            parent = node.parent
            if node.children:  # one child: merge it into this edge's place
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[node.edge[0]] = child
                break
            del parent.children[node.edge[0]]
            node = parent

    def match(self, tokens: list[int]) -> Match | None:
        """The slot holding the longest prefix of `tokens` (None: no slot shares even the first token). Among the
        slots holding it: one whose whole sequence is matched first, then the most recently used."""
        node, i = self.root, 0
        below = self.root  # the deepest node every slot under which holds tokens[:i]
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common(child.edge, tokens, i)
            below, i = child, i + k
            if k < len(child.edge):
                break
            node = child
        if i == 0:
            return None
        slots = _subtree_slots(below)
        whole = [s for s in slots if self.lengths[s] == i]
        best = max(whole or slots, key=self.used.__getitem__)
        self._tick(best)
        return Match(best, i, self.lengths[best] == i)

    def victim(self, free: list[int]) -> int:
        """Which of the `free` slots a new request should overwrite: one holding nothing indexed, else the least
        recently used (a leaf: the sequences other slots share stay)."""
        empty = [s for s in free if s not in self.ends]
        if empty:
            return empty[-1]
        evictable = [s for s in free if s not in self.pinned]
        if not evictable:
            raise ValueError(f"every free slot {free} is pinned: an active request's slot is never free")
        return min(evictable, key=self.used.__getitem__)


def _common(edge: list[int], tokens: list[int], start: int) -> int:
    """Length of the common prefix of `edge` and tokens[start:]."""
    k, limit = 0, min(len(edge), len(tokens) - start)
    while k < limit and edge[k] == tokens[start + k]:
        k += 1
    return k


def _subtree_slots(node: _Node) -> list[int]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out += n.slots
        stack += n.children.values()
    return out
