"""Free candidates: a per-request suffix index over prompt + generated tokens (prompt lookup / SuffixDecoding).

Answers often repeat spans of the prompt or of themselves. The index maps every n-gram (n <= `max_ngram`)
to the positions where it ends, updated incrementally as tokens are accepted. A proposal finds the
longest suffix of the sequence that occurred before, follows each earlier occurrence's continuation and
merges them into a small trie whose nodes count the occurrences through them. Nothing is proposed
without a match of at least `min_match` tokens (no speculation without a confident match).
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

# a request's index (`new_index`): n-grams of 2-4 tokens, the 16 most recent occurrences, matches up to 32 tokens
MAX_NGRAM, MIN_MATCH, MAX_OCCURRENCES, MAX_MATCH = 4, 2, 16, 32


class SuffixCandidate(NamedTuple):
    """One continuation path: `tokens` after the current sequence, `match` tokens of context matched,
    `share` the fraction of the earlier occurrences that continue with exactly this path (per token)."""

    tokens: tuple[int, ...]
    match: int
    share: tuple[float, ...]


def new_index(tokens: list[int], native=None):
    """A request's suffix index: `native`'s (the kernels module's `SuffixIndex`, cpu_kernels.cpp: the same matches and
    proposals, as plain tuples) where given, else `SuffixIndex`."""
    if native is not None:
        return native.SuffixIndex(tokens, MAX_NGRAM, MIN_MATCH, MAX_OCCURRENCES, MAX_MATCH)
    return SuffixIndex(tokens)


class SuffixIndex:
    """n-gram -> end positions over one request's tokens; `extend` as tokens are accepted, `propose` to speculate."""

    def __init__(self, tokens: list[int] | None = None, max_ngram: int = MAX_NGRAM, min_match: int = MIN_MATCH,
                 max_occurrences: int = MAX_OCCURRENCES, max_match: int = MAX_MATCH):
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"min_match={min_match} must be in [1, max_ngram={max_ngram}]")
        self.max_ngram, self.min_match = max_ngram, min_match
        self.max_occurrences, self.max_match = max_occurrences, max_match
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self.indexed = 0  # tokens whose n-grams are in `ends`
        self.extend(tokens or [])

    def extend(self, tokens: list[int]) -> None:
        """Append accepted tokens; their n-grams are indexed when the index is next read (`catch_up`). Why lazily:
        every accepted token of every speculating request is appended, but a request on hold (a batch where its
        candidates do not pay) reads nothing, and indexing cost ~2.7 us a token, ~20 us a step at batch 8."""
        self.tokens.extend(map(int, tokens))

    def catch_up(self) -> None:
        """Index every n-gram (min_match <= n <= max_ngram: shorter ones are never looked up) ending at a token
        appended since the last read."""
        seq, ends, low = self.tokens, self.ends, self.min_match
        for end in range(self.indexed, len(seq)):
            for n in range(low, min(self.max_ngram, end + 1) + 1):
                ends[tuple(seq[end - n + 1:end + 1])].append(end)
        self.indexed = len(seq)

    def longest_match(self) -> tuple[int, list[int]]:
        """(match length, end positions of earlier occurrences) for the longest repeated suffix, or (0, [])."""
        self.catch_up()
        seq, last = self.tokens, len(self.tokens) - 1
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_match - 1, -1):
            ends = [e for e in self.ends.get(tuple(seq[last - n + 1:]), ()) if e < last]
            if ends:
                ends = ends[-self.max_occurrences:]  # the most recent occurrences
                return max(self._extend_back(e, n) for e in ends), ends
        return 0, []

    def _extend_back(self, end: int, n: int) -> int:
        """How far the match ending at `end` extends beyond the n-gram (bounded by `max_match`)."""
        seq, last = self.tokens, len(self.tokens) - 1
        while n < self.max_match and end - n >= 0 and seq[end - n] == seq[last - n]:
            n += 1
        return n

    def propose(self, max_tokens: int) -> list[SuffixCandidate]:
        """Continuation paths (each at most `max_tokens` long) of the longest repeated suffix, most shared first.

        Occurrences whose continuations share a prefix are merged: the result is the set of root-to-leaf
        paths of their continuation trie, each token annotated with the share of occurrences reaching it.
        """
        match, ends = self.longest_match()
        if not match or max_tokens <= 0:
            return []
        conts = [tuple(self.tokens[e + 1:e + 1 + max_tokens]) for e in ends]
        conts = [c for c in conts if c]
        total = len(conts)
        counts: dict[tuple[int, ...], int] = defaultdict(int)
        for c in conts:
            for d in range(1, len(c) + 1):
                counts[c[:d]] += 1
        leaves = {c for c in conts if not any(o != c and o[:len(c)] == c for o in conts)}
        paths = sorted(leaves, key=lambda c: (-counts[c[:1]], -counts[c], c))
        return [SuffixCandidate(c, match, tuple(counts[c[:d]] / total for d in range(1, len(c) + 1))) for c in paths]
