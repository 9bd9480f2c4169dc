"""The one decode loop with many requests (fp32): batched == each request's sequential run for every proposer,
joins and leaves mid-run, cut static trees, the budget shrinking to plain batched decoding, draft positions,
cancellation, constraints, and failure isolation. The native forward runs them; joins and constraints also run on
the torch reference path (`models` parametrized indirectly with a FORWARD_PATHS name)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import FORWARD_PATHS, engine_pair
from spectrt.runtime.decoding.decoder import AUTO, Decoder, Job
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.sampling import SamplingParams
from spectrt.runtime.decoding.tree import Tree, cut_tree

PROMPTS = ["Write a short poem about the sea.", "Name three colors.", "What is 12 times 15? Explain briefly.",
           "List five animals that live in the ocean.", "What is the capital of France?",
           "Give three tips for learning a new language, with one example each, in detail.",
           "Repeat exactly: red apple, green pear, red apple, green pear, red apple, green pear."]
FLAT = ((1, 1.0), (64, 1.0))  # verify cost flat in T: every candidate with a chance is verified (big trees)
# flat costs and a free draft: every candidate is drafted and verified whatever the batch, so a request's trees (and
# with them its random draws under sampling) are the same alone and batched
DYNAMIC = Policy(budget=6, depth=2, width=2, verify_ms=FLAT, draft_ms=((1, 1e-6),))


@pytest.mark.parametrize("spec", ["2,1", "3,2,2,1,1", "1,1,1,1", "4"])
def test_cut_tree_is_connected_and_keeps_rank_prefixes(spec):
    tree = Tree.parse(spec)
    for n in range(1, len(tree) + 1):
        cut = cut_tree(tree, n)
        assert len(cut) == n
        kept = [0]  # map the cut's nodes back: each node's path of sibling ranks exists in the full tree
        for i in range(1, n):
            p = cut.parents[i]
            kept.append(tree.children[kept[p]][cut.ranks[i]])
        for i in range(1, n):  # every kept node's earlier siblings are kept too (rank-order prefix)
            assert cut.ranks[i] == tree.ranks[kept[i]]
    assert cut_tree(tree, 1) == Tree((-1,))
    assert cut_tree(Tree.parse("2,1"), 3).parents == (-1, 0, 1)  # the top-1 chain before the second child


@pytest.fixture(scope="module")
def models(request, target_dir):
    from transformers import AutoTokenizer

    target, draft = engine_pair(request, getattr(request, "param", "native"))
    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in PROMPTS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    return target, draft, {tok.eos_token_id}, prompts, tok


def _sequential(models, jobs: list[Job], policy: Policy = DYNAMIC) -> list[list[int]]:
    """Each job alone, through `generate` (a batch of one)."""
    target, draft, eos, _, _ = models
    dec = Decoder(target, draft, eos, max_seq_len=256)
    out = []
    for j in jobs:
        tree, pol = (None, policy) if j.tree == AUTO else (j.tree, policy if j.suffix else None)
        if j.tree is None and j.suffix:  # draft-less speculation: suffix candidates only
            pol = replace(policy, draft=False, depth=0)
        out.append(dec.generate(j.prompt_ids, j.max_new_tokens, tree, params=j.params, children=j.children,
                                policy=pol).token_ids)
    return out


def _jobs(models, trees, lengths, params=None, suffix=None):
    prompts = models[3]
    return [Job(prompts[i % len(prompts)], m, t, params=(params or {}).get(i, SamplingParams()),
                suffix=(suffix or {}).get(i))
            for i, (t, m) in enumerate(zip(trees, lengths, strict=True))]


def _run(decoder: Decoder, jobs: list[Job]) -> list:
    steps, waiting = [], list(jobs)
    while waiting or decoder.active:
        while waiting and decoder.free:
            decoder.add(waiting.pop(0))
        steps.append(decoder.step())
    return steps


def test_forward_many_equals_one_forward_per_segment(models):
    target, _, _, prompts, _ = models
    caches = target.new_caches(3, 128, 32)
    ref_caches = [target.new_cache(128, 32) for _ in range(3)]
    causal = torch.ones(32, 32, dtype=torch.bool).tril()
    segs, refs = [], []
    for ids, cache, ref_cache in zip(prompts[:3], caches, ref_caches, strict=True):
        t = min(len(ids), 20)
        args = (torch.tensor(ids[:t]), torch.arange(t), causal[:t, :t])
        segs.append((*args, cache))
        refs.append(target.forward(*args, ref_cache))
    for got, want, cache, ref_cache in zip(target.forward_many(segs), refs, caches, ref_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(cache.k, ref_cache.k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("models", FORWARD_PATHS, indirect=True)
def test_batched_static_trees_equal_sequential_with_joins_and_leaves(models):
    """7 requests, 3 slots: different prompts, trees and lengths; prompts prefilled in 8-token chunks that share
    steps with decoding, so requests join and leave mid-run."""
    target, draft, eos, _, _ = models
    trees = [Tree.parse("2,1"), None, Tree.parse("3,1,1"), Tree.parse("1,1,1"), Tree.parse("2,1"), None,
             Tree.parse("2,2")]
    jobs = _jobs(models, trees, [12, 20, 7, 16, 9, 5, 14])
    steps = _run(Decoder(target, draft, eos, max_seq_len=256, max_active=3, prefill_budget=8), jobs)
    assert any(s.prefill_tokens and s.tree_tokens for s in steps), "prefill must share steps with decoding"
    assert max(s.active for s in steps) == 3
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want
        assert job.finish in ("stop", "length")


def test_batched_dynamic_trees_and_suffix_candidates_equal_sequential(models):
    """Dynamic trees (draft + suffix), draft-less suffix speculation, a static tree with suffix candidates and plain
    AR requests in one batch, joining and leaving: every output equals the request's own run."""
    target, draft, eos, _, _ = models
    trees = [AUTO, AUTO, Tree.parse("2,1"), None, AUTO, AUTO, AUTO]
    suffix = {2: True, 3: True}  # the static tree merges suffix candidates; job 3 is suffix-only speculation
    jobs = _jobs(models, trees, [24, 18, 20, 24, 10, 22, 30], suffix=suffix)
    decoder = Decoder(target, draft, eos, max_seq_len=256, max_active=4, prefill_budget=16, policy=DYNAMIC)
    decoder.record = True
    steps = _run(decoder, jobs)
    assert max(s.active for s in steps) == 4
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want
    kinds = {kind for job in jobs for kind, _, _, accepted in job.stats.trace if accepted}
    assert kinds == {"draft", "suffix"}, "both proposers must have had candidates accepted in the batch"
    assert max(max(j.stats.verified) for j in jobs if j.tree == AUTO) > 2  # real trees, not single tokens


def test_seeded_sampling_in_a_batch_equals_sequential(models):
    """Per-request sampling params, seeds, static and dynamic trees in one batch: each draws from its own streams."""
    target, draft, eos, _, _ = models
    params = {0: SamplingParams(0.8, 0, 0.95, seed=3), 1: SamplingParams(1.0, 20, 1.0, seed=4),
              2: SamplingParams(), 3: SamplingParams(0.7, seed=5), 4: SamplingParams(0.9, seed=6)}
    jobs = _jobs(models, [Tree.parse("2,1"), Tree.parse("3,1"), Tree.parse("2,1"), None, AUTO], [10] * 5, params)
    jobs[1].children = "topk"
    Decoder(target, draft, eos, max_seq_len=256, max_active=5, policy=DYNAMIC).run(jobs)
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want


def test_row_cap_cuts_static_trees_and_outputs_stay_equal(models):
    target, draft, eos, _, _ = models
    jobs = _jobs(models, [Tree.parse("2,1")] * 4, [10, 10, 10, 10])
    Decoder(target, draft, eos, max_seq_len=256, max_active=4, tree_budget=6).run(jobs)
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want
    assert all(job.stats.proposed < 2 * job.stats.target_passes for job in jobs), "trees must have been cut"


def test_tree_budget_caps_dynamic_trees_and_suffix_candidates_too(models):
    """`tree_budget` bounds a step's tree rows over all requests whatever proposed them: four dynamic-tree requests
    and a static tree with suffix candidates under a budget of 8 rows (roots included), outputs unchanged. (Only
    static shapes were cut: the flat-cost policy verified up to 6 nodes a request, ~20 rows a step.)"""
    target, draft, eos, _, _ = models
    trees = [AUTO, AUTO, AUTO, Tree.parse("2,1"), AUTO]
    jobs = _jobs(models, trees, [20, 20, 20, 20, 20], suffix={3: True})
    decoder = Decoder(target, draft, eos, max_seq_len=256, max_active=4, prefill_budget=16, policy=DYNAMIC,
                      tree_budget=8)
    steps = _run(decoder, jobs)
    assert max(s.tree_tokens for s in steps) == 8  # the cap binds, and holds
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want


def test_trees_stop_where_the_output_must_end(models):
    """A request with one token left verifies its root alone (a deeper node could only emit tokens past its end),
    and what a step reports accepted never exceeds what it kept."""
    target, draft, eos, _, _ = models
    jobs = _jobs(models, [Tree.parse("2,2"), AUTO, Tree.parse("1,1,1")], [1, 1, 3])
    Decoder(target, draft, eos, max_seq_len=256, max_active=3, policy=DYNAMIC).run(jobs)
    assert [j.stats.verified for j in jobs[:2]] == [[1], [1]]
    assert all(sum(j.stats.accepted) <= len(j.out) for j in jobs)
    assert all(max(j.stats.verified) <= 1 + 2 for j in jobs)  # 3 tokens: depth 2 at most (1,1,1 is cut)
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want


def test_budget_degrades_to_plain_batched_decoding_as_the_batch_grows(models):
    """A cost curve where one extra row is worth it for one request but not when 4 share the forward: alone a
    request verifies trees; four together decode one token each, and the draft is skipped."""
    target, draft, eos, _, _ = models
    # 1 row: 1.0, 2 rows: 1.1 (a tree pays), 4 rows: 4.0, 5+ rows: steep (any tree in a batch of 4 loses)
    steep = Policy(budget=4, depth=2, width=2, verify_ms=((1, 1.0), (2, 1.1), (3, 1.2), (4, 4.0), (5, 9.0)),
                   draft_ms=((1, 0.01),))
    alone = Job(models[3][1], 16, AUTO)
    Decoder(target, draft, eos, max_seq_len=256, policy=steep).run([alone])
    assert max(alone.stats.verified) > 1
    jobs = _jobs(models, [AUTO] * 4, [16] * 4)
    decoder = Decoder(target, draft, eos, max_seq_len=256, max_active=4, policy=steep)
    steps = _run(decoder, jobs)
    full = [s for s in steps if s.active == 4 and not s.prefill_tokens]
    assert full and all(s.tree_tokens == 4 for s in full)
    for job, want in zip(jobs, _sequential(models, jobs, steep), strict=True):
        assert job.out == want


def test_requests_the_budget_keeps_plain_stop_proposing_until_the_batch_shrinks(models):
    """Counters: at batch 4 under a cost curve where no extra row pays, a request whose candidates the budget left
    unverified twice in a row holds (`Controller._idle`): it proposes once after each hold, each hold in a row twice
    as long (4, 8, 16, 32 steps; fixed 4-step holds made 37 proposals in 38 steps here, the doubling 21), and the
    draft never runs for it; alone again (the others finished), it proposes and verifies trees every step.
    Outputs stay each request's sequential greedy run."""
    from spectrt.runtime.decoding.controller import HOLD_STEPS, IDLE_STEPS, MAX_HOLD_STEPS

    target, draft, eos, _, _ = models
    steep = Policy(budget=4, depth=2, width=2, verify_ms=((1, 1.0), (2, 1.1), (3, 1.2), (4, 4.0), (5, 9.0)),
                   draft_ms=((1, 0.01),))
    prompts = models[3]
    lengths = [40, 40, 40, 64]
    jobs = [Job(prompts[i], n, AUTO, min_length=n) for i, n in enumerate(lengths)]
    decoder = Decoder(target, draft, eos, max_seq_len=256, max_active=4, policy=steep)
    proposals, propose = [], decoder.controller.suffix.propose
    decoder.controller.suffix.propose = lambda cand, *a: (proposals.append((len(decoder.active), cand.job)),
                                                          propose(cand, *a))[1]
    steps = _run(decoder, jobs)
    full = [s for s in steps if s.active == 4 and not s.prefill_tokens]
    in_full = sum(n == 4 for n, _ in proposals)
    assert len(full) > 2 * (IDLE_STEPS + HOLD_STEPS)
    most, done, holds = IDLE_STEPS, IDLE_STEPS, 0  # one request's proposals in len(full) steps: holds double
    while done < len(full):
        done, most, holds = done + min(HOLD_STEPS << holds, MAX_HOLD_STEPS) + 1, most + 1, holds + 1
    assert in_full <= 4 * (most + 1), "held requests must not propose, and a hold in a row lasts twice as long"
    assert all(s.tree_tokens == 4 for s in full)
    long = jobs[3]
    alone = [n for n, job in proposals if job is long and n == 1]
    assert alone and max(long.stats.verified[-len(alone):]) > 1, "alone, the request speculates again"
    assert len(alone) == sum(1 for s in steps if s.active == 1 and not s.prefill_tokens)
    for i, job in enumerate(jobs):
        want = Job(prompts[i], lengths[i], AUTO, min_length=lengths[i])
        Decoder(target, draft, eos, max_seq_len=256, policy=steep).run([want])
        assert job.out == want.out


class RecordingEngine:
    """Wraps an engine and records every segment's (tokens, positions, tree mask, committed length)."""

    def __init__(self, engine):
        self.engine, self.config, self.calls = engine, engine.config, []

    def new_caches(self, *args):
        return self.engine.new_caches(*args)

    def forward_many(self, segments, logit_rows=None):
        self.calls.append([(s[0].tolist(), s[1].tolist(), s[2].clone(), s[3].length) for s in segments])
        return self.engine.forward_many(segments, logit_rows)


@pytest.mark.parametrize("tree", [Tree.parse("2,2,1"), AUTO])
def test_draft_and_target_positions_are_prefix_length_plus_depth(models, tree):
    """Every row an engine sees sits at position = committed prefix + window slots before it on its own path:
    a tree node at (root position + depth), the root at its prefix length (the off-by-one of the old batched
    draft would put every draft level one position too high)."""
    target, draft, eos, prompts, _ = models
    rec_target, rec_draft = RecordingEngine(target), RecordingEngine(draft)
    jobs = _jobs(models, [tree, tree], [20, 20])
    Decoder(rec_target, rec_draft, eos, max_seq_len=256, max_active=2, policy=DYNAMIC).run(jobs)
    assert len(rec_draft.calls) > 5
    for engine in (rec_target, rec_draft):
        for call in engine.calls:
            for tokens, positions, mask, length in call:
                window = mask.shape[1]
                for row, pos in enumerate(positions):
                    own = window - len(tokens) + row  # this row's window slot
                    assert mask[row, own]
                    assert pos == length + int(mask[row, :own].sum()), (engine is rec_draft, positions)


def test_cancel_frees_the_slot_and_leaves_the_others_intact(models):
    target, draft, eos, _, _ = models
    jobs = _jobs(models, [Tree.parse("2,1"), AUTO, AUTO], [16, 16, 16])
    batch = Decoder(target, draft, eos, max_seq_len=256, max_active=2, policy=DYNAMIC)
    batch.add(jobs[0])
    batch.add(jobs[1])
    batch.step()
    batch.step()
    batch.cancel(jobs[0])
    assert jobs[0].finish == "cancelled" and len(batch.free) == 1
    batch.add(jobs[2])
    while batch.active:
        batch.step()
    for job, want in zip(jobs[1:], _sequential(models, jobs[1:]), strict=True):
        assert job.out == want


@pytest.mark.parametrize("models", FORWARD_PATHS, indirect=True)
def test_min_length_bad_words_and_stop_words(models):
    """Alone and in a batch of 3, on both forward paths (the torch path's logits were inference tensors, which the
    in-place masking refused: every constrained request ended in "error")."""
    target, draft, eos, prompts, _ = models
    short = Job(prompts[4], 40, Tree.parse("2,1"))  # "capital of France": ends early with end-of-sequence
    Decoder(target, draft, eos, max_seq_len=256).run([short])
    assert short.finish == "stop" and len(short.out) < 20
    alone = Job(prompts[4], 40, AUTO, min_length=len(short.out) + 2, bad_words=[[short.out[1]]])
    Decoder(target, draft, eos, max_seq_len=256, policy=DYNAMIC).run([alone])
    assert alone.error is None and len(alone.out) >= len(short.out) + 2 and short.out[1] not in alone.out
    longer = Job(prompts[4], 40, Tree.parse("2,1"), min_length=len(short.out) + 6)
    banned = Job(prompts[4], 40, AUTO, bad_words=[[short.out[1]], short.out[3:5]])
    stop = Job(prompts[4], 40, AUTO, stop_words=[short.out[2:4], [49151, 49150]])
    Decoder(target, draft, eos, max_seq_len=256, max_active=3, policy=DYNAMIC).run([longer, banned, stop])
    assert [j.error for j in (longer, banned, stop)] == [None] * 3
    assert len(longer.out) >= len(short.out) + 6 and longer.out[:len(short.out)] == short.out
    assert short.out[1] not in banned.out and banned.out[:1] == short.out[:1]
    assert all(banned.out[i:i + 2] != short.out[3:5] for i in range(len(banned.out)))
    assert stop.out == short.out[:4] and stop.finish == "stop"


@pytest.mark.parametrize("models", FORWARD_PATHS, indirect=True)
def test_stop_words_longer_than_the_output_so_far_are_found_across_steps(models):
    """The tail checked before a step's tokens is the whole output while it is shorter than a word minus one: a
    4-token word emitted over two speculative steps of 2 tokens each (the target as its own draft), and a 3-token
    word next to a 5-token one in plain decoding, both stop where the target alone stops (a negative slice start
    kept too few tokens: both ran past their stop word)."""
    target, _, eos, prompts, _ = models
    ar = Job(prompts[0], 24)
    Decoder(target, None, eos, max_seq_len=256).run([ar])
    spec = Job(prompts[0], 24, Tree.parse("1"), stop_words=[ar.out[:4]])
    Decoder(target, target, eos, max_seq_len=256).run([spec])
    assert spec.stats.accepted[:2] == [1, 1] and spec.out == ar.out[:4] and spec.finish == "stop"
    plain = Job(prompts[0], 24, stop_words=[ar.out[1:4], [49151, 49150, 49151, 49150, 49151]])
    Decoder(target, None, eos, max_seq_len=256).run([plain])
    assert plain.out == ar.out[:4] and plain.finish == "stop"


def test_a_static_tree_near_max_seq_len_verifies_only_the_levels_that_fit(models, monkeypatch):
    """With 2 positions left a 3,1,1 tree verifies its first level (4 nodes: a depth-1 path and its bonus token fill
    them), none past max_seq_len (the cut by rank kept 7 nodes with the top-1 chain to depth 3: rows drafted and
    verified past the sequence's end)."""
    target, draft, eos, prompts, _ = models
    max_seq_len = len(prompts[0]) + 2
    positions = []
    real = target.forward_many

    def forward_many(segments, logit_rows=None):
        positions.extend(int(s[1].max()) for s in segments)
        return real(segments, logit_rows)

    monkeypatch.setattr(target, "forward_many", forward_many)
    job = Job(prompts[0], 8, Tree.parse("3,1,1"))
    Decoder(target, draft, eos, max_seq_len=max_seq_len).run([job])
    assert job.stats.verified[0] == 4 and max(positions) < max_seq_len
    assert len(job.out) <= 2 and job.finish in ("length", "stop")


def test_bad_job_is_refused_before_taking_a_slot(models):
    target, draft, eos, prompts, _ = models
    batch = Decoder(target, draft, eos, max_seq_len=64, max_tree_tokens=8, max_active=1)
    vocab = target.config.vocab_size
    for job, message in ((Job([], 4), "empty"), (Job(prompts[0], 0), "max_new_tokens"),
                         (Job(list(range(70)), 4), "max_seq_len"), (Job(prompts[0], 4, Tree.parse("3,3")), "max_tree"),
                         (Job(prompts[0], 4, children="x"), "children"),
                         (Job([1, 2, vocab], 4), "outside this model's vocabulary"),
                         (Job(prompts[0], 4, stop_words=[[vocab + 5]]), "stop_words"),
                         (Job(prompts[0], 4, bad_words=[[]]), "bad_words"),
                         (Job(prompts[0], 4, tree="wide"), "a job's tree")):
        with pytest.raises(ValueError, match=message):
            batch.add(job)
    assert batch.free == [0]


class PoisonedEngine(RecordingEngine):
    """Raises on any forward that holds a row of the poisoned slot, once armed (a failing request)."""

    slot: int | None = None

    def forward_many(self, segments, logit_rows=None):
        if self.slot is not None and any(s[3].slot == self.slot for s in segments):
            raise RuntimeError("poisoned request")
        return self.engine.forward_many(segments, logit_rows)


def test_a_failed_step_replays_the_other_requests_draws_exactly(models):
    """A seeded sampled request with a static tree draws its children before the target forward; when another
    request's failure rolls that step back, its retry alone draws the same children again: its tokens and draft
    passes equal a run where nothing failed (the draft generator and the controller's state are part of what a failed
    step restores; before, only cache lengths were, and the request's tokens changed)."""
    target, draft, eos, prompts, _ = models

    def run(poison: bool) -> tuple[Job, Job]:
        poisoned = PoisonedEngine(target)
        decoder = Decoder(poisoned, draft, eos, max_seq_len=256, max_active=2, prefill_budget=256)
        seeded = Job(prompts[0], 16, Tree.parse("2,1"), params=SamplingParams(temperature=1.0, seed=7))
        other = Job(prompts[1], 16)
        decoder.add(seeded)
        decoder.add(other)
        decoder.step()  # both prompts prefilled
        decoder.step()
        if poison:
            poisoned.slot = other.slot
        while decoder.active:
            decoder.step()
        return seeded, other

    clean, _ = run(False)
    seeded, other = run(True)
    assert other.finish == "error" and seeded.error is None
    assert seeded.out == clean.out and seeded.stats.draft_passes == clean.stats.draft_passes


def test_a_failing_request_ends_alone_and_the_batch_goes_on(models):
    """Three requests decode together; one starts to fail mid-run. It ends with finish "error" and its message; a
    request that finishes in that same step is still reported finished; the third carries on unchanged."""
    target, draft, eos, prompts, _ = models
    poisoned = PoisonedEngine(target)
    decoder = Decoder(poisoned, draft, eos, max_seq_len=256, max_active=3, prefill_budget=256, policy=DYNAMIC)
    done, steady, doomed = Job(prompts[0], 2), Job(prompts[1], 16, Tree.parse("2,1")), Job(prompts[2], 16, AUTO)
    for job in (done, steady, doomed):
        decoder.add(job)
    decoder.step()  # all three prompts prefilled
    decoder.step()  # one decode step: `done` needs at most one more
    assert done.finish is None and len(done.out) < 2
    poisoned.slot = doomed.slot
    info = decoder.step()
    assert doomed.finish == "error" and "poisoned request" in doomed.error
    assert done.finish == "length" and done in info.finished and doomed in info.finished
    assert doomed not in decoder.active and doomed.slot in decoder.free
    while decoder.active:
        decoder.step()
    assert steady.out == _sequential(models, [steady])[0]
    assert done.out == _sequential(models, [done])[0]
