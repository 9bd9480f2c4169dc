"""The decode loop as a batch of one, on the real embedded model: lossless greedy tree decoding against an
independent autoregressive reference (the engine's forward, one token at a time, no decoder code), on the native
forward in bf16 and (a shorter run) the torch reference path in fp32; speculation refused where an engine is not
exact; static KV, limits, sampling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import EOS, FORWARD_PATHS, PROMPTS, engine_pair
from spectrt.build.slice import slice_target
from spectrt.runtime.decoding.decoder import AUTO, Decoder, Job
from spectrt.runtime.decoding.policy import BatchedCost, Policy
from spectrt.runtime.decoding.sampling import SamplingParams
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.engine import SegmentBuffers
from spectrt.runtime.engines.model import Transformer


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


# The loop tests decode 5 chat prompts x 96 tokens: every tree shape below reaches rejections, partial paths and
# compactions within that (asserted); one test runs 320 tokens, and test_kernels/test_batch decode the other prompts.
LOOP_PROMPTS = 5
NEW_TOKENS = 96


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"])
            for p in PROMPTS[:LOOP_PROMPTS]]


@pytest.fixture(scope="module")
def target(target_dir) -> Transformer:
    """The loop's tests decode in bf16 on the native forward: as exact as fp32 there (row-invariant kernels,
    test_kernels checks it on every ISA) and ~1.8x faster on 2 cores. fp32 decoding is checked here on the torch
    path and in test_batch on both paths."""
    engine = Transformer.load(target_dir, torch.bfloat16)
    assert engine.native is not None and engine.inexact is None, "the native forward must build here (make setup)"
    return engine


@pytest.fixture(scope="module")
def mid_draft(target_dir, tmp_path_factory) -> Transformer:
    """The first 20 of 30 layers: agrees with the target often, so long paths get accepted and compacted."""
    return Transformer.load(slice_target(target_dir, 20, tmp_path_factory.mktemp("slice20")), torch.bfloat16)


def reference_greedy(engine, prompt: list[int], max_new_tokens: int, eos: set[int]) -> list[int]:
    """Greedy decoding straight on the engine: prompt in causal chunks, then one token per forward."""
    cache = engine.new_cache(len(prompt) + max_new_tokens + 64, 64)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    for start in range(0, len(prompt), 64):
        chunk = prompt[start:start + 64]
        logits = engine.forward(torch.tensor(chunk), torch.arange(start, start + len(chunk)),
                                causal[:len(chunk), :len(chunk)], cache)
        cache.commit(len(chunk))
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = int(logits[-1].argmax())
        if token in eos:
            break
        out.append(token)
        logits = engine.forward(torch.tensor([token]), torch.tensor([cache.length]), causal[:1, :1], cache)
        cache.commit(1)
    return out


@pytest.fixture(scope="module")
def ar_outputs(target, prompt_ids) -> list[list[int]]:
    return [reference_greedy(target, ids, NEW_TOKENS, EOS) for ids in prompt_ids]


def test_decoder_ar_equals_the_independent_reference(target, prompt_ids, ar_outputs):
    decoder = Decoder(target, None, EOS, max_seq_len=512)
    for ids, expected in zip(prompt_ids, ar_outputs, strict=True):
        assert decoder.generate(ids, NEW_TOKENS).token_ids == expected


@pytest.mark.parametrize("draft_name, spec", [
    ("weak", "3,2,1"),        # untrained 4-layer slice, wide tree: mostly rejections
    ("mid", "2,2,1"),         # untrained 20-layer slice: partial paths, second-ranked children
    ("target", "2,1,1"),      # the target drafting for itself: whole paths accepted every pass
    ("target", "1,1,1,1"),    # chain
])
def test_greedy_tree_decoding_is_lossless(request, target, prompt_ids, ar_outputs, draft_name, spec):
    draft = {"weak": "draft", "mid": "mid_draft", "target": "target"}[draft_name]
    decoder = Decoder(target, request.getfixturevalue(draft), EOS, max_seq_len=512)
    tree = Tree.parse(spec)
    accepted = []
    for ids, expected in zip(prompt_ids, ar_outputs, strict=True):
        result = decoder.generate(ids, NEW_TOKENS, tree)
        assert result.token_ids == expected
        accepted += result.stats.accepted
    if draft_name == "target":
        assert min(accepted[:8]) == tree.max_depth  # whole paths were accepted and compacted
    else:
        assert 0 < sum(a > 0 for a in accepted) < len(accepted)  # a mix of acceptances and rejections


@pytest.mark.parametrize("path", FORWARD_PATHS)
def test_greedy_trees_equal_ar_on_both_forward_paths(request, prompt_ids, path):
    """fp32 speculation stays allowed on the torch reference path because it is tested so (its rows move by ~1e-7
    with the tree's shape): static and dynamic trees of a weak draft, with suffix candidates, give its own AR."""
    target, draft = engine_pair(request, path)
    assert target.inexact is None
    decoder = Decoder(target, draft, EOS, max_seq_len=512)
    dynamic = Policy(budget=6, depth=2, width=2, verify_ms=FLAT)
    accepted = []
    for ids in prompt_ids[:2]:
        expected = reference_greedy(target, ids, 40, EOS)
        for tree, policy in ((Tree.parse("2,2,1"), None), (None, dynamic)):
            result = decoder.generate(ids, 40, tree, policy=policy)
            assert result.token_ids == expected, (tree, policy)
            accepted += result.stats.accepted
    assert 0 < sum(a > 0 for a in accepted) < len(accepted)  # paths were accepted and compacted, others rejected


def test_speculation_is_refused_where_the_engine_is_not_exact(target_dir, draft, prompt_ids):
    """bf16 on the torch path rounds a verified row differently from the same token decoded alone (default
    speculation matched bf16 AR on 2 of 12 bench prompts): every speculative job is refused before it takes a slot,
    naming the fix; AR still runs. The same precision on the native forward is exact."""
    bf16 = Transformer.load(target_dir, torch.bfloat16, native=False, measure_kernels=False)
    decoder = Decoder(bf16, draft, EOS, max_seq_len=256)
    for tree, policy in ((Tree.parse("2,1"), None), (None, Policy()), (None, Policy(budget=16, depth=0, draft=False))):
        with pytest.raises(ValueError, match="speculative decoding would be lossy on this engine.*use --dtype fp32"):
            decoder.generate(prompt_ids[0], 4, tree, policy=policy)
        assert decoder.free == [0] and not decoder.active
    assert decoder.generate(prompt_ids[0], 4).token_ids == reference_greedy(bf16, prompt_ids[0], 4, EOS)
    assert Transformer.load(target_dir, torch.bfloat16).inexact is None


def test_lossless_across_300_tokens_of_compaction(target, prompt_ids):
    # no end-of-sequence: force 320 new tokens through ~80 compactions of non-contiguous tree paths
    ar = reference_greedy(target, prompt_ids[1], 320, set())
    spec = Decoder(target, target, set(), max_seq_len=512).generate(prompt_ids[1], 320, Tree.parse("2,2,1"))
    assert len(ar) == 320
    assert spec.token_ids == ar
    assert spec.stats.target_passes < 320 / 3


def test_kv_cache_is_static(target, draft, prompt_ids):
    decoder = Decoder(target, draft, EOS, max_seq_len=256, max_active=2)
    caches = decoder.target_caches + decoder.drafter.caches
    buffers = [b for c in caches for b in (c.pool_k, c.pool_v, c.k, c.v, c.attention)]
    before = [(id(b), b.data_ptr(), b.shape) for b in buffers]
    decoder.generate(prompt_ids[0], 24, Tree.parse("3,2,1"))
    decoder.generate(prompt_ids[2], 24, Tree.parse("1,1"), params=SamplingParams(temperature=0.9, seed=1))
    decoder.generate(prompt_ids[3], 24, policy=Policy(budget=6, depth=2, width=2, verify_ms=FLAT))
    assert decoder.target_caches + decoder.drafter.caches == caches
    assert [(id(b), b.data_ptr(), b.shape) for b in buffers] == before
    assert caches[0].pool_k is caches[1].pool_k  # one pool per engine: the slots are views of it


def test_generation_stops_at_max_seq_len(target, draft, prompt_ids):
    ids = prompt_ids[0]
    decoder = Decoder(target, draft, set(), max_seq_len=len(ids) + 5)
    result = decoder.generate(ids, 100, Tree.parse("2,2"))
    assert result.finish_reason == "length" and len(result.token_ids) == 5


def test_generation_stops_at_eos(target, draft, tokenizer):
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"])
    result = Decoder(target, draft, EOS, max_seq_len=512).generate(ids, 200, Tree.parse("2,1"))
    assert result.finish_reason == "stop"
    assert 0 < len(result.token_ids) < 200 and not EOS & set(result.token_ids)


def test_bad_requests_are_refused(target, draft, prompt_ids):
    decoder = Decoder(target, draft, EOS, max_seq_len=64, max_tree_tokens=16)
    with pytest.raises(ValueError, match="empty"):
        decoder.generate([], 8)
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        decoder.generate(prompt_ids[0], 0)
    with pytest.raises(ValueError, match="max_seq_len is 64: shorten the prompt"):
        decoder.generate(list(range(100, 170)), 8)
    with pytest.raises(ValueError, match="more than max_tree_tokens"):
        decoder.generate(prompt_ids[0], 8, Tree.parse("4,4"))
    # the decoder still serves a good request afterwards
    assert len(decoder.generate(prompt_ids[0][:20], 4).token_ids) == 4


def test_sampling_is_seeded_and_reproducible(target, draft, prompt_ids):
    decoder = Decoder(target, draft, EOS, max_seq_len=512)
    tree = Tree.parse("2,1")
    runs = [decoder.generate(prompt_ids[3], 32, tree, params=SamplingParams(temperature=1.0, seed=s)).token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_temperature_zero_is_greedy(target, draft, prompt_ids, ar_outputs):
    decoder = Decoder(target, draft, EOS, max_seq_len=512)
    result = decoder.generate(prompt_ids[0], NEW_TOKENS, Tree.parse("2,1"),
                              params=SamplingParams(temperature=0.0, seed=3))
    assert result.token_ids == ar_outputs[0]


def test_tiny_temperature_decodes_greedily(target, draft, prompt_ids, ar_outputs):
    """temperature=1e-40 used to make the logits +-inf and multinomial raise; below MIN_TEMPERATURE it is greedy."""
    decoder = Decoder(target, draft, EOS, max_seq_len=512)
    result = decoder.generate(prompt_ids[0], NEW_TOKENS, Tree.parse("2,1"),
                              params=SamplingParams(temperature=1e-40, seed=3))
    assert result.token_ids == ar_outputs[0]


def test_draft_vocabulary_must_match(target, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft vocabulary"):
        Decoder(target, Transformer.load(tmp_path), EOS)


FLAT = ((1, 1.0), (64, 1.0))  # verify cost flat in T: every candidate with a chance is verified (big trees)
REPEAT = "Repeat this list exactly, then add one more fruit: apple, banana, cherry, grape, melon, orange, peach, plum."


@pytest.mark.parametrize("draft_name, policy", [
    ("none", Policy(budget=16, depth=0, draft=False)),  # draft-less: suffix candidates only
    ("weak", Policy(budget=12, depth=3, width=3, verify_ms=FLAT)),  # dynamic, mostly rejected draft nodes
    ("mid", Policy(budget=8, depth=3, width=2, verify_ms=FLAT)),
    ("target", Policy(budget=10, depth=4, width=2, verify_ms=FLAT)),  # long accepted paths, merged with suffixes
])
def test_greedy_dynamic_merged_trees_are_lossless(request, target, prompt_ids, ar_outputs, tokenizer, draft_name,
                                                  policy):
    draft = None if draft_name == "none" else request.getfixturevalue(
        {"weak": "draft", "mid": "mid_draft", "target": "target"}[draft_name])
    decoder = Decoder(target, draft, EOS, max_seq_len=512)
    decoder.record = True
    repeat = list(tokenizer.apply_chat_template([{"role": "user", "content": REPEAT}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
    ar = reference_greedy(target, repeat, 64, EOS)
    kinds = set()
    for ids, expected in zip(prompt_ids + [repeat], ar_outputs + [ar], strict=True):
        result = decoder.generate(ids, NEW_TOKENS if ids is not repeat else 64, policy=policy)
        assert result.token_ids == expected
        kinds |= {kind for kind, _, _, accepted in result.stats.trace if accepted}
    assert "suffix" in kinds  # suffix candidates were accepted (the repeated list at least)
    if draft_name in ("mid", "target"):
        assert "draft" in kinds and max(result.stats.verified) > policy.width


def test_static_tree_with_suffix_candidates_is_lossless(target, draft, prompt_ids, ar_outputs):
    decoder = Decoder(target, draft, EOS, max_seq_len=512)
    for ids, expected in zip(prompt_ids[:4], ar_outputs[:4], strict=True):
        result = decoder.generate(ids, NEW_TOKENS, Tree.parse("2,1"), policy=Policy())
        assert result.token_ids == expected
        assert max(result.stats.verified) >= len(Tree.parse("2,1"))


def test_no_speculation_when_it_cannot_pay(target, draft, prompt_ids, ar_outputs):
    """A verify of 2 tokens costing 100 steps: every step is a plain AR step and the draft never runs."""
    steep = Policy(budget=8, depth=3, width=2, verify_ms=((1, 1.0), (2, 100.0)))
    result = Decoder(target, draft, EOS, max_seq_len=512).generate(prompt_ids[1], NEW_TOKENS, policy=steep)
    assert result.token_ids == ar_outputs[1]
    assert set(result.stats.verified) == {1} and result.stats.draft_passes == 0


class Contrary:
    """The target as a draft whose every distribution is rolled by one token: as confident as the target, and its
    top token never the target's (greedy accepts none of its nodes)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward(self, *segment):
        return self.forward_many([segment])[0]

    def forward_many(self, segments, logit_rows=None):
        return [logits.roll(1, dims=-1) for logits in self.engine.forward_many(segments, logit_rows)]


@pytest.mark.parametrize("max_active", [1, 4])
def test_the_draft_gate_learns_which_drafts_pay(target, prompt_ids, ar_outputs, max_active):
    """The draft's expected gain is learned per request from the tokens only it got accepted: a confident draft
    that is always wrong soon drafts on few steps (retried now and then), the target as its own draft on nearly
    every step; the decoder's score scale (accepted over expected tokens) falls for the wrong draft; outputs
    equal AR either way, alone and in a batch."""
    costs = Policy(budget=8, depth=2, width=2, suffix=False, verify_ms=((1, 1.0), (4, 1.2), (16, 1.8), (64, 4.0)),
                   draft_ms=((1, 0.2), (64, 2.0)))
    jobs_of, scales = {}, {}
    for name, draft in (("contrary", Contrary(target)), ("self", target)):
        decoder = Decoder(target, draft, EOS, max_seq_len=512, max_active=max_active, policy=costs)
        jobs = [Job(list(ids), 64, AUTO) for ids in prompt_ids[:4]]
        decoder.run(jobs)
        for job, expected in zip(jobs, ar_outputs[:4], strict=True):
            assert job.out == expected[:64], name
        jobs_of[name] = jobs
        scales[name] = sum(j.score_scale for j in jobs) / len(jobs)
    share = {name: sum(j.stats.draft_passes for j in jobs) / sum(j.stats.target_passes for j in jobs)
             for name, jobs in jobs_of.items()}
    accepted = sum(a for j in jobs_of["self"] for a in j.stats.accepted)
    assert accepted > sum(j.stats.target_passes for j in jobs_of["self"])  # the self-draft is accepted
    assert share["contrary"] < 0.5 * share["self"], share
    assert max(j.draft_gain for j in jobs_of["contrary"]) < min(j.draft_gain for j in jobs_of["self"])
    assert scales["contrary"] < min(1.0, scales["self"]), scales  # the wrong draft's promises were not kept


def test_a_jobs_score_scale_is_its_own(target, prompt_ids):
    """The score scale is learned per request from its own trees (a decoder-wide scale let one tenant's hot sampled
    requests shrink everyone's trees)."""
    from spectrt.runtime.decoding.controller import SCALE_PRIOR

    costs = Policy(budget=8, depth=2, width=2, suffix=False, verify_ms=((1, 1.0), (4, 1.2), (16, 1.8), (64, 4.0)),
                   draft_ms=((1, 0.2), (64, 2.0)))
    decoder = Decoder(target, target, EOS, max_seq_len=512, max_active=4, policy=costs)
    greedy = [Job(list(ids), 48, AUTO) for ids in prompt_ids[:2]]
    hot = [Job(list(ids), 48, AUTO, SamplingParams(1.5, seed=i)) for i, ids in enumerate(prompt_ids[2:4])]
    decoder.run(greedy + hot)
    # the greedy jobs' self-drafted nodes are always accepted, beyond their calibrated scores: their scales rose
    assert all(j.score_evidence != (SCALE_PRIOR, SCALE_PRIOR) and j.score_scale > 1.0 for j in greedy)
    # each job's own evidence: decoded in one batch, they end with scales of their own (one decoder-wide scale
    # gave every job the same)
    assert len({round(j.score_scale, 9) for j in greedy + hot}) == 4


class Counting:
    """An engine that counts its forward calls."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def forward_many(self, segments, logit_rows=None):
        self.calls += 1
        return self.engine.forward_many(segments, logit_rows)


@pytest.mark.parametrize("suffix", [False, True])
def test_under_load_a_draft_that_cannot_pay_never_runs(target, prompt_ids, ar_outputs, suffix):
    """The costs a step weighs are the batched profile's at its own segment count: on a table where a speculative
    row is free for one request and dear for four, four requests decode exactly as plain batched decoding does: no
    draft forward at all (not even reading their prompts, and no draft time on the loop's clock), one target row
    per decoding request (suffix candidates, which cost no forward, add none either); the same request alone
    drafts; outputs equal AR both ways."""
    flat = {str(r): 1.0 for r in (1, 2, 4, 8, 16, 32, 64)}
    steep = {s: {str(r): float(r) for r in (1, 2, 4, 8, 16, 32, 64) if r >= s} for s in (2, 4, 8)}
    costs = Policy(budget=8, depth=2, width=2, suffix=suffix, draft_gain=0.9,
                   verify_batched=BatchedCost.from_json({"128": {"1": flat, **{str(s): t for s, t in steep.items()}}}),
                   draft_batched=BatchedCost.from_json({"128": {"1": {"1": 0.05, "64": 0.05}}}))
    draft = Counting(target)  # the target as its own draft: every node it proposes is accepted
    decoder = Decoder(target, draft, EOS, max_seq_len=512, max_active=4, policy=costs)
    jobs = [Job(list(ids), 64, AUTO) for ids in prompt_ids[:4]]
    for job in jobs:
        decoder.add(job)
    while len(decoder.active) == 4:
        info = decoder.step()
        assert draft.calls == 0 and all(decoder.drafter.caches[j.slot].length == 0 for j in jobs)
        assert info.tree_tokens == sum(j.decoding for j in jobs)  # the roots alone
    assert decoder.clock.draft == 0.0 and decoder.clock.steps > 0 and decoder.clock.target > 0
    decoder.run([])
    alone = Job(list(prompt_ids[0]), 64, AUTO)
    decoder.run([alone])
    assert alone.stats.draft_passes > 0 and draft.calls > 0
    assert sum(alone.stats.accepted) > 0
    for job, expected in zip([*jobs, alone], [*ar_outputs[:4], ar_outputs[0]], strict=True):
        assert job.out == expected[:64]


def test_a_batch_may_draft_the_first_level_alone(target, prompt_ids, ar_outputs):
    """Where verified rows past the roots plus one a request get dear, the whole depth-2 tree pays for only some of
    four decoding requests while every request's first level pays: with a tuned first-level gain each step of the
    full batch runs one draft forward (no level pass), without it the level too; outputs equal AR both ways. (While
    the others still prefill, a lone decoding request's whole tree pays: those steps are not counted.)"""
    steep = ((1, 1.0), (8, 1.0), (9, 50.0), (64, 500.0))  # 4 requests: up to one extra row each is free
    base = Policy(budget=4, depth=2, width=2, suffix=False, draft_gain=1.0, verify_ms=steep, draft_ms=((1, 1e-6),))
    passes = {}
    for first_level_gain in (0.8, None):
        draft = Counting(target)  # the target as its own draft: its first child is always accepted
        decoder = Decoder(target, draft, EOS, max_seq_len=512, max_active=4,
                          policy=replace(base, first_level_gain=first_level_gain))
        jobs = [Job(list(ids), 48, AUTO) for ids in prompt_ids[:4]]
        for job in jobs:
            decoder.add(job)
        per_step = []  # draft forwards of each step in which all four requests decode
        while len(decoder.active) == 4:
            calls, full = draft.calls, all(j.decoding for j in jobs)
            decoder.step()
            if full:
                per_step.append(draft.calls - calls)
        decoder.run([])
        for job, expected in zip(jobs, ar_outputs[:4], strict=True):
            assert job.out == expected[:48]
        passes[first_level_gain] = per_step
    assert passes[0.8] and set(passes[0.8]) == {1}
    assert 2 in passes[None]


@pytest.mark.parametrize("tree", [None, Tree.parse("2,1")])
def test_sampling_with_suffix_candidates_is_seeded(target, draft, prompt_ids, tree):
    decoder = Decoder(target, draft, EOS, max_seq_len=512)
    policy = Policy(budget=8, depth=2, width=2, verify_ms=FLAT)
    runs = [decoder.generate(prompt_ids[3], 32, tree, params=SamplingParams(temperature=0.8, seed=s),
                             policy=policy).token_ids for s in (4, 4, 5)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
    assert all(0 <= t < target.config.vocab_size for t in runs[0])


@pytest.mark.parametrize("policy", [Policy(budget=10, depth=3, width=2, verify_ms=FLAT), Policy(budget=16, depth=0,
                                                                                                draft=False)])
def test_bf16_dynamic_and_suffix_trees_equal_bf16_ar(target_dir, draft, prompt_ids, tokenizer, policy):
    """bf16 is exact on the native forward (row-invariant kernels): every proposer's trees give bf16 AR's output."""
    bf16 = Transformer.load(target_dir, torch.bfloat16)
    if bf16.native is None:
        pytest.fail("bf16 exactness needs the native CPU forward (make setup builds it)")
    decoder = Decoder(bf16, draft, EOS, max_seq_len=512)
    repeat = list(tokenizer.apply_chat_template([{"role": "user", "content": REPEAT}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"])
    speculative = 0
    for ids in prompt_ids[:3] + [repeat]:
        result = decoder.generate(ids, 64, policy=policy)
        assert result.token_ids == reference_greedy(bf16, ids, 64, EOS)
        speculative += sum(a > 0 for a in result.stats.accepted)
    assert speculative > 0


def test_segment_buffers_write_each_slots_rows_and_keep_the_others():
    """A segment's tokens and positions come from its slot's static rows: a causal chunk counts up from its start, a
    tree adds its depths, a draft level shares one position; another slot's rows stay as they were written, and a
    segment longer than the window is refused."""
    buffers = SegmentBuffers(slots=2, width=4)
    tokens, positions = buffers.rows(1, [7, 8, 9], 10)
    assert tokens.tolist() == [7, 8, 9] and positions.tolist() == [10, 11, 12]
    tree = Tree((-1, 0, 0, 1))
    other = buffers.rows(0, [1, 2, 3, 4], 5, tree.depths)
    assert other[0].tolist() == [1, 2, 3, 4] and other[1].tolist() == (tree.positions(5)).tolist()
    level = buffers.rows(0, [5, 6], 20, buffers.zeros[:2])
    assert level[1].tolist() == [20, 20]
    assert tokens.tolist() == [7, 8, 9] and positions.tolist() == [10, 11, 12]  # slot 1 untouched
    assert buffers.causal[3].tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()
    assert buffers.causal[3].is_contiguous()
    with pytest.raises(ValueError, match="exceeds the 4-row window"):
        buffers.rows(0, [1, 2, 3, 4, 5], 0)
    wide = SegmentBuffers(slots=1, width=40)  # past SMALL rows: numpy's writes, the same rows
    chunk = wide.rows(0, list(range(100, 140)), 7)
    assert chunk[0].tolist() == list(range(100, 140)) and chunk[1].tolist() == list(range(7, 47))
    assert wide.rows(0, list(range(30)), 3, tuple(range(0, 60, 2)))[1].tolist() == [3 + 2 * i for i in range(30)]


def test_masked_greedy_requests_reduce_their_rows_only_where_the_forwards_argmax_is_masked(target, draft, prompt_ids,
                                                                                         monkeypatch):
    """Counters: a greedy request with `min_length` and bad words keeps the forward's own argmax on rows whose
    argmax its masks leave alone, and masks and reduces its rows only on steps where they hit it; the outputs equal
    those of masking and reducing every step (`argmax_of` off), bad words included."""
    from spectrt.runtime.decoding import decoder as decoder_module

    plain = Decoder(target, None, EOS, max_seq_len=512).generate(prompt_ids[0], 24).token_ids
    reductions = []
    own = decoder_module.argmax_rows
    monkeypatch.setattr(decoder_module, "argmax_rows", lambda logits: (reductions.append(1), own(logits))[1])

    def run(with_argmax: bool) -> tuple[list[list[int]], int]:
        reductions.clear()
        decoder = Decoder(target, draft, EOS, max_seq_len=512, max_active=2)
        if not with_argmax:
            decoder.argmax_of = None
        jobs = [Job(prompt_ids[0], 24, Tree.parse("2,1"), min_length=24, bad_words=[[plain[3]], plain[8:10]]),
                Job(prompt_ids[1], 24, None, min_length=24)]
        decoder.run(jobs)
        assert all(job.finish == "length" for job in jobs)
        return [job.out for job in jobs], len(reductions)

    reference, every_step = run(False)
    outputs, fewer = run(True)
    assert outputs == reference
    assert reference[0][:3] == plain[:3] and plain[3] not in reference[0]  # the bad word was masked where it won
    assert 0 < fewer < every_step


def test_greedy_acceptance_reads_the_forwards_argmax_and_survives_its_failure(target, draft, prompt_ids, ar_outputs):
    """Counters: batched greedy steps take every unmasked request's argmax from the native forward (`argmax_of`, one
    call a step) instead of reducing the logits again; if that fails, each request reduces its own rows and the
    output is still AR's."""
    calls = []
    decoder = Decoder(target, draft, EOS, max_seq_len=512, max_active=2)
    own = decoder.argmax_of
    decoder.argmax_of = lambda blocks: (calls.append(len(blocks)), own(blocks))[1]
    jobs = [Job(ids, NEW_TOKENS, Tree.parse("2,1")) for ids in prompt_ids[:2]]
    decoder.run(jobs)
    assert [job.out for job in jobs] == ar_outputs[:2]
    assert calls and max(calls) == 2 and sum(calls) == sum(job.stats.target_passes for job in jobs)

    def broken(blocks):
        raise RuntimeError("no argmax here")

    decoder.argmax_of = broken
    jobs = [Job(ids, NEW_TOKENS, Tree.parse("2,1")) for ids in prompt_ids[:2]]
    decoder.run(jobs)
    assert [job.out for job in jobs] == ar_outputs[:2] and all(job.finish != "error" for job in jobs)
