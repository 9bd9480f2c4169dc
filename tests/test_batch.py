"""In-flight batching: cut trees, and the batched decoder against each request's sequential run (fp32)."""

from __future__ import annotations

import pytest
import torch
from spectrt.runtime.batch import BatchDecoder, Job, cut_tree
from spectrt.runtime.decoder import SpecDecoder
from spectrt.runtime.sampling import SamplingParams
from spectrt.runtime.tree import Tree

PROMPTS = ["Write a short poem about the sea.", "Name three colors.", "What is 12 times 15? Explain briefly.",
           "List five animals that live in the ocean.", "What is the capital of France?",
           "Give three tips for learning a new language, with one example each, in detail."]


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
def models(target, draft, target_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
               for p in PROMPTS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    return target, draft, {tok.eos_token_id}, prompts, tok


def _sequential(models, jobs: list[Job]) -> list[list[int]]:
    target, draft, eos, _, _ = models
    dec = SpecDecoder(target, draft, eos, max_seq_len=256)
    return [dec.generate(j.prompt_ids, j.max_new_tokens, j.tree, params=j.params, children=j.children).token_ids
            for j in jobs]


def _jobs(models, trees, lengths, params=None):
    prompts = models[3]
    return [Job(prompts[i % len(prompts)], m, t, params=(params or {}).get(i, SamplingParams()))
            for i, (t, m) in enumerate(zip(trees, lengths, strict=True))]


def test_forward_many_equals_one_forward_per_segment(models):
    target, _, _, prompts, _ = models
    caches = [target.new_cache(128, 32) for _ in range(3)]
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


def test_batched_greedy_equals_sequential_with_joins_and_leaves(models):
    """7 requests, 3 slots: different prompts, trees and lengths; prompts prefilled in 8-token chunks that share
    steps with decoding, so requests join and leave mid-run."""
    target, draft, eos, _, _ = models
    trees = [Tree.parse("2,1"), None, Tree.parse("3,1,1"), Tree.parse("1,1,1"), Tree.parse("2,1"), None,
             Tree.parse("2,2")]
    jobs = _jobs(models, trees, [12, 20, 7, 16, 9, 5, 14])
    batch = BatchDecoder(target, draft, eos, max_seq_len=256, max_active=3, prefill_budget=8)
    steps = []
    waiting = list(jobs)
    while waiting or batch.active:
        while waiting and batch.free:
            batch.add(waiting.pop(0))
        steps.append(batch.step())
    assert any(s.prefill_tokens and s.tree_tokens for s in steps), "prefill must share steps with decoding"
    assert max(s.active for s in steps) == 3
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want
        assert job.finish in ("stop", "length")


def test_budget_cuts_trees_and_outputs_stay_equal(models):
    target, draft, eos, _, _ = models
    jobs = _jobs(models, [Tree.parse("2,1")] * 4, [10, 10, 10, 10])
    batch = BatchDecoder(target, draft, eos, max_seq_len=256, max_active=4, tree_budget=6)
    batch.run(jobs)
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want
    assert all(job.proposed < 4 * job.stats.target_passes for job in jobs), "trees must have been cut"


def test_sampled_requests_with_seeds_match_their_sequential_runs(models):
    """Per-request sampling params, seeds and trees in one batch: each stream draws from its own generators."""
    target, draft, eos, _, _ = models
    params = {0: SamplingParams(0.8, 0, 0.95, seed=3), 1: SamplingParams(1.0, 20, 1.0, seed=4),
              2: SamplingParams(), 3: SamplingParams(0.7, seed=5)}
    jobs = _jobs(models, [Tree.parse("2,1"), Tree.parse("3,1"), Tree.parse("2,1"), None], [10, 10, 10, 10], params)
    jobs[1].children = "topk"
    BatchDecoder(target, draft, eos, max_seq_len=256, max_active=4).run(jobs)
    for job, want in zip(jobs, _sequential(models, jobs), strict=True):
        assert job.out == want


def test_cancel_frees_the_slot_and_leaves_the_others_intact(models):
    target, draft, eos, _, _ = models
    jobs = _jobs(models, [Tree.parse("2,1")] * 3, [16, 16, 16])
    batch = BatchDecoder(target, draft, eos, max_seq_len=256, max_active=2)
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


def test_min_length_bad_words_and_stop_words(models):
    target, draft, eos, prompts, _ = models
    short = Job(prompts[4], 40, Tree.parse("2,1"))  # "capital of France": ends early with end-of-sequence
    BatchDecoder(target, draft, eos, max_seq_len=256, max_active=1).run([short])
    assert short.finish == "stop" and len(short.out) < 20
    longer = Job(prompts[4], 40, Tree.parse("2,1"), min_length=len(short.out) + 6)
    banned = Job(prompts[4], 40, Tree.parse("2,1"), bad_words=[[short.out[1]], short.out[3:5]])
    stop = Job(prompts[4], 40, Tree.parse("2,1"), stop_words=[short.out[2:4], [999999]])
    BatchDecoder(target, draft, eos, max_seq_len=256, max_active=3).run([longer, banned, stop])
    assert len(longer.out) >= len(short.out) + 6 and longer.out[:len(short.out)] == short.out
    assert short.out[1] not in banned.out and banned.out[:1] == short.out[:1]
    assert all(banned.out[i:i + 2] != short.out[3:5] for i in range(len(banned.out)))
    assert stop.out == short.out[:4] and stop.finish == "stop"


def test_bad_job_is_refused_before_taking_a_slot(models):
    target, draft, eos, prompts, _ = models
    batch = BatchDecoder(target, draft, eos, max_seq_len=64, max_tree_tokens=8, max_active=1)
    for job, message in ((Job([], 4), "empty"), (Job(prompts[0], 0), "max_new_tokens"),
                         (Job(list(range(70)), 4), "max_seq_len"), (Job(prompts[0], 4, Tree.parse("3,3")), "max_tree"),
                         (Job(prompts[0], 4, children="x"), "children")):
        with pytest.raises(ValueError, match=message):
            batch.add(job)
    assert batch.free == [0]
