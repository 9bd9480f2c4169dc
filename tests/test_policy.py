"""The policy's cost model and the tuner's choice on synthetic cost curves and acceptance tables."""

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from spectrt.runtime.decoding.policy import (
    BatchedCost,
    Calibration,
    CostCurve,
    Policy,
    allocate,
    allocation_gain,
    choose_drafted,
    choose_policy,
    expected_tokens,
    load_policy,
    pick_measured,
    rank_policies,
    write_atomically,
)

pytestmark = pytest.mark.unit  # the fast tier: pure functions on small inputs, no model

BUDGETS, DEPTHS, WIDTHS = [2, 3, 4, 6, 8], [1, 2, 3, 4], [1, 2]


def best_size(scores: list[float], sunk_ms: float, verify, budget: int) -> tuple[int, float]:
    """`allocate` for a batch of one: (nodes to verify, root included, and the rate)."""
    sizes, rate = allocate([scores], [budget], sunk_ms, verify)
    return sizes[0], rate


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve({1: 10.0, 2: 12.0, 4: 20.0})
    assert curve(1) == 10.0 and curve(3) == 16.0 and curve(4) == 20.0
    assert curve(6) == 28.0  # the last segment's slope
    with pytest.raises(ValueError, match="T=1"):
        CostCurve({2: 1.0})


def test_best_size_takes_nodes_only_while_they_pay():
    flat = CostCurve({1: 10.0, 64: 10.0})
    assert best_size([0.9, 0.5, 0.1], 0.0, flat, 8)[0] == 4  # free verify: every node with a chance pays
    assert best_size([0.9, 0.5, 0.1], 0.0, flat, 2)[0] == 2  # within the budget
    steep = CostCurve({1: 10.0, 2: 20.0, 4: 40.0})
    assert best_size([0.9, 0.5], 0.0, steep, 8)[0] == 1  # doubling the cost for < 1 token: plain AR
    mild = CostCurve({1: 10.0, 2: 11.0, 3: 12.0, 4: 18.0})
    # rates: B=1 1/10, B=2 1.9/11, B=3 2.4/12, B=4 2.5/18
    assert best_size([0.9, 0.5, 0.1], 0.0, mild, 8) == (3, pytest.approx(2.4 / 12))


def test_expected_tokens_of_a_dynamic_tree():
    acc = [[0.8, 0.1], [0.5, 0.2]]
    assert expected_tokens(acc, 2, 1, 1) == pytest.approx(1.8)  # the top-1 child
    # depth 2, width 2: level 1 {.8, .1}; level 2 under both: {.4, .16, .05, .02}; best 4 of all 6 nodes
    assert expected_tokens(acc, 5, 2, 2) == pytest.approx(1 + 0.8 + 0.4 + 0.16 + 0.1)
    assert expected_tokens(acc, 64, 2, 2) == pytest.approx(1 + 0.8 + 0.1 + 0.4 + 0.16 + 0.05 + 0.02)


def test_tuner_picks_the_deepest_chain_when_verify_is_flat_and_drafting_cheap():
    verify, draft = CostCurve({1: 10.0, 64: 10.0}), CostCurve({1: 1.0, 64: 1.0})
    acc = [[0.9, 0.0]] * 4  # only the draft's top-1 is ever accepted, 0.9 at every depth
    policy, rate = choose_policy(verify, draft, acc, BUDGETS, DEPTHS, WIDTHS)
    # chain of depth d: (1 + Σ_{k<=d} 0.9^k) / (1 + (d-1) + 10), increasing in d up to 4; a width-2 tree adds
    # only zero-probability nodes at a higher draft cost, so width 1; budget: the depth-4 chain needs 5 nodes
    assert (policy.depth, policy.width, policy.draft) == (4, 1, True)
    assert policy.budget in (6, 8)
    assert rate == pytest.approx((1 + sum(0.9**k for k in range(1, 5))) / 14)


def test_tuner_picks_autoregressive_when_verify_is_expensive():
    verify, draft = CostCurve({1: 10.0, 2: 20.0, 8: 80.0}), CostCurve({1: 2.0, 8: 2.0})
    policy, rate = choose_policy(verify, draft, [[0.9, 0.5]] * 4, BUDGETS, DEPTHS, WIDTHS)
    assert not policy.draft and policy.depth == 0 and rate == pytest.approx(0.1)
    assert policy.suffix  # free candidates stay on: each step verifies them only when they pay


def test_tuner_brute_force_optimum_on_a_small_grid():
    verify = CostCurve({1: 10.0, 2: 10.5, 3: 11.0, 4: 13.0, 8: 20.0})
    draft = CostCurve({1: 1.5, 2: 1.6, 8: 2.0})
    acc = [[0.6, 0.25], [0.5, 0.2], [0.4, 0.1]]
    policy, rate = choose_policy(verify, draft, acc, [2, 3, 4], [1, 2], [1, 2])
    # hand-computed rates, cost = draft(2) + (d-1)·draft(w) + verify(b):
    # (b=3,d=1,w=2): 1.85/12.6 = .1468; (b=3,d=2,w=1): 1.9/(1.6+1.5+11) = .1348;
    # (b=4,d=2,w=2): (1+.6+.3+.25)/(1.6+1.6+13) = .1327; (b=2,d=1,w=1): 1.6/12.1 = .1322; AR .1
    assert (policy.budget, policy.depth, policy.width) == (3, 1, 2)
    assert rate == pytest.approx(1.85 / 12.6)


def test_ranking_is_best_first_and_its_head_is_the_choice():
    verify = CostCurve({1: 10.0, 2: 10.5, 3: 11.0, 4: 13.0, 8: 20.0})
    draft = CostCurve({1: 1.5, 2: 1.6, 8: 2.0})
    acc = [[0.6, 0.25], [0.5, 0.2], [0.4, 0.1]]
    ranked = rank_policies(verify, draft, acc, [2, 3, 4], [1, 2], [1, 2])
    rates = [r for _, r in ranked]
    # every shape whose depth the budget can verify (not budget 2 at depth 2) and the draft-off one
    assert rates == sorted(rates, reverse=True) and len(ranked) == 1 + (3 * 2 * 2 - 2)
    assert ranked[0] == choose_policy(verify, draft, acc, [2, 3, 4], [1, 2], [1, 2])
    shapes = [(p.budget, p.depth, p.width) for p, _ in ranked]
    assert shapes[:2] == [(3, 1, 2), (3, 2, 1)]  # the hand-computed order of the test above
    assert [p.draft for p, _ in ranked].count(False) == 1 and ranked[-1][1] == pytest.approx(0.1)


@pytest.mark.parametrize(("measured", "kept"), [
    ([100.0, 101.0, 110.0], 2),  # clearly faster than the model's choice: taken
    ([100.0, 101.5, 90.0], 0),  # within the margin: the model's choice stands
    ([100.0, 90.0], 0),
    ([100.0, 105.0, 105.0], 1),  # a tie goes to the model's better-ranked one
    ([0.0, 0.0], 0),
])
def test_the_tuner_keeps_a_finalist_only_when_measured_clearly_faster(measured, kept):
    assert pick_measured(measured, 0.02) == kept


def test_policy_json_round_trip(tmp_path):
    policy = Policy(budget=6, depth=2, width=3, draft=False, calibration=Calibration(suffix_next=0.7),
                    verify_ms=((1, 5.0), (8, 9.0)))
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"policy": policy.to_json()}))
    assert load_policy(path) == policy
    assert load_policy(tmp_path / "missing.json") is None


@pytest.mark.parametrize("text", ['{"policy": {"budget": 6, "dep', "", "[]", '{"other": 1}'])
def test_a_torn_policy_file_falls_back_to_the_untuned_default_naming_the_file(tmp_path, text):
    """A cut `spectrt tune` left a half-written file that failed every later load with a bare JSONDecodeError."""
    path = tmp_path / "policy-x.json"
    path.write_text(text)
    with pytest.warns(UserWarning, match=r"policy-x\.json is not a saved policy.*spectrt tune"):
        assert load_policy(path) is None


def test_policies_are_written_atomically(tmp_path, monkeypatch):
    """The tuner writes through a temporary file and a rename: a write that fails midway leaves the old file."""
    path = tmp_path / "policy.json"
    write_atomically(path, '{"policy": 1}')
    real = Path.write_text

    def torn(self, text, *args, **kwargs):
        real(self, text[:5], *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(Path, "write_text", torn)
    with pytest.raises(OSError):
        write_atomically(path, '{"policy": 2}')
    monkeypatch.undo()
    assert path.read_text() == '{"policy": 1}'
    with pytest.raises(ValueError, match="budget >= 1"):
        Policy(budget=0)


def test_acceptance_tables_from_a_trace():
    from spectrt.runtime.decoding.tune import CALIBRATION_PRIOR, acceptance_tables

    trace = [
        ("draft", (1, 0, 0.92), True, True), ("draft", (1, 0, 0.95), True, False),  # depth 1 rank 0: 1/2
        ("draft", (1, 1, 0.05), True, False),  # depth 1 rank 1: 0/1
        ("draft", (2, 0, 0.91), True, True), ("draft", (2, 0, 0.5), False, False),  # parent rejected: not counted
        ("suffix", (3, 0), True, True), ("suffix", (3, 0), True, False), ("suffix", (9, 0), True, True),
        ("suffix", (3, 1), True, True), ("suffix", (3, 2), False, False),
    ]
    acc, cal, counts = acceptance_tables(trace, depth=2, width=2)
    assert acc == [[0.5, 0.0], [1.0, 0.0]]
    guess, m = Calibration(), CALIBRATION_PRIOR  # each cell: its hits shrunk toward the guess by m pseudo-candidates
    assert cal.draft[9] == pytest.approx((2 + m * guess.draft[9]) / (3 + m))
    assert cal.draft[0] == pytest.approx(m * guess.draft[0] / (1 + m))
    assert cal.draft[5] == guess.draft[5]  # no data: the default stays
    assert cal.suffix[3] == pytest.approx((1 + m * guess.suffix[3]) / (2 + m))
    assert cal.suffix[-1] == pytest.approx((1 + m * guess.suffix[-1]) / (1 + m))
    assert cal.suffix_next == pytest.approx((1 + m * guess.suffix_next) / (1 + m))
    assert counts == {"draft_candidates": 4, "suffix_candidates": 4}


def test_a_few_candidates_never_calibrate_a_sure_or_hopeless_token():
    """A match length seen five times, all accepted, does not score its candidates as sure tokens, nor five misses
    as worthless; a cell reading below a shorter match's is pooled with it (longer matches never rank lower)."""
    from spectrt.runtime.decoding.tune import acceptance_tables, monotone

    trace = [("suffix", (5, 0), True, True)] * 5 + [("suffix", (4, 0), True, False)] * 5 + \
        [("suffix", (3, 0), True, True)] * 40 + [("suffix", (3, 0), True, False)] * 10
    cal = acceptance_tables(trace, depth=1, width=1)[1]
    assert 0.6 < cal.suffix[5] < 0.9
    assert cal.suffix[4] == cal.suffix[3] > 0.3  # 5 misses at match 4 pooled with 40 of 50 at match 3
    assert list(cal.suffix) == sorted(cal.suffix)
    assert monotone([0.2, 0.6, 0.4, 0.9], [1, 1, 3, 1]) == pytest.approx([0.2, 0.45, 0.45, 0.9])
    assert monotone([0.1, 0.2], [5, 1]) == [0.1, 0.2]


def test_profile_file_curves():
    from spectrt.runtime.decoding.tune import curve_from_profile

    profile = {"backend": "torch", "dtype": "fp32", "threads": 2,
               "target": {"128": {"1": 20.0, "2": 22.0, "4": 30.0}, "1024": {"1": 40.0, "2": 50.0}},
               "draft": {"128": {"1": 4.0, "2": 4.5}}}
    verify = curve_from_profile(profile, "target", context=200)
    assert verify(1) == 20.0 and verify(3) == 26.0
    assert curve_from_profile(profile, "target", context=900)(2) == 50.0
    assert curve_from_profile(profile, "draft")(2) == 4.5
    assert curve_from_profile({"target": {}}, "draft") is None


def _rate(scores, sizes, sunk, verify, base):
    gain = len(scores) + sum(sum(row[:b - 1]) for row, b in zip(scores, sizes, strict=True))
    return gain / (sunk + verify(base + sum(sizes)))


@pytest.mark.parametrize("seed", range(20))
def test_allocate_is_the_best_allocation_and_never_below_plain_batched_decoding(seed):
    """Brute force over every allocation of a small batch: `allocate` finds the best expected tokens per ms, and that
    is never below plain batched decoding (one token per request)."""
    import itertools
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 3)
    scores = [sorted((rng.random() ** 2 for _ in range(rng.randint(0, 4))), reverse=True) for _ in range(n)]
    budgets = [rng.randint(1, 5) for _ in range(n)]
    verify = CostCurve({1: 1.0, 2: 1.0 + rng.random() * 0.3, 4: 1.5 + rng.random(), 8: 3 + 2 * rng.random(),
                        16: 8.0})
    sunk, base = rng.random() * 0.3, rng.randint(0, 6)
    sizes, rate = allocate(scores, budgets, sunk, verify, base)
    assert all(1 <= b <= max(1, min(cap, len(row) + 1)) for b, cap, row in zip(sizes, budgets, scores, strict=True))
    assert rate == pytest.approx(_rate(scores, sizes, sunk, verify, base))
    choices = [range(1, min(cap, len(row) + 1) + 1) for row, cap in zip(scores, budgets, strict=True)]
    best = max(_rate(scores, list(c), sunk, verify, base) for c in itertools.product(*choices))
    assert rate == pytest.approx(best)
    assert rate >= _rate(scores, [1] * n, sunk, verify, base) - 1e-12


def test_allocate_at_batch_one_is_the_per_step_verify_size():
    """The old per-step rule, written out: B maximising (1 + top scores) / (sunk + verify(B))."""
    verify = CostCurve({1: 10.0, 2: 10.5, 4: 12.0, 8: 20.0})
    for scores in ([0.9, 0.5, 0.2, 0.01], [0.05, 0.04], [], [0.99] * 9):
        for sunk in (0.0, 0.7, 5.0):
            rates = [(1 + sum(scores[:b - 1])) / (sunk + verify(b)) for b in range(1, min(8, len(scores) + 1) + 1)]
            want = 1 + max(range(len(rates)), key=lambda i: (rates[i], -i))
            assert allocate([scores], [8], sunk, verify)[0] == [want]
            assert best_size(scores, sunk, verify, 8)[0] == want


def test_allocate_shares_one_budget_across_requests():
    """The best nodes of the whole batch win: a confident request verifies more, a hopeless one stays at its root."""
    verify = CostCurve({1: 10.0, 4: 10.3, 8: 14.0, 16: 30.0})
    sizes, _ = allocate([[0.9, 0.8, 0.7], [0.02, 0.01], [0.6]], [4, 4, 4], 0.0, verify)
    assert sizes == [4, 1, 2]
    steep = CostCurve({1: 10.0, 3: 11.0, 4: 40.0})  # 3 rows fine, a 4th row costs 4x
    sizes, _ = allocate([[0.9], [0.9], [0.9]], [2, 2, 2], 0.0, steep)
    assert sizes == [1, 1, 1]  # three requests: any extra row would more than double the step


def synthetic_table() -> dict:
    """ms = 10 + rows + 2 * segments at context 128; twice the row term at context 1024 (the profile's layout)."""
    from spectrt.runtime.decoding.profile import batch_rows

    return {str(c): {str(s): {str(r): 10 + (1 if c == 128 else 2) * r + 2 * s for r in batch_rows(s)}
                     for s in (1, 2, 4, 8)} for c in (128, 1024)}


def test_batched_cost_interpolates_rows_segments_and_context():
    from spectrt.runtime.decoding.profile import batch_rows

    assert batch_rows(1) == [1, 2, 4, 8, 16, 32, 64] and batch_rows(8) == [8, 16, 32, 64]
    table = synthetic_table()
    cost = BatchedCost.from_json(table)
    assert cost(8, 4) == table["128"]["4"]["8"]  # a grid point is its measurement
    assert cost(12, 4) == pytest.approx(10 + 12 + 8)  # between measured rows
    assert cost(16, 3) == pytest.approx(10 + 16 + 6)  # between measured segment counts
    assert cost(96, 1) == pytest.approx(10 + 96 + 2)  # above the largest rows: the last slope
    # 4 segments start at 4 rows: 3 rows extend their first slope down (not 4 rows' cost: a row must cost a row)
    assert cost(3, 3) == pytest.approx((cost(3, 2) + (10 + 3 + 8)) / 2)
    assert cost(8, 7) - cost(7, 7) == pytest.approx(1.0)
    assert cost(8, 1, 576) == pytest.approx(10 + 1.5 * 8 + 2)  # between contexts
    assert cost(8, 1, 64) == cost(8, 1)  # below the smallest context: flat
    # a step's curve (what allocate reads) agrees with the table at every row count, in the step's context bucket
    curve = cost.curve(4, 100)
    assert all(curve(r) == pytest.approx(cost(r, 4, 128)) for r in range(4, 70))
    with pytest.raises(ValueError, match="at least one row each"):
        cost(2, 4)
    with pytest.raises(ValueError, match="needs measured rows"):
        BatchedCost.from_json({"128": {}})


def test_policy_steps_weigh_the_batched_table_when_tuned_with_one():
    plain = Policy()
    assert plain.verify_at(8, 900) is not None and plain.verify_at(8, 900)(16) == plain.verify_cost(16)
    assert plain.draft_at(900)(16, 8) == plain.draft_cost(16)
    tuned = Policy(verify_batched=BatchedCost.from_json(synthetic_table()),
                   draft_batched=BatchedCost.from_json(synthetic_table()))
    assert tuned.verify_at(8, 128)(16) == pytest.approx(10 + 16 + 16)
    assert tuned.verify_at(8, 1024)(16) == pytest.approx(10 + 32 + 16)  # the same rows cost more at longer context
    assert tuned.draft_at(128)(16, 2) == pytest.approx(10 + 16 + 4)
    again = Policy.from_json(json.loads(json.dumps(tuned.to_json())))
    assert again.verify_batched == tuned.verify_batched and again.draft_batched == tuned.draft_batched
    assert again.verify_at(8, 1024)(16) == tuned.verify_at(8, 1024)(16)


def test_choose_drafted_takes_only_the_requests_whose_draft_pays():
    verify = CostCurve({1: 10.0, 8: 10.0, 16: 20.0})  # flat to 8 rows, then 1.25 ms a row
    free = lambda rows, segments: 0.0  # noqa: E731
    one = [1.0, 1.0, 1.0]
    # flat verify and a free draft: every request with any gain drafts, none with zero gain
    assert choose_drafted([0.5, 0.0, 0.3], one, [2, 2, 2], 3.0, 3, verify, free) == [0, 2]
    # on the steep part: a row (1.25 ms) at 8 tokens per 10 ms needs a gain above 1.25 * 0.8 = 1.0 token
    assert choose_drafted([1.5, 0.4, 0.9], one, [2, 2, 2], 8.0, 8, verify, free) == [0]
    # the same gain bought with three rows costs three rows: 1.5 tokens for 3.75 ms no longer pays
    assert choose_drafted([1.5, 0.4, 0.9], [3.0, 1.0, 1.0], [2, 2, 2], 8.0, 8, verify, free) == []
    # on the flat part rows are free, so the tree's rows do not matter there
    assert choose_drafted([0.5, 0.3], [3.0, 3.0], [2, 2], 2.0, 2, verify, free) == [0, 1]
    # a draft pass that costs more than any gain buys: nobody drafts (= plain batched decoding)
    dear = lambda rows, segments: 50.0  # noqa: E731
    assert choose_drafted([0.9, 0.9], [1.0, 1.0], [1, 1], 2.0, 2, verify, dear) == []
    # never worse than not drafting, by the model, and the best of the prefixes by gain per row
    import random

    def draft(rows, segments):
        return 0.3 * rows + 0.5 * segments

    def rate(subset, gains, rows, catch):
        spent = draft(sum(catch[j] for j in subset), len(subset)) if subset else 0.0
        verified = len(gains) + sum(rows[j] for j in subset)
        return (len(gains) + sum(gains[j] for j in subset)) / (spent + verify(verified))

    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 6)
        gains, catch = [rng.random() for _ in range(n)], [rng.randint(1, 4) for _ in range(n)]
        rows = [rng.uniform(0.5, 4.0) for _ in range(n)]
        pick = choose_drafted(gains, rows, catch, float(n), n, verify, draft)
        order = sorted(range(n), key=lambda j: (-gains[j] / rows[j], catch[j], j))
        assert rate(pick, gains, rows, catch) >= rate([], gains, rows, catch) - 1e-12
        best = max(rate(order[:k], gains, rows, catch) for k in range(n + 1))
        assert rate(pick, gains, rows, catch) == pytest.approx(best)


def test_allocation_gain_is_what_allocate_maximises():
    """The one gain formula (the draft gate and EAGLE-2's next level weigh the allocation with it) is allocate's
    objective: gain / (sunk + verify(rows)) is the rate allocate reports, whatever the batch and the prefills."""
    import random

    rng = random.Random(0)
    verify = CostCurve({1: 10.0, 4: 10.4, 8: 13.0, 16: 24.0, 64: 90.0})
    for _ in range(200):
        scores = [sorted((rng.random() for _ in range(rng.randrange(0, 6))), reverse=True)
                  for _ in range(rng.randrange(1, 5))]
        budgets = [rng.randrange(1, 7) for _ in scores]
        sunk, base, plain = rng.choice([0.0, 0.8, 4.0]), rng.randrange(0, 9), rng.randrange(0, 3)
        sizes, rate = allocate(scores, budgets, sunk, verify, base, plain)
        rows = base + sum(sizes) + plain
        assert allocation_gain(scores, sizes, plain) / (sunk + verify(rows)) == pytest.approx(rate)


def test_a_jobs_draft_rows_start_at_the_tuned_depth_and_follow_its_steps():
    """The rows a job's draft gain comes with: the tuned policy's depth (a sure token's one row untuned) before any
    evidence, then the decayed mean of the draft-only rows its drafted steps verified; undrafted steps fade back."""
    from spectrt.runtime.decoding.controller import DRAFT_GAIN_DECAY, DRAFT_GAIN_PRIOR_STEPS, Controller
    from spectrt.runtime.decoding.decoder import Job
    from spectrt.runtime.decoding.propose import SuffixProposer
    from spectrt.runtime.decoding.tree import AUTO

    def controller(policy):
        return Controller(policy, None, SuffixProposer(1), max_seq_len=64, max_tree_tokens=16, tree_budget=16)

    tuned = controller(Policy(budget=6, depth=3, width=2, draft_gain=1.2))
    job = Job([1, 2, 3], 8, AUTO)
    tuned.start(job)
    assert (job.draft_gain, job.draft_rows) == (1.2, 3.0)
    for _ in range(200):  # every drafted step verified one draft-only row and got half a token from it
        tuned.learn_draft_gain(job, (1, 1) if _ % 2 else (0, 1))
    steps = 1 / (1 - DRAFT_GAIN_DECAY)  # the evidence's weight once it settles, next to the prior's pseudo-steps
    weight = DRAFT_GAIN_PRIOR_STEPS + steps
    assert job.draft_rows == pytest.approx((DRAFT_GAIN_PRIOR_STEPS * 3.0 + steps) / weight, rel=0.02)
    assert job.draft_gain == pytest.approx((DRAFT_GAIN_PRIOR_STEPS * 1.2 + steps / 2) / weight, rel=0.05)
    for _ in range(400):  # not drafted: the evidence fades back to the prior
        tuned.learn_draft_gain(job, None)
    assert job.draft_rows == pytest.approx(3.0, abs=0.1)
    untuned = controller(Policy(budget=6, depth=3, width=2))
    fresh = Job([1, 2, 3], 8, AUTO)
    untuned.start(fresh)
    assert fresh.draft_rows == 1.0


def test_the_gate_charges_a_tuned_trees_level_passes():
    """A tuned gain is what a whole tree earns, so a drafting step is charged its first pass and the `depth - 1`
    level passes of `width` nodes a request; an untuned gain (one sure token) only the first pass. So a load where
    the first pass alone would pay, but not the tree's passes, is left undrafted."""
    from spectrt.runtime.decoding.controller import Controller
    from spectrt.runtime.decoding.propose import SuffixProposer

    def controller(policy):
        return Controller(policy, None, SuffixProposer(1), max_seq_len=64, max_tree_tokens=16, tree_budget=16)

    per_row = dict(draft_ms=((1, 0.1), (9, 0.9)))  # a draft pass costs 0.1 ms a row
    tuned = controller(Policy(budget=6, depth=3, width=2, draft_gain=1.2, **per_row))
    # the first pass over 5 rows, and a level's shape (2 nodes for each of 2 requests) twice
    assert tuned._drafting_cost(128, 2)(5, 2) == pytest.approx(0.5 + 2 * 0.4)
    assert controller(Policy(budget=6, depth=3, width=2, **per_row))._drafting_cost(128, 2)(5, 2) == \
        pytest.approx(0.5)
    # batch 8 at 0.2 ms an extra verified row: one request's tuned gain of 1.2 tokens on 3 rows pays 0.5 ms of
    # draft (9.2 tokens in 9.1 ms against 8 in 8), not the 1.5 ms its tree's three passes cost (9.2 in 10.1)
    verify = CostCurve({1: 8.0, 8: 8.0, 16: 9.6})
    flat = controller(Policy(budget=6, depth=3, width=2, draft_gain=1.2, draft_ms=((1, 0.5),)))
    assert choose_drafted([1.2], [3.0], [3.0], 8.0, 8, verify, lambda rows, k: 0.5) == [0]
    assert choose_drafted([1.2], [3.0], [3.0], 8.0, 8, verify, flat._drafting_cost(128, 1)) == []


def test_the_gate_charges_each_drafted_requests_host_work():
    """`Policy.host_ms` (tuned) is added once per drafted request: at batch 8, where one more verified row costs
    0.2 ms, a request whose draft earns 0.8 tokens on 1 row pays for 0.4 ms of draft pass alone (8.8 tokens in 8.6 ms
    against 8 in 8), not with 0.5 ms of host work on top (8.8 in 9.1)."""
    from spectrt.runtime.decoding.controller import Controller
    from spectrt.runtime.decoding.propose import SuffixProposer

    def gate(host_ms):
        policy = Policy(budget=4, depth=1, width=1, draft_gain=0.8, host_ms=host_ms, draft_ms=((1, 0.4),))
        ms = Controller(policy, None, SuffixProposer(1), max_seq_len=64, max_tree_tokens=16,
                        tree_budget=16)._drafting_cost(128, 3)
        return ms, choose_drafted([0.8], [1.0], [2.0], 8.0, 8, CostCurve({1: 8.0, 8: 8.0, 16: 9.6}), ms)

    (free, chosen_free), (dear, chosen_dear) = gate(0.0), gate(0.5)
    assert free(2, 1) == 0.4 and dear(2, 3) == 0.4 + 3 * 0.5
    assert chosen_free == [0] and chosen_dear == []
    assert Policy.from_json(Policy(host_ms=0.45).to_json()).host_ms == 0.45


def test_a_batch_is_charged_the_first_drafted_requests_host_work_and_less_for_each_further_one():
    """`Policy.host_charge`: `host_ms` for one drafted request, `host_more_ms` for each further one (untuned: `host_ms`
    each). At batch 8, rows at 0.2 ms, two draft passes at 0.4 ms: 8 drafts at 0.8 tokens a row pay with 2.0 + 7 x
    0.05 ms of host work (14.4 tokens in 12.75 ms against 8 in 8), not with 8 x 2.0 (14.4 in 26.4)."""
    from spectrt.runtime.decoding.controller import Controller
    from spectrt.runtime.decoding.propose import SuffixProposer

    shared = Policy(budget=4, depth=2, width=1, draft_gain=0.8, first_level_gain=0.5, host_ms=2.0, host_more_ms=0.05,
                    draft_ms=((1, 0.4),))
    alone = replace(shared, host_more_ms=None)
    assert [shared.host_charge(k) for k in (0, 1, 3)] == [0.0, 2.0, 2.1] and alone.host_charge(3) == 6.0
    assert Policy.from_json(shared.to_json()).host_more_ms == 0.05
    assert Policy.from_json(alone.to_json()).host_more_ms is None

    def gate(policy):
        controller = Controller(policy, None, SuffixProposer(8), max_seq_len=64, max_tree_tokens=16, tree_budget=64)
        ms = controller._drafting_cost(128, 8)
        return controller, choose_drafted([0.8] * 8, [1.0] * 8, [2.0] * 8, 8.0, 8,
                                          CostCurve({1: 8.0, 8: 8.0, 16: 9.6}), ms)

    (controller, chosen_shared), (_, chosen_alone) = gate(shared), gate(alone)
    assert chosen_shared == list(range(8)) and chosen_alone == []
    short = controller._first_level()
    assert (short.host_ms, short.host_more_ms) == (1.0, 0.025)  # a level's share of both


def test_the_gate_may_draft_the_first_level_alone():
    """Where the whole tuned tree does not pay at this load but its first level does (one row, one pass: 0.67
    tokens for 0.6 ms against 1.06 for 1.1 ms, rows at 1 token a ms), the step drafts that level alone; untuned
    for it (no `first_level_gain`), the step does not draft."""
    from spectrt.runtime.decoding.controller import Controller
    from spectrt.runtime.decoding.propose import SuffixProposer

    costs = dict(verify_ms=((1, 8.0), (8, 8.0), (16, 9.6), (64, 30.0)), draft_ms=((1, 0.3), (64, 0.3)))
    tuned = Policy(budget=6, depth=2, width=3, draft_gain=1.06, first_level_gain=0.67, host_ms=0.2, **costs)

    def controller(policy):
        return Controller(policy, None, SuffixProposer(1), max_seq_len=256, max_tree_tokens=16, tree_budget=16)

    with_first = controller(tuned)
    assert with_first.draft_may_pay(8, 128)
    short = with_first._first_level()
    assert (short.depth, short.draft_gain, short.host_ms, short.budget, short.width) == (1, 0.67, 0.1, 6, 3)
    assert with_first._first_level() is short  # one per policy, so `learn` can tell its steps
    assert not controller(replace(tuned, first_level_gain=None)).draft_may_pay(8, 128)
    assert controller(replace(tuned, first_level_gain=None)).draft_may_pay(1, 128)  # alone, the whole tree pays


def test_a_drafting_cost_is_the_draft_passes_and_host_work_it_stands_for():
    """`Policy.drafting_cost(context, n)` at every (rows, requests) a step of up to n requests weighs: its first pass
    (`draft_at`), `depth - 1` level passes of `width` rows a request, `host_charge`, on the batched table and on the
    single curve, and it survives a policy's JSON (no native object in it)."""
    for policy in (Policy(depth=3, width=2, draft_gain=1.1, host_ms=0.3, host_more_ms=0.05),
                   Policy(depth=2, width=3, draft_gain=0.9, host_ms=0.2, draft_batched=BatchedCost.from_json(
                       synthetic_table()), verify_batched=BatchedCost.from_json(synthetic_table()))):
        for context in (100, 700):
            cost, first = policy.drafting_cost(context, 8), policy.draft_at(context)
            for rows in (1, 2.5, 3, 7.25, 16, 40):
                for k in range(1, 9):
                    want = first(rows, k) + (policy.depth - 1) * first(policy.width * k, k) + policy.host_charge(k)
                    assert cost(rows, k) == pytest.approx(want, rel=1e-12), (rows, k)
            assert cost.native() is None or cost.native()(7.25, 3) == cost(7.25, 3)
        assert Policy.from_json(json.loads(json.dumps(policy.to_json()))) == policy


def test_a_step_curve_is_the_batched_table_at_every_measured_row_count():
    """`BatchedCost.curve` (the rows' and segments' interpolation made once per segment count, then each context
    bucket's) holds exactly `BatchedCost.__call__`'s values at the bucket's context, for every segment count (measured
    or between) and bucket; T=1 is the segments' own row count."""
    from spectrt.runtime.decoding.policy import CONTEXT_BUCKET

    cost = BatchedCost.from_json(synthetic_table())
    for segments in range(1, 11):
        for context in (1, 64, 65, 300, 1024, 2000):
            bucket = -(-context // CONTEXT_BUCKET) * CONTEXT_BUCKET
            curve = cost.curve(segments, context)
            assert curve.ms[1] == cost(segments, segments, bucket)
            assert all(ms == cost(r, segments, bucket) for r, ms in curve.ms.items() if r > 1 or segments == 1)
            assert curve is cost.curve(segments, bucket)  # one per bucket


def test_bad_inputs_to_the_budgets_arithmetic_are_refused_not_read():
    """A hand-edited policy with a NaN or negative tuned field is refused naming the fields and the fix; the native
    twins refuse what they cannot read (an out-of-range request, a missing curve) instead of reading out of bounds,
    return NaN for a NaN row count as Python does, and a drafted rate's sums add in order (as the native twin)."""
    from spectrt.runtime.decoding.policy import DraftingCost, drafted_rate_reference
    from spectrt.runtime.engines.kernels import load_kernels

    for field in ("draft_gain", "host_ms", "host_more_ms", "first_level_gain"):
        with pytest.raises(ValueError, match=f"{field}.*spectrt tune"):
            Policy(**{field: float("nan")})
        with pytest.raises(ValueError, match=field):
            Policy(**{field: -1.0})
    flat = DraftingCost((CostCurve({1: 1.0}),), 0, 1, 0.0, 0.0)
    # in order: 0.1 + 0.2 + 0.3 is 0.6000000000000001 (a compensated sum, Python 3.12's `sum`, gives 0.6)
    assert drafted_rate_reference([0, 1, 2], [0.1, 0.2, 0.3], [0.0] * 3, [1.0] * 3, 0.0, 1, lambda t: 1.0,
                                  lambda rows, k: 0.0) == 0.6000000000000001
    native = load_kernels()
    if native is None:
        return
    curve = native.Curve([1.0, 8.0], [1.0, 2.0])
    assert math.isnan(curve(float("nan"))) and curve(4.5) == 1.5
    cost = native.DraftCost([curve], 0, 1, 0.0, 0.0)
    with pytest.raises(ValueError, match="chosen request"):
        native.drafted_rate([3], [1.0], [1.0], [1.0], 1.0, 8.0, curve, cost)
    with pytest.raises(ValueError, match="per request"):
        native.drafted_rate([0], [1.0, 2.0], [1.0], [1.0], 1.0, 8.0, curve, cost)
    with pytest.raises(ValueError, match="no None"):
        native.DraftCost([None], 0, 1, 0.0, 0.0)
    with pytest.raises(ValueError, match="max_occurrences"):
        native.SuffixIndex([1, 2], 4, 2, 0, 32)
    k = torch.zeros(2, 2, 16, 8)
    with pytest.raises(ValueError, match="outside the capacity"):
        native.compact_cache(k, k.clone(), -1, [1])
    assert flat(3, 1) == 1.0


def test_the_gates_costs_follow_the_loops_policy():
    """A loop that swaps its policy (`Decoder.run(policy=...)`, the tuner) keeps no drafting costs of the old one."""
    from spectrt.runtime.decoding.controller import Controller
    from spectrt.runtime.decoding.propose import SuffixProposer

    first, second = Policy(depth=2, draft_gain=1.0), Policy(depth=3, draft_gain=1.2)
    controller = Controller(first, None, SuffixProposer(1), max_seq_len=64, max_tree_tokens=16, tree_budget=16)
    controller._drafting_cost(128, 2)
    controller.policy = second
    cost = controller._drafting_cost(300, 4)
    assert [owner for owner, _ in controller._costs.values()] == [second] and cost.levels == 2


@pytest.mark.unit
def test_a_precision_nobody_tuned_borrows_this_machines_tuned_policy(tmp_path):
    """`--dtype fp32` after `make demo` (which tunes bf16): the untuned default's curve (another machine's) priced
    trees too cheap and lost to AR on a prompt; the policy tuned here for bf16 is used instead, with a warning naming
    the command that tunes fp32, and its expected rate on this machine's measured curve is at least AR's."""
    from spectrt.runtime.decoding.pipeline import default_policy
    from spectrt.runtime.decoding.policy import policy_path, rank_policies

    verify = CostCurve({1: 10.2, 2: 12.6, 4: 13.7, 8: 17.9, 16: 34.2})  # measured on this class (bf16, ms)
    draft = CostCurve({1: 1.1, 2: 1.2, 4: 1.3, 8: 1.8, 16: 2.6})
    acceptance = [[0.55, 0.15], [0.5, 0.12], [0.45, 0.1]]
    best, rate = rank_policies(verify, draft, acceptance, [2, 4, 8], [1, 2, 3], [1, 2])[0]
    target, head = tmp_path / "model", tmp_path / "model-draft"
    policy_path(tmp_path, target.name, head.name, "bf16").write_text(json.dumps({"policy": best.to_json()}))
    with pytest.warns(UserWarning, match=r"no speculation policy tuned for fp32 here: using the one tuned for bf16 .*"
                                         r"`spectrt tune --dtype fp32`"):
        borrowed = default_policy(target, head, "fp32", tmp_path)
    assert borrowed == best and rate >= 1 / verify(1)
    assert default_policy(target, head, "bf16", tmp_path) == best  # its own precision: no warning needed
    assert default_policy(target, tmp_path / "other-draft", "fp32", tmp_path) == Policy()  # another draft's: none
