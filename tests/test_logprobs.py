"""Log-probabilities of emitted tokens (runtime/decoding/sampling.py `token_logprobs`, the decoder's `Job.logprobs`):
the target's own distribution at each emitted position, after penalties and constraints, identical with and without
speculation."""

from __future__ import annotations

import json
import math

import pytest
import torch
from spectrt.runtime.decoding.decoder import Decoder, Job
from spectrt.runtime.decoding.penalties import Penalties
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.sampling import token_logprobs
from spectrt.runtime.decoding.tree import Tree

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.mark.unit
def test_token_logprobs_are_each_rows_log_softmax_sorted_ties_to_the_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, -torch.inf], [0.0, 0.0, 0.0, 0.0, 5.0]])
    got = token_logprobs(logits, [0, 1, 0], [2, 4, 3], 3)
    want = torch.log_softmax(logits, -1)
    assert [g[0] for g in got] == [want[0, 2].item(), want[1, 4].item(), want[0, 3].item()]
    assert [i for i, _ in got[0][1]] == [1, 2, 0]  # 3.0 twice: the lower id first, then the next value
    assert [i for i, _ in got[1][1]] == [4, 0, 1]
    assert all(a[1] >= b[1] for g in got for a, b in zip(g[1], g[1][1:], strict=False))
    assert token_logprobs(logits, [0], [4], 0) == [(-math.inf, [])]  # a masked token: -inf, no entries asked
    # a row's values do not depend on the other rows of its step (speculation verifies several)
    assert token_logprobs(logits[1:], [0], [4], 2) == [(got[1][0], got[1][1][:2])]


@pytest.fixture(scope="module")
def decoder(target, head_dir):
    from spectrt.runtime.engines.eagle3 import Eagle3Head

    return Decoder(target, Eagle3Head.load(head_dir, target), {2}, max_seq_len=512)


def _ids(tokenizer, prompt: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


@pytest.mark.parametrize("kind", ["plain", "penalties", "json"])
def test_speculation_reports_the_logprobs_of_the_target_alone(decoder, tokenizer, kind):
    """Greedy, the shipped head drafting: tree 2,1 and the default policy emit the AR tokens with the AR's logprobs,
    bit for bit, the chosen token first among the top entries; with penalties and a grammar the reported distribution
    is the constrained one (a forced token has log-probability 0)."""
    ids = _ids(tokenizer, "Describe a person named Alice who is 30 and lives in Paris, as JSON." if kind == "json"
               else "List ten fruits, one per line.")
    penalties = Penalties(presence=1.0) if kind == "penalties" else None

    def run(tree, policy):
        grammar = None
        if kind == "json":
            from spectrt.runtime.decoding.grammar import GrammarCompiler

            spec = json.dumps({"type": "json_schema", "schema": SCHEMA})
            grammar = GrammarCompiler(tokenizer, 49152, [2]).state(spec)
        result = decoder.generate(list(ids), 32, tree, policy=policy, penalties=penalties, grammar=grammar,
                                  logprobs=5)
        return result

    ar = run(None, None)
    assert len(ar.logprobs) == len(ar.token_ids) > 8
    for token, (lp, top) in zip(ar.token_ids, ar.logprobs, strict=True):
        assert top[0][0] == token and top[0][1] == lp and len(top) == 5
        assert all(a[1] >= b[1] for a, b in zip(top, top[1:], strict=False))
    if kind == "json":
        assert any(lp == 0.0 and all(v == -math.inf for _, v in top[1:]) for lp, top in ar.logprobs)
    for tree, policy in ((Tree.parse("2,1"), None), (None, Policy())):
        spec = run(tree, policy)
        assert sum(spec.stats.accepted) > 0
        assert spec.token_ids == ar.token_ids and spec.logprobs == ar.logprobs


def test_logprobs_follow_the_sampled_tokens_and_are_checked(decoder, tokenizer):
    """Under sampling each reported logprob is the target's for the token actually emitted; a bad count is refused."""
    from spectrt.runtime.decoding.sampling import SamplingParams

    ids = _ids(tokenizer, "Write a short poem about the moon.")
    result = decoder.generate(list(ids), 16, Tree.parse("2,1"), params=SamplingParams(0.9, seed=3), logprobs=2)
    assert len(result.logprobs) == len(result.token_ids)
    context, found = list(ids), 0
    for token, (lp, top) in zip(result.token_ids, result.logprobs, strict=True):
        assert lp <= top[0][1] and len(top) == 2
        alone = decoder.generate(context, 1, None, logprobs=20).logprobs[0][1]  # the target after this prefix
        entry = dict(alone).get(token)
        if entry is not None:
            found += 1
            assert math.isclose(lp, entry, rel_tol=1e-5, abs_tol=1e-6)
        context.append(token)
    assert found >= len(result.token_ids) // 2
    with pytest.raises(ValueError, match="top_logprobs must be in"):
        decoder.check(Job(list(ids), 4, logprobs=21))
