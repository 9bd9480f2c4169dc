"""An independent reference for greedy decoding: Hugging Face `generate(do_sample=False)` in fp32.

The losslessness tests elsewhere compare speculative output with the same loop's root-only tree, so a bug shared by
catch-up, compaction and positions would pass them all. Here spectrt's greedy output, autoregressive and speculative,
through the public `Decoder.generate` and `Pipeline.generate`, is held against transformers' own greedy decoding
of the same checkpoint: the embedded target on chat prompts (one repeats its prompt, so suffix candidates are
accepted) and the families' tiny random checkpoints.

Two fp32 implementations may round a near-tie apart (the engines agree with Hugging Face to ~1e-4 of the largest
logit, tests/test_model.py, tests/test_families.py). So each output must equal Hugging Face's up to the first token
where Hugging Face's own two best logits lie within TIE of each other, and every token spectrt emitted (its end of
sequence too) must be Hugging Face's greedy choice, teacher-forced on spectrt's own prefix, up to TIE. A wrong token
is whole logits away from the maximum.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import EOS, FAMILIES, PROMPTS, VOCAB, chat_ids
from spectrt.build.slice import slice_target
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.decoding.pipeline import Pipeline
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.model import Transformer
from transformers import AutoModelForCausalLM

TIE = 4e-4  # of the row's largest |logit|: twice each engine's tested distance from Hugging Face, on both tokens
FLAT = ((1, 1.0), (64, 1.0))  # verify cost flat in T: the policy verifies every candidate with a chance
REPEAT = "Repeat this list exactly, then add one more fruit: apple, banana, cherry, grape, melon, orange, peach, plum."
NEW_TOKENS = 48


def hf_greedy(hf, prompt: list[int], new_tokens: int, eos: int) -> list[int]:
    """Hugging Face's greedy continuation, its end-of-sequence token included if it stopped."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    return out[0, len(prompt):].tolist()


def assert_greedy_under_hf(hf, prompt: list[int], result, reference: list[int], eos: int, new_tokens: int) -> None:
    """`result` (a DecodeResult or Generation) is Hugging Face's greedy decoding of `prompt`, up to numerical ties."""
    emitted = list(result.token_ids) + ([eos] if result.finish_reason == "stop" else [])
    assert eos not in result.token_ids
    assert result.finish_reason == "stop" or len(result.token_ids) == new_tokens
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + emitted])).logits[0, len(prompt) - 1:len(prompt) - 1 + len(emitted)]
    for i, token in enumerate(emitted):  # teacher-forced on spectrt's own prefix
        row = logits[i]
        gap = float(row.max() - row[token])
        assert gap <= TIE * float(row.abs().max()), (
            f"token {i}: spectrt emitted {token}, Hugging Face's greedy choice is {int(row.argmax())} "
            f"(logit gap {gap:.4g})")
    if emitted != reference:  # allowed only where the two diverge at a near-tie of Hugging Face's
        common = min(len(emitted), len(reference))
        j = next((i for i in range(common) if emitted[i] != reference[i]), common)
        assert j < common, f"same tokens, different lengths: {emitted} vs {reference}"
        row = logits[j]
        gap = abs(float(row[reference[j]] - row[emitted[j]]))
        assert gap <= TIE * float(row.abs().max()), (
            f"diverged from Hugging Face generate at token {j} ({emitted[j]} vs {reference[j]}), not a tie")


# ---------------------------------------------------------------- the embedded target on chat prompts


@pytest.fixture(scope="module")
def hf_target(target_dir):
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def chats(tokenizer, hf_target) -> list[tuple[str, list[int], list[int]]]:
    """(prompt, its chat token ids, Hugging Face's greedy continuation) for a few chat prompts."""
    (eos,) = EOS
    cases = []
    for prompt in [PROMPTS[0], PROMPTS[2], PROMPTS[3], REPEAT]:
        ids = chat_ids(tokenizer, prompt)
        cases.append((prompt, ids, hf_greedy(hf_target, ids, NEW_TOKENS, eos)))
    return cases


def _decoders(target, draft) -> dict[str, tuple[Decoder, dict]]:
    """Every decoding mode the public API offers, as (decoder, generate kwargs)."""
    return {
        "autoregressive": (Decoder(target, None, EOS, max_seq_len=512), {}),
        "static tree 2,1": (Decoder(target, draft, EOS, max_seq_len=512), {"tree": Tree.parse("2,1")}),
        "static tree 3,2,1 + suffix": (Decoder(target, draft, EOS, max_seq_len=512),
                                       {"tree": Tree.parse("3,2,1"), "policy": Policy()}),
        "dynamic, target drafting for itself": (Decoder(target, target, EOS, max_seq_len=512),
                                                {"policy": Policy(budget=10, depth=4, width=2, verify_ms=FLAT)}),
        "suffix candidates only": (Decoder(target, None, EOS, max_seq_len=512),
                                   {"policy": Policy(budget=16, depth=0, draft=False)}),
    }


def test_embedded_target_decoding_equals_hugging_face_greedy(target, draft, hf_target, chats):
    (eos,) = EOS
    accepted = {}
    for mode, (decoder, kwargs) in _decoders(target, draft).items():
        accepted[mode] = 0
        for _, ids, reference in chats:
            result = decoder.generate(ids, NEW_TOKENS, **kwargs)
            assert_greedy_under_hf(hf_target, ids, result, reference, eos, NEW_TOKENS)
            accepted[mode] += sum(result.stats.accepted)
    # the speculative modes really accepted draft or suffix tokens (compaction and catch-up were exercised)
    assert accepted["autoregressive"] == 0 and all(accepted[m] > 0 for m in accepted if m != "autoregressive")


def test_pipeline_generate_equals_hugging_face_greedy(target_dir, draft_dir, hf_target, chats):
    """The user-facing path (chat template, default policy and a static tree) against the same reference."""
    (eos,) = EOS
    pipe = Pipeline(target_dir, draft_dir, dtype="fp32", max_seq_len=512)  # the reference is fp32 (default: auto)
    for prompt, ids, reference in chats[:2]:
        assert pipe.encode(prompt) == ids
        for tree in ("auto", "2,1", None):
            assert_greedy_under_hf(hf_target, ids, pipe.generate(prompt, NEW_TOKENS, tree), reference, eos,
                                   NEW_TOKENS)


# ---------------------------------------------------------------- the families' tiny checkpoints


@pytest.mark.parametrize("family", FAMILIES)
def test_family_decoding_equals_hugging_face_greedy(family_checkpoints, family, tmp_path):
    path: Path = family_checkpoints(family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    target = Transformer.load(path)
    draft = Transformer.load(slice_target(path, 1, tmp_path / "slice1"))
    eos = 2
    decoders = {"autoregressive": (Decoder(target, None, {eos}, max_seq_len=128), None),
                "1-layer slice, tree 2,1": (Decoder(target, draft, {eos}, max_seq_len=128), Tree.parse("2,1")),
                "self-draft, chain 2,1,1": (Decoder(target, target, {eos}, max_seq_len=128), Tree.parse("2,1,1"))}
    for seed in (1, 2):
        prompt = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        reference = hf_greedy(hf, prompt, 24, eos)
        for decoder, tree in decoders.values():
            assert_greedy_under_hf(hf, prompt, decoder.generate(prompt, 24, tree), reference, eos, 24)
