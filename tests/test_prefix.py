"""The prefix cache: the radix index on its own (pure), then in the decode loop on the real embedded model: reused KV
rows equal recomputed ones bitwise (fp32 and bf16 on the native forward; the torch fp path is refused), multi-turn
outputs with the cache equal those without it, with the sliced draft and with an EAGLE-3 head; concurrent requests
sharing a prefix, eviction under a small pool, a request cancelled mid-prefill or failed."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, PROMPTS, chat_ids
from spectrt.runtime.decoding.decoder import AUTO, Decoder, Job
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.prefix import Match, PrefixIndex
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.model import Transformer

TREE = Tree.parse("2,1")


# --------------------------------------------------------------------------- the index (pure)


def test_longest_match_prefers_a_whole_sequence_then_the_most_recent():
    index = PrefixIndex()
    index.insert(0, [1, 2, 3, 4, 5])
    index.insert(1, [1, 2, 3, 9])
    index.insert(2, [1, 2, 3])
    assert index.match([7, 1, 2]) is None
    assert index.match([1, 2, 3, 4, 5, 6]) == Match(0, 5, True)
    assert index.match([1, 2, 3, 9, 9]) == Match(1, 4, True)
    assert index.match([1, 2, 3, 7]) == Match(2, 3, True)  # slot 2 holds exactly the matched tokens
    assert index.match([1, 2, 3, 4, 7]) == Match(0, 4, False)  # inside slot 0's edge
    index.remove(2)
    index.match([1, 2, 3, 9])  # slot 1 used last
    assert index.match([1, 2, 8]) == Match(1, 2, False)
    assert index.match([1, 2, 3, 4]) == Match(0, 4, False)  # now slot 0 is the most recent
    assert index.match([1, 2, 8]) == Match(0, 2, False)


def test_remove_prunes_and_merges_edges():
    index = PrefixIndex()
    index.insert(0, [1, 2, 3, 4])
    index.insert(1, [1, 2, 5])
    root = index.root
    assert list(root.children[1].edge) == [1, 2] and set(root.children[1].children) == {3, 5}
    index.remove(1)
    assert list(root.children[1].edge) == [1, 2, 3, 4] and not root.children[1].children  # merged back
    index.insert(0, [6])  # a slot holds one sequence: re-inserting replaces it
    assert set(root.children) == {6} and len(index) == 1 and index.match([1, 2]) is None
    index.insert(0, [])
    assert not root.children and 0 not in index


def test_victim_is_an_empty_slot_then_the_least_recently_used_never_a_pinned_one():
    index = PrefixIndex()
    index.insert(0, [1, 2])
    index.insert(1, [3, 4])
    index.insert(2, [5, 6], pinned=True)  # an active request's prompt
    assert index.victim([0, 1, 3]) == 3
    assert index.victim([0, 1]) == 0
    index.match([1, 2, 9])
    assert index.victim([0, 1]) == 1
    assert index.match([5, 6, 7]) == Match(2, 2, True)  # pinned entries are matched (copied from), never evicted
    with pytest.raises(ValueError, match="pinned"):
        index.victim([2])
    index.insert(2, [5, 6, 7, 8])  # its request finished: the same slot, unpinned, holds prompt + output
    assert index.victim([2]) == 2 and 2 not in index.pinned


# --------------------------------------------------------------------------- in the decode loop


def _conversation(tokenizer, answers: list[list[int]], turns: list[str]) -> list[dict]:
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": tokenizer.decode(answers[i], skip_special_tokens=True)})
    return messages


TURNS = ["Name three colors.", "Why is the sky blue?", "Write a haiku about it."]


def _multi_turn(decoder: Decoder, tokenizer, tree=TREE, max_new: int = 24) -> tuple[list, list, list]:
    """(answers, prompts, cached tokens) of a greedy conversation of TURNS through `decoder` (one slot per turn)."""
    answers, prompts, cached = [], [], []
    for k in range(len(TURNS)):
        prompts.append(chat_ids(tokenizer, _conversation(tokenizer, answers, TURNS[:k + 1])))
        result = decoder.generate(prompts[-1], max_new, tree)
        answers.append(result.token_ids)
        cached.append(result.stats.cached_tokens)
    return answers, prompts, cached


def _held(prompt: list[int], answer: list[int], max_new: int) -> list[list[int]]:
    """What a finished request may leave indexed: prompt + output; stopped on length, maybe less the last token
    (when it was the last step's own next token, whose KV the next step would have computed)."""
    seq = prompt + answer
    return [seq, seq[:-1]] if len(answer) == max_new else [seq]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def bf16_target(target_dir) -> Transformer:
    return Transformer.load(target_dir, torch.bfloat16)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_multi_turn_reuses_the_history_bitwise_and_answers_as_without_it(request, target, bf16_target, draft,
                                                                         tokenizer, precision):
    engine = target if precision == "fp32" else bf16_target
    assert engine.native is not None, "the native forward runs here (the exactness below is its row invariance)"
    cached_decoder = Decoder(engine, draft, EOS, max_seq_len=512)
    fresh = Decoder(engine, draft, EOS, max_seq_len=512, prefix_cache=False)
    answers, prompts, cached = _multi_turn(cached_decoder, tokenizer)
    want, _, none = _multi_turn(fresh, tokenizer)
    assert answers == want and none == [0, 0, 0]
    # what the prefixes imply: turn 1 shares nothing; each later turn, the previous turn's prompt and answer
    assert cached[0] == 0
    for k in (1, 2):
        held = _held(prompts[k - 1], answers[k - 1], 24)
        assert cached[k] in {min(_common(h, prompts[k]), len(prompts[k]) - 1) for h in held}
        assert cached[k] > len(prompts[k - 1])
    # the last turn's rows, reused (computed by the earlier turns' prefill chunks and tree verifies) and not:
    # bitwise equal, in the target's and the draft's caches
    for mine, theirs in ((cached_decoder.target_caches[0], fresh.target_caches[0]),
                         (cached_decoder.drafter.caches[0], fresh.drafter.caches[0])):
        rows = min(mine.length, theirs.length)
        assert rows > cached[2] if mine in cached_decoder.target_caches else rows > 0
        assert torch.equal(mine.k[:, :, :rows], theirs.k[:, :, :rows])
        assert torch.equal(mine.v[:, :, :rows], theirs.v[:, :, :rows])


def test_the_torch_fp_path_is_refused_with_its_reason(target_dir, tokenizer):
    engine = Transformer.load(target_dir, native=False, measure_kernels=False)
    decoder = Decoder(engine, None, EOS, max_seq_len=256)
    assert decoder.prefix is None and "not row invariant" in decoder.prefix_refusal
    _, _, cached = _multi_turn(decoder, tokenizer, None, 4)
    assert cached == [0, 0, 0]


def test_dynamic_trees_and_suffix_candidates_with_reuse_equal_without(target, draft, tokenizer):
    policy = Policy()
    runs = []
    for cache in (True, False):
        decoder = Decoder(target, draft, EOS, max_seq_len=512, prefix_cache=cache, policy=policy)
        runs.append(_multi_turn(decoder, tokenizer, AUTO, 24))
    assert runs[0][0] == runs[1][0] and runs[0][2][1:] != [0, 0]


def _run(decoder: Decoder, jobs: list[Job]) -> None:
    waiting = list(jobs)
    while waiting or decoder.active:
        while waiting and decoder.free:
            decoder.add(waiting.pop(0))
        decoder.step()


def test_concurrent_requests_share_a_prefix_and_eviction_keeps_serving(target, draft, tokenizer):
    """Two slots, six requests of three conversations (two share a long first turn), interleaved: the second turns
    copy from the pinned prompt of an active request or from a finished one, a third conversation evicts; every
    output equals the request decoded alone without the cache."""
    system = {"role": "system", "content": " ".join(PROMPTS)}  # a long shared prefix
    firsts = [[system, {"role": "user", "content": p}] for p in PROMPTS[:3]]
    alone = Decoder(target, draft, EOS, max_seq_len=512, prefix_cache=False)
    answers = [alone.generate(chat_ids(tokenizer, m), 16, TREE).token_ids for m in firsts]
    seconds = [m + [{"role": "assistant", "content": tokenizer.decode(a, skip_special_tokens=True)},
                    {"role": "user", "content": "Say it again."}] for m, a in zip(firsts, answers, strict=True)]
    prompts = [chat_ids(tokenizer, m) for m in firsts + seconds]
    want = [alone.generate(p, 16, TREE).token_ids for p in prompts]
    decoder = Decoder(target, draft, EOS, max_seq_len=512, max_active=2, prefill_budget=32)
    jobs = [Job(p, 16, TREE) for p in prompts]
    decoder.add(jobs[0])
    while not jobs[0].decoding:
        decoder.step()
    decoder.add(jobs[1])  # while the first decodes: it copies the first's pinned prompt rows
    _run(decoder, [jobs[3], jobs[2], jobs[4], jobs[5]])  # then two slots for three conversations: one evicted
    assert [j.out for j in jobs] == want
    shared = _common(prompts[0], prompts[1])
    assert jobs[0].stats.cached_tokens == 0 and jobs[1].stats.cached_tokens == shared
    cached = [j.stats.cached_tokens for j in jobs]
    assert all(c >= shared for c in cached[1:])  # every later request reuses at least the system prompt
    own = [c > len(prompts[i]) for i, c in enumerate(cached[3:])]
    assert any(own) and not all(own), cached  # some second turns find their own history, one was evicted
    assert len(decoder.prefix) == 2 and not decoder.prefix.pinned


def test_a_request_cancelled_mid_prefill_leaves_only_committed_rows(target, tokenizer):
    prompt = chat_ids(tokenizer, " ".join(PROMPTS))
    decoder = Decoder(target, None, EOS, max_seq_len=512, prefill_budget=16)
    job = Job(prompt, 8)
    decoder.add(job)
    decoder.step()
    decoder.step()
    decoder.cancel(job)
    assert decoder.prefix.lengths == {0: 32}  # two chunks committed; nothing of a chunk not committed
    again = decoder.generate(prompt, 8)
    assert again.stats.cached_tokens == 32
    assert again.token_ids == Decoder(target, None, EOS, max_seq_len=512, prefix_cache=False).generate(
        prompt, 8).token_ids


def test_a_failed_request_leaves_nothing_reusable(target, tokenizer, monkeypatch):
    prompt = chat_ids(tokenizer, PROMPTS[0])
    decoder = Decoder(target, None, EOS, max_seq_len=256)
    decoder.generate(prompt, 4)
    assert 0 in decoder.prefix
    monkeypatch.setattr(decoder, "_accept", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    job = Job(prompt, 4)
    decoder.add(job)
    assert job.stats.cached_tokens == len(prompt) - 1
    while decoder.active:
        decoder.step()
    assert job.finish == "error" and 0 not in decoder.prefix


def test_an_eagle3_head_keeps_its_rows_and_pending_features(tmp_path_factory):
    from spectrt.build import eagle3 as B
    from spectrt.runtime.engines.eagle3 import Eagle3Head
    from test_draft import make_tiny_target
    from test_eagle3 import _random_module

    tiny = make_tiny_target(tmp_path_factory.mktemp("tiny") / "target", layers=4)
    target = Transformer.load(tiny, measure_kernels=False)
    head = Eagle3Head.load(B.save_head(_random_module(target), tiny, tmp_path_factory.mktemp("h") / "head",
                                       (2, 2, 1)), target)
    tree = Tree.parse("2,2,1")
    decoders = [Decoder(target, head, {2}, max_seq_len=256, prefix_cache=c) for c in (True, False)]
    outs = [[], []]
    for decoder, out in zip(decoders, outs, strict=True):
        prompt = [1, 40, 41, 42, 43, 7, 99, 250, 8, 13]
        for turn in range(3):
            result = decoder.generate(prompt, 12, tree)
            out.append((result.token_ids, result.stats.cached_tokens))
            prompt = prompt + result.token_ids + [300 + turn, 301, 302]
    assert [o for o, _ in outs[0]] == [o for o, _ in outs[1]]
    assert outs[0][0][1] == 0 and all(c > 10 for _, c in outs[0][1:]) and all(c == 0 for _, c in outs[1])
    mine, theirs = decoders[0].drafter.caches[0], decoders[1].drafter.caches[0]
    rows = min(mine.length, theirs.length)
    assert rows > 20 and torch.equal(mine.k[:, :, :rows], theirs.k[:, :, :rows])


def test_a_plain_request_reuses_the_history_though_a_head_is_loaded(tmp_path_factory):
    """A request that never drafts reuses as much as on a decoder without a draft: the EAGLE-3 head's rows and
    pending features bound only what a drafting request reuses (before, a server with a head reused nothing for
    plain requests: 0 of 43 prompt tokens of a repeated prompt). A drafting request after them finds no features of
    that prefix, so it reuses nothing, and answers alike."""
    from spectrt.build import eagle3 as B
    from spectrt.runtime.engines.eagle3 import Eagle3Head
    from test_draft import make_tiny_target
    from test_eagle3 import _random_module

    tiny = make_tiny_target(tmp_path_factory.mktemp("tiny") / "target", layers=4)
    target = Transformer.load(tiny, measure_kernels=False)
    head = Eagle3Head.load(B.save_head(_random_module(target), tiny, tmp_path_factory.mktemp("h") / "head",
                                       (2, 2, 1)), target)
    runs = []
    for draft in (head, None):
        decoder, prompt, out = Decoder(target, draft, {2}, max_seq_len=256), [1, 40, 41, 42, 43, 7, 99, 250, 8, 13], []
        for turn in range(3):
            result = decoder.generate(prompt, 12, None)
            out.append((result.token_ids, result.stats.cached_tokens))
            prompt = prompt + result.token_ids + [300 + turn, 301, 302]
        runs.append((decoder, prompt, out))
    (with_head, prompt, out), (without, _, want) = runs
    assert out == want and all(c > 10 for _, c in out[1:])
    drafted = with_head.generate(prompt, 12, Tree.parse("2,2,1"))
    assert drafted.stats.cached_tokens == 0 and drafted.token_ids == without.generate(prompt, 12, None).token_ids


def _tiny_head(tmp_path_factory):
    from spectrt.build import eagle3 as B
    from spectrt.runtime.engines.eagle3 import Eagle3Head
    from test_draft import make_tiny_target
    from test_eagle3 import _random_module

    tiny = make_tiny_target(tmp_path_factory.mktemp("tiny") / "target", layers=4)
    target = Transformer.load(tiny, measure_kernels=False)
    return target, Eagle3Head.load(B.save_head(_random_module(target), tiny, tmp_path_factory.mktemp("h") / "head",
                                               (2, 2, 1)), target)


def test_a_plain_turn_between_drafting_ones_keeps_the_heads_prefix(tmp_path_factory):
    """Turns drafted, plain, drafted in one slot: the plain turn takes the slot over and leaves the head's rows and
    features of the conversation so far as they were (it never writes them), so the third turn reuses the first
    turn's prompt at least; it used to start the head empty and re-read the whole conversation (0 cached tokens).
    Answers equal the decoder's without the cache."""
    target, head = _tiny_head(tmp_path_factory)
    runs = []
    for cache in (True, False):
        decoder, prompt, out = Decoder(target, head, {2}, max_seq_len=256, max_tree_tokens=8, prefix_cache=cache), \
            [1] + list(range(10, 40)), []
        for tree in (TREE, None, TREE):
            result = decoder.generate(prompt, 12, tree)
            out.append((result.token_ids, result.stats.cached_tokens))
            prompt = prompt + result.token_ids + [50, 51, 52]
        runs.append(out)
    (mine, theirs) = runs
    assert [o for o, _ in mine] == [o for o, _ in theirs]
    assert mine[2][1] >= 31 and all(c == 0 for _, c in theirs)


def test_a_seeded_sampled_static_tree_draws_alike_whatever_the_cache_holds(tmp_path_factory):
    """After a plain turn the slot's sliced draft holds none of the conversation: the target reuses only what the
    draft holds for a seeded sampled static-tree request, so its draft never lags and its steps (and tokens) are
    those of a decoder without the cache; before, the draft caught up a window a step while those steps decoded
    plainly and drew other tokens (20 of 20 seeds). An unseeded or greedy request still reuses the whole match."""
    from spectrt.runtime.decoding.sampling import SamplingParams
    from test_draft import make_tiny_target

    root = tmp_path_factory.mktemp("tiny")
    target = Transformer.load(make_tiny_target(root / "target", layers=4), measure_kernels=False)
    draft = Transformer.load(make_tiny_target(root / "draft", layers=2), measure_kernels=False)
    prompt = [1] + list(range(10, 40))
    for seed in range(3):
        outs = []
        for cache in (True, False):
            decoder = Decoder(target, draft, {2}, max_seq_len=128, max_tree_tokens=8, prefix_cache=cache)
            answer = decoder.generate(prompt, 8, None).token_ids
            outs.append(decoder.generate(prompt + answer + [50, 51, 52], 16, TREE,
                                         params=SamplingParams(temperature=1.0, seed=seed)).token_ids)
        assert outs[0] == outs[1]
    decoder = Decoder(target, draft, {2}, max_seq_len=128, max_tree_tokens=8)
    decoder.generate(prompt, 8, None)
    assert decoder.generate(prompt + answer + [50, 51, 52], 16, TREE).stats.cached_tokens > 30
