"""Penalties and logit bias under speculation (runtime/decoding/penalties.py): each tree row is penalized by its own
path, so speculative decoding equals the target alone with the same penalties."""

from __future__ import annotations

import pytest
import torch
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.decoding.penalties import Penalties, penalize
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.tree import Tree, path_tokens


@pytest.mark.unit
def test_each_row_is_penalized_by_its_own_path():
    """Root, two branches repeating different earlier tokens, a grandchild: every row equals the AR step's logits
    penalized with the output continued by that row's path."""
    torch.manual_seed(0)
    parents, tokens = [-1, 0, 0, 1], [7, 3, 5, 3]  # node 3 repeats token 3 after node 1's 3
    prompt, output = [9, 4, 4], [5, 7]
    pen = Penalties(presence=0.5, frequency=0.25, repetition=1.3, logit_bias={2: 1.5, 5: -3.0})
    logits = torch.randn(4, 12) * 3
    got = penalize(logits.clone(), pen, prompt, output, parents, tokens)
    assert path_tokens(parents, tokens) == [[], [3], [5], [3, 3]]
    for i, path in enumerate(path_tokens(parents, tokens)):
        row = logits[i].clone()
        seen = set(prompt) | set(output) | set(path)
        for t in seen:
            row[t] = row[t] / 1.3 if row[t] > 0 else row[t] * 1.3
        for t in set(output + path):
            row[t] -= 0.25 * (output + path).count(t) + 0.5
        row[2] += 1.5
        row[5] -= 3.0
        assert torch.allclose(got[i], row), i
    assert not Penalties().active and torch.equal(penalize(logits.clone(), Penalties(), prompt, output, parents,
                                                           tokens), logits)


@pytest.mark.unit
@pytest.mark.parametrize("kwargs, message", [({"presence": 3}, "presence_penalty"), ({"repetition": 0}, "repetition"),
                                             ({"logit_bias": {3: 500}}, "logit_bias")])
def test_out_of_range_penalties_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Penalties(**kwargs)


def test_penalized_speculation_equals_penalized_ar(target, head_dir, tokenizer):
    """Greedy with the shipped head (tree 2,1 and the default policy) == the target alone, for each penalty kind."""
    from spectrt.runtime.engines.eagle3 import Eagle3Head

    decoder = Decoder(target, Eagle3Head.load(head_dir, target), {2}, max_seq_len=512)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "List ten fruits, one per line."}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    plain = decoder.generate(list(ids), 48, None).token_ids
    for pen in (Penalties(presence=1.0), Penalties(frequency=0.8), Penalties(repetition=1.4),
                Penalties(logit_bias={plain[1]: -100.0})):
        want = decoder.generate(list(ids), 48, None, penalties=pen)
        assert want.token_ids != plain  # the penalty changes the answer
        for tree, policy in ((Tree.parse("2,1"), None), (None, Policy())):
            got = decoder.generate(list(ids), 48, tree, policy=policy, penalties=pen)
            assert got.token_ids == want.token_ids, pen
            assert sum(got.stats.accepted) > 0
