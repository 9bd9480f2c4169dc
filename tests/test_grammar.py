"""Structured outputs inside the tree (runtime/decoding/grammar.py): per-node masks equal a fresh matcher fed each path,
forbidden drafted nodes are never verified, and constrained speculation equals constrained AR token for token."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.decoding.grammar import (
    GrammarCompiler,
    GrammarError,
    allowed,
    allowed_nodes,
    banned_rows,
    mask_logits,
    parse_spec,
)
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.tree import Tree

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(target_dir):
    from transformers import AutoTokenizer

    return GrammarCompiler(AutoTokenizer.from_pretrained(target_dir), 49152, [2])


@pytest.mark.unit
@pytest.mark.parametrize("text, message", [
    ("nope", "not JSON"), ('{"type": "yaml"}', "needs a type among"), ('{"type": "regex"}', "needs its 'pattern'"),
    ('{"type": "json_schema", "schema": 3}', "JSON Schema object"), ('{"type": "regex", "pattern": 5}', "string"),
])
def test_bad_specs_are_refused_naming_the_problem(text, message):
    with pytest.raises(GrammarError, match=message):
        parse_spec(text)


@pytest.mark.unit
def test_masks_prune_paths_and_mask_rows_with_small_tensors():
    """Rows allow tokens by bit; a node is kept only if every token on its path is allowed by its parent's row."""
    masks = np.zeros((4, 1), dtype=np.int32)
    masks[0, 0] = 0b0110  # after the root: tokens 1, 2
    masks[1, 0] = 0b1000  # after node 1: token 3
    masks[2, 0] = 0b0001
    parents, tokens = [-1, 0, 0, 1], [9, 1, 5, 3]  # node 2's token 5 is forbidden at the root
    assert allowed(masks, 0, 1) and not allowed(masks, 0, 5)
    assert allowed_nodes(masks, parents, tokens) == [0, 1, 3]
    assert allowed_nodes(masks, parents, tokens, [False, False, True, False]) == [0, 1, 2, 3]  # sampled: verified
    logits = torch.zeros(4, 6)
    mask_logits(logits, masks)
    assert logits[0].isinf().tolist() == [True, False, False, True, True, True]
    assert logits[3].isinf().sum() == 0  # an all-zero row (under a terminated grammar) is left as it is
    assert banned_rows(masks, [5, 3, 0, 0]) and not banned_rows(masks[:3], [1, 3, 0])


def test_tree_masks_equal_a_fresh_matcher_fed_each_path(compiler, tokenizer):
    """Every node's row == a fresh matcher's mask after the node's path; the state is unchanged by the walk; the
    tokenizer's control tokens are never allowed (they are not text)."""
    state = compiler.state(json.dumps({"type": "json_schema", "schema": SCHEMA}))
    state.advance(tokenizer.encode('{"name": "', add_special_tokens=False))
    pieces = ["Al", "ice", "Bob", '",', "x", '"']
    ids = [tokenizer.encode(p, add_special_tokens=False)[0] for p in pieces]
    parents = [-1, 0, 1, 0, 2, 0, 3]
    tokens = [0, ids[0], ids[1], ids[2], ids[3], ids[4], ids[5]]
    before = state.tree_masks([-1], [0])
    masks = state.tree_masks(parents, tokens)
    assert np.array_equal(state.tree_masks([-1], [0]), before) and np.array_equal(masks[:1], before)
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.insert(0, tokens[j])
            j = parents[j]
        fresh = compiler.state(state.spec)
        fresh.advance(tokenizer.encode('{"name": "', add_special_tokens=False) + path)
        assert np.array_equal(masks[i], fresh.tree_masks([-1], [0])[0]), pieces[i - 1]
    assert not any(allowed(masks, 0, t) for t in (0, 1, 3))  # <|endoftext|>, <|im_start|>, <repo_name>


@pytest.fixture(scope="module")
def head_pair(target, head_dir):
    from spectrt.runtime.engines.eagle3 import Eagle3Head

    return target, Eagle3Head.load(head_dir, target)


@pytest.mark.parametrize("spec, prompt", [
    ({"type": "json_schema", "schema": SCHEMA}, "Describe a person named Alice who is 30 and lives in Paris, as JSON."),
    ({"type": "json_object"}, "Give me a JSON object describing a cat."),
    ({"type": "regex", "pattern": r"\d{3}-\d{4}"}, "Write a phone number."),
], ids=["json_schema", "json_object", "regex"])
def test_constrained_speculation_equals_constrained_ar(head_pair, compiler, tokenizer, spec, prompt):
    """Greedy, the shipped head drafting: static tree 2,1 and the default policy give the constrained AR's tokens, the
    output follows the grammar, and the drafted nodes the grammar forbids were dropped before verification."""
    target, head = head_pair
    decoder = Decoder(target, head, {2}, max_seq_len=512)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"]
    runs = {}
    for name, tree, policy in (("ar", None, None), ("2,1", Tree.parse("2,1"), None), ("policy", None, Policy())):
        state = compiler.state(json.dumps(spec))
        result = decoder.generate(list(ids), 48, tree, policy=policy, grammar=state)
        runs[name] = (result.token_ids, state.pruned, sum(result.stats.accepted), state.forced, result.stats)
    assert runs["2,1"][0] == runs["ar"][0] and runs["policy"][0] == runs["ar"][0]
    assert runs["2,1"][1] > 0 and runs["2,1"][2] > 0  # forbidden guesses dropped, allowed ones accepted
    assert runs["ar"][3] == 0  # the target alone stays the target alone
    if spec["type"] == "json_schema":  # `", "age": ` after a string value: forced text, candidates, mostly accepted
        for name in ("2,1", "policy"):
            assert runs[name][3] > 0 and runs[name][2] >= runs[name][3] // 2
            assert runs[name][4].target_passes < runs["ar"][4].target_passes
    text = tokenizer.decode(runs["ar"][0], skip_special_tokens=True)
    if spec["type"] == "regex":
        assert re.fullmatch(spec["pattern"], text)
    elif len(runs["ar"][0]) < 48:  # a finished JSON document
        value = json.loads(text)
        assert spec["type"] == "json_object" or set(value) == set(SCHEMA["required"])


def test_a_schema_the_grammar_engine_cannot_compile_is_refused(compiler):
    with pytest.raises(GrammarError, match="cannot be compiled"):
        compiler.state(json.dumps({"type": "regex", "pattern": "(unclosed"}))
