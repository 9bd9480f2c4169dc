"""The decode loop's native host helpers (runtime/engines/cpu_kernels.cpp: KV compaction, top-k, the suffix index, the
budget's arithmetic) against the Python they replace, once per ISA build this CPU executes: the same rows, tokens,
proposals and choices, bitwise where the loop compares them. Not in the unit tier: each ISA is a build of its own."""

from __future__ import annotations

import random

import pytest
import torch
from spectrt.runtime.decoding import sampling
from spectrt.runtime.decoding.policy import (
    CostCurve,
    DraftingCost,
    allocate,
    allocate_reference,
    choose_drafted,
    choose_drafted_reference,
    drafted_rate,
    drafted_rate_reference,
)
from spectrt.runtime.decoding.suffix import SuffixIndex, new_index
from spectrt.runtime.engines.kernels import load_kernels, native_unavailable, runnable_isas
from spectrt.runtime.engines.model import KVCache
from test_sampling import top_k_cases

ISAS = runnable_isas()


@pytest.mark.parametrize("isa", ISAS)
def test_native_compaction_moves_the_rows_numpy_moves(isa, monkeypatch):
    """Property: over random pool shapes, prefix lengths and accepted window slots (ascending; a leading run in place
    or not, none at all), the native `compact_cache` leaves K and V bitwise as the numpy path does (every other row
    untouched) and commits as many rows; slots out of order or past the capacity are refused."""
    monkeypatch.setenv("SPECTRT_ISA", isa)
    native = load_kernels()
    if native is None:
        pytest.skip(f"no native module builds here: {native_unavailable()}")
    gen = torch.Generator().manual_seed(5)

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=gen))

    for trial in range(150):
        layers, heads, window, dim = 1 + draw(3), 1 + draw(3), 1 + draw(12), (8, 64, 5)[trial % 3]
        capacity = window + draw(40)
        pool_k, pool_v = torch.randn(2, layers, heads, capacity, dim), torch.randn(2, layers, heads, capacity, dim)
        keep = sorted(torch.randperm(window, generator=gen)[:draw(window + 1)].tolist())
        if trial % 4 == 0 and keep:  # a path that starts with rows in place
            keep = sorted(set(range(draw(len(keep)) + 1)) | set(keep))
        caches = [KVCache(k, v, 1, window, kernels=module)
                  for k, v, module in ((pool_k, pool_v, native), (pool_k.clone(), pool_v.clone(), None))]
        length = draw(capacity - window + 1)
        for cache in caches:
            cache.length = length
            cache.compact(keep)
        assert caches[0].length == caches[1].length == length + len(keep)
        assert torch.equal(caches[0].pool_k, caches[1].pool_k), trial
        assert torch.equal(caches[0].pool_v, caches[1].pool_v), trial
    k, v = torch.zeros(2, 2, 16, 8), torch.zeros(2, 2, 16, 8)
    for bad in ([2, 1], [0, 0], [0, 16]):
        with pytest.raises(ValueError, match="ascending window slots"):
            native.compact_cache(k, v, 0, bad)


@pytest.mark.parametrize("isa", ISAS)
def test_native_top_tokens_on_every_isa_match_the_numpy_reference(isa, monkeypatch):
    """Property: over `test_sampling.top_k_cases`, each ISA build's native top-k gives numpy's ids exactly and its
    probabilities to 1e-5 (so the same trees; blocks whose maximum cannot enter the top k are skipped). The loop's own
    call (the best build, resolved once a process) is `test_sampling`'s."""
    monkeypatch.setenv("SPECTRT_ISA", isa)
    native = load_kernels()
    if native is None:
        pytest.skip(f"no native module builds here: {native_unavailable()}")
    for trial, logits, k in top_k_cases():
        (ids, probs), (want_ids, want_probs) = native.top_tokens(logits, k), sampling.top_tokens_reference(logits, k)
        assert ids == want_ids, trial
        assert torch.allclose(torch.tensor(probs), torch.tensor(want_probs), rtol=1e-5, atol=1e-7), trial


@pytest.mark.parametrize("isa", ISAS)
def test_the_native_index_finds_and_proposes_what_the_python_one_does(isa, monkeypatch):
    """Property: over random sequences (small alphabets: many repeats), chunked extends and reads at random points,
    the native index the loop uses (`new_index`) returns the same longest matches and the same proposals, in the
    same order with the same shares, as `SuffixIndex`, on every ISA build; bad settings are refused alike."""

    monkeypatch.setenv("SPECTRT_ISA", isa)
    native = load_kernels()
    if native is None:
        pytest.skip(f"no native module builds here: {native_unavailable()}")
    rng = random.Random(7)
    for trial in range(40):
        alphabet = rng.choice([3, 6, 50])
        seq = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))]
        ours, theirs = new_index(list(seq), native), SuffixIndex(list(seq))
        for _ in range(40):
            chunk = [rng.randrange(alphabet) for _ in range(rng.randrange(0, 5))]
            ours.extend(chunk), theirs.extend(chunk)
            if rng.random() < 0.5:
                depth = rng.randrange(0, 10)
                got = [(tuple(tokens), match, tuple(share)) for tokens, match, share in ours.propose(depth)]
                assert got == [tuple(c) for c in theirs.propose(depth)], trial
                assert ours.longest_match() == theirs.longest_match(), trial
        assert ours.tokens == theirs.tokens and ours.indexed == theirs.indexed
    with pytest.raises(ValueError, match="min_match"):
        native.SuffixIndex([], 2, 3, 16, 32)


@pytest.mark.parametrize("isa", ISAS)
def test_the_budgets_native_arithmetic_chooses_what_the_reference_chooses(isa, monkeypatch):
    """Property: over random score lists, budgets, caps, gains, catch-ups and cost curves (flat, steep, batched by
    segments), `allocate`, `choose_drafted` and `drafted_rate` as the loop runs them (native, on every ISA build) give
    the Python references' sizes, choices and rates bitwise: the same trees."""
    monkeypatch.setenv("SPECTRT_ISA", isa)
    native = load_kernels()
    if native is None:
        pytest.skip("no native module builds here")
    monkeypatch.setattr("spectrt.runtime.decoding.policy.host_kernels", lambda: native)
    rng = random.Random(3)

    def curve() -> CostCurve:
        points = sorted({1, *rng.sample(range(2, 80), rng.randrange(0, 6))})
        ms, total = {}, rng.uniform(0.5, 10)
        for t in points:
            total += rng.choice([0.0, rng.uniform(0, 3), rng.uniform(0, 0.1)])
            ms[t] = total
        return CostCurve(ms)

    for trial in range(300):
        verify = curve()
        n = rng.randrange(1, 9)
        scores = [sorted((rng.choice([rng.random(), 0.5, 0.25]) for _ in range(rng.randrange(0, 9))), reverse=True)
                  for _ in range(n)]
        budgets = [rng.randrange(1, 10) for _ in range(n)]
        args = (scores, budgets, rng.choice([0.0, rng.uniform(0, 3)]), verify, rng.randrange(0, 20),
                rng.randrange(0, 3), rng.choice([None, 0, rng.randrange(1, 12)]))
        assert allocate(*args) == allocate_reference(*args), trial
        draft = DraftingCost(tuple(curve() for _ in range(rng.randrange(1, n + 1))), rng.randrange(0, 3),
                             rng.randrange(1, 4), rng.uniform(0, 0.5), rng.uniform(0, 0.2))
        gains = [rng.choice([rng.uniform(0, 2), 0.5, 1.0]) for _ in range(n)]
        gain_rows = [rng.choice([rng.uniform(0, 4), 1.0, 3.0, 0.0]) for _ in range(n)]
        catch_up = [rng.choice([rng.uniform(1, 8), 2.0, 4]) for _ in range(n)]
        gate = (gains, gain_rows, catch_up, rng.uniform(1, 10), rng.randrange(1, 40), verify, draft)
        picked = choose_drafted(*gate)
        assert picked == choose_drafted_reference(*gate), trial
        assert drafted_rate(picked, *gate) == drafted_rate_reference(picked, *gate), trial
        some = sorted(rng.sample(range(n), rng.randrange(0, n + 1)))
        assert drafted_rate(some, *gate) == drafted_rate_reference(some, *gate), trial
