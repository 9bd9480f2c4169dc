"""The decode loop on the real embedded model: lossless greedy tree decoding, static KV, limits, sampling."""

from __future__ import annotations

import pytest
from spectrt.build.slice import slice_target
from spectrt.runtime.decoder import SpecDecoder
from spectrt.runtime.model import Transformer
from spectrt.runtime.sampling import SamplingParams
from spectrt.runtime.tree import Tree

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "List five animals that live in the ocean.",
    "What is 12 times 15? Explain briefly.",
    "Explain what photosynthesis is to a child.",
    "Write a short poem about the moon.",
    "Give three tips for learning a new language.",
    "What is the capital of France and what is it famous for?",
    "Write a SQL query that counts rows in a table named users.",
]
EOS = {2}


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for p in PROMPTS]


@pytest.fixture(scope="module")
def mid_draft(target_dir, tmp_path_factory) -> Transformer:
    """The first 20 of 30 layers: agrees with the target often, so long paths get accepted and compacted."""
    return Transformer.load(slice_target(target_dir, 20, tmp_path_factory.mktemp("slice20")))


@pytest.fixture(scope="module")
def ar_outputs(target, prompt_ids) -> list[list[int]]:
    decoder = SpecDecoder(target, None, EOS, max_seq_len=512)
    return [decoder.generate(ids, 128).token_ids for ids in prompt_ids]


@pytest.mark.parametrize("draft_name, spec", [
    ("weak", "3,2,2,1"),      # untrained 4-layer slice, wide tree: mostly rejections
    ("mid", "2,2,1"),         # untrained 20-layer slice: partial paths, second-ranked children
    ("target", "2,1,1"),      # the target drafting for itself: whole paths accepted every pass
    ("target", "1,1,1,1"),    # chain
])
def test_greedy_tree_decoding_is_lossless(request, target, prompt_ids, ar_outputs, draft_name, spec):
    draft = {"weak": "draft", "mid": "mid_draft", "target": "target"}[draft_name]
    decoder = SpecDecoder(target, request.getfixturevalue(draft), EOS, max_seq_len=512)
    tree = Tree.parse(spec)
    accepted = []
    for ids, expected in zip(prompt_ids, ar_outputs, strict=True):
        result = decoder.generate(ids, 128, tree)
        assert result.token_ids == expected
        accepted += result.stats.accepted
    if draft_name == "target":
        assert min(accepted[:8]) == tree.max_depth  # whole paths were accepted and compacted
    else:
        assert 0 < sum(a > 0 for a in accepted) < len(accepted)  # a mix of acceptances and rejections


def test_lossless_across_300_tokens_of_compaction(target, prompt_ids):
    # no end-of-sequence: force 320 new tokens through ~80 compactions of non-contiguous tree paths
    ar = SpecDecoder(target, None, set(), max_seq_len=512).generate(prompt_ids[1], 320)
    spec = SpecDecoder(target, target, set(), max_seq_len=512).generate(prompt_ids[1], 320, Tree.parse("2,2,1"))
    assert len(ar.token_ids) == 320
    assert spec.token_ids == ar.token_ids
    assert spec.stats.target_passes < 320 / 3


def test_kv_cache_is_static(target, draft, prompt_ids):
    decoder = SpecDecoder(target, draft, EOS, max_seq_len=256)
    buffers = [decoder.target_cache.k, decoder.target_cache.v, decoder.target_cache.attention,
               decoder.draft_cache.k, decoder.draft_cache.v, decoder.node_tokens]
    before = [(id(b), b.data_ptr(), b.shape) for b in buffers]
    caches = (decoder.target_cache, decoder.draft_cache)
    decoder.generate(prompt_ids[0], 24, Tree.parse("3,2,1"))
    decoder.generate(prompt_ids[2], 24, Tree.parse("1,1"), params=SamplingParams(temperature=0.9, seed=1))
    assert (decoder.target_cache, decoder.draft_cache) == caches
    assert [(id(b), b.data_ptr(), b.shape) for b in buffers] == before


def test_generation_stops_at_max_seq_len(target, draft, prompt_ids):
    ids = prompt_ids[0]
    decoder = SpecDecoder(target, draft, set(), max_seq_len=len(ids) + 5)
    result = decoder.generate(ids, 100, Tree.parse("2,2"))
    assert result.finish_reason == "length" and len(result.token_ids) == 5


def test_generation_stops_at_eos(target, draft, tokenizer):
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"])
    result = SpecDecoder(target, draft, EOS, max_seq_len=512).generate(ids, 200, Tree.parse("2,1"))
    assert result.finish_reason == "stop"
    assert 0 < len(result.token_ids) < 200 and not EOS & set(result.token_ids)


def test_bad_requests_are_refused(target, draft, prompt_ids):
    decoder = SpecDecoder(target, draft, EOS, max_seq_len=64, max_tree_tokens=16)
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
    decoder = SpecDecoder(target, draft, EOS, max_seq_len=512)
    tree = Tree.parse("2,1")
    runs = [decoder.generate(prompt_ids[3], 32, tree, params=SamplingParams(temperature=1.0, seed=s)).token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_temperature_zero_is_greedy(target, draft, prompt_ids, ar_outputs):
    decoder = SpecDecoder(target, draft, EOS, max_seq_len=512)
    result = decoder.generate(prompt_ids[0], 128, Tree.parse("2,1"), params=SamplingParams(temperature=0.0, seed=3))
    assert result.token_ids == ar_outputs[0]


def test_draft_vocabulary_must_match(target, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="draft vocabulary"):
        SpecDecoder(target, Transformer.load(tmp_path), EOS)
