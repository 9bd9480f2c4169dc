"""The per-request suffix index: longest repeated suffix, continuations proposed, incremental updates."""

import pytest
from spectrt.runtime.decoding.suffix import SuffixIndex

pytestmark = pytest.mark.unit  # the fast tier: pure functions on small inputs, no model

X, Y = 40, 41


def test_longest_match_extends_beyond_the_ngram():
    # the suffix 5 6 1 2 3 4 occurred before in full (ending at 5) and partly (6 1 2 3 4 ending at 12)
    seq = [5, 6, 1, 2, 3, 4, X, 9, 6, 1, 2, 3, 4, Y, 5, 6, 1, 2, 3, 4]
    index = SuffixIndex(seq, max_ngram=4)
    match, ends = index.longest_match()
    assert match == 6
    assert sorted(ends) == [5, 12]


def test_continuations_are_proposed_with_shares():
    seq = [1, 2, 3, X, 7, 1, 2, 3, Y, 8, 1, 2, 3, X, 9, 1, 2, 3]
    cands = SuffixIndex(seq).propose(3)
    # three earlier occurrences of "1 2 3": two continue with X, one with Y
    by_first = {c.tokens[0]: c for c in cands}
    assert set(by_first) == {X, Y}
    assert cands[0].tokens[0] == X  # the most shared continuation first
    assert all(len(c.tokens) == 3 and c.match == 3 for c in cands)
    x_paths = [c for c in cands if c.tokens[0] == X]
    assert {c.tokens for c in x_paths} == {(X, 7, 1), (X, 9, 1)}
    assert all(c.share == (2 / 3, 1 / 3, 1 / 3) for c in x_paths)
    assert by_first[Y].share == (1 / 3, 1 / 3, 1 / 3)


def test_copy_of_the_prompt_is_continued():
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    index = SuffixIndex(prompt + [99, 10, 11])
    assert [c.tokens for c in index.propose(4)] == [(12, 13, 14, 15)]


def test_no_proposal_without_a_confident_match():
    assert SuffixIndex([1, 2, 3, 4, 1]).propose(4) == []  # only a 1-token match; min_match is 2
    assert [c.tokens for c in SuffixIndex([1, 2, 3, 4, 1], min_match=1).propose(2)] == [(2, 3)]
    assert SuffixIndex([1, 2, 3, 4, 5]).propose(4) == []
    assert SuffixIndex([7]).propose(4) == []


def test_incremental_updates_equal_a_fresh_index():
    seq = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 1, 4, 1, 5]
    grown = SuffixIndex(seq[:5])
    assert grown.propose(3) == []
    for start in range(5, len(seq), 3):
        grown.extend(seq[start:start + 3])
    fresh = SuffixIndex(seq)
    grown.catch_up(), fresh.catch_up()
    assert grown.tokens == fresh.tokens and dict(grown.ends) == dict(fresh.ends)
    assert grown.propose(4) == fresh.propose(4)
    assert [c.tokens for c in grown.propose(3)] == [(9, 2, 6)]  # "3 1 4 1 5" seen at the start


def test_bad_settings_refused():
    with pytest.raises(ValueError, match="min_match"):
        SuffixIndex([], max_ngram=2, min_match=3)


def _reference_match(seq: list[int], max_ngram: int, min_match: int, max_occurrences: int, max_match: int):
    """Brute force: the longest n-gram suffix (min_match..max_ngram) seen earlier, its most recent occurrences,
    and how far back the longest of them matches."""
    last = len(seq) - 1
    for n in range(min(max_ngram, len(seq) - 1), min_match - 1, -1):
        ends = [e for e in range(n - 1, last) if seq[e - n + 1:e + 1] == seq[last - n + 1:]][-max_occurrences:]
        if ends:
            def back(e, k=n):
                while k < max_match and e - k >= 0 and seq[e - k] == seq[last - k]:
                    k += 1
                return k
            return max(back(e) for e in ends), ends
    return 0, []


@pytest.mark.parametrize("seed", range(6))
def test_lazy_index_matches_brute_force_whatever_the_reads(seed):
    """Tokens appended in random chunks, the index read at random points (or not for many steps, as a request on
    hold): every read equals a brute-force search of the sequence so far."""
    import random

    rng = random.Random(seed)
    seq = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
    index = SuffixIndex(seq, max_ngram=4, min_match=2, max_occurrences=3)
    for _ in range(60):
        chunk = [rng.randrange(6) for _ in range(rng.randrange(0, 4))]
        seq += chunk
        index.extend(chunk)
        if rng.random() < 0.4:
            assert index.longest_match() == _reference_match(seq, 4, 2, 3, 32)
            assert index.indexed == len(seq) == len(index.tokens)
