"""Data and drafts at scale: self-synthesized prompts (build/synth.py) and the draft shipped with the package
(build/draft.py ship_draft / install_shipped)."""

from __future__ import annotations

import json

import pytest
import torch
from spectrt.build import corpus as C
from spectrt.build import draft as D
from spectrt.build import synth as S


def test_filters_keep_real_messages_and_drop_junk():
    assert S.acceptable("How do I make a simple tomato sauce?")
    for bad in ("Hi", "x" * 401, "Привет, как дела? Расскажи мне о погоде.", "<|im_start|>assistant hello there",
                "1234567890 12345"):
        assert not S.acceptable(bad), bad
    assert S.normalized("How do I   START running?!") == S.normalized("how do i start running")
    assert S.normalized(" ".join(["word"] * 12) + " tail one") == S.normalized(" ".join(["word"] * 12) + " other")


def test_pre_query_template_is_the_chat_template_up_to_the_user_message(tokenizer):
    text = tokenizer.decode(S.pre_query_ids(tokenizer))
    assert text.endswith("<|im_start|>user\n") and "<|im_start|>system" in text
    history = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."}]
    follow = tokenizer.decode(S.pre_query_ids(tokenizer, history))
    assert follow.endswith("Blue.<|im_end|>\n<|im_start|>user\n")


def test_the_shipped_synthesized_prompts_regenerate_on_this_machine(target_dir):
    """A seed gives the same prompts on every machine: the first ones of the shipped seed-0 file come out again here,
    whatever this CPU's `auto` precision is (bf16dot on AMX sampled other prompts from the same seeds)."""
    shipped = C.read_prompts(C.synth_prompts_path(0))
    assert S.synthesize(target_dir, 4, seed=0, progress=False, exclude=S.excluded(0)) == shipped[:4]


def test_synthesized_prompts_are_deterministic_for_a_seed_and_unique(target_dir):
    heldout = C.read_prompts(C.HELDOUT_PROMPTS)
    first = S.synthesize(target_dir, 6, seed=3, progress=False, exclude=heldout)
    assert first == S.synthesize(target_dir, 6, seed=3, progress=False, exclude=heldout)
    assert len(first) == 6 and all(len(c) == 1 and c[0]["role"] == "user" and S.acceptable(c[0]["content"])
                                   for c in first)
    assert len({S.normalized(c[0]["content"]) for c in first}) == 6
    assert first != S.synthesize(target_dir, 6, seed=4, progress=False)
    follow = S.synthesize(target_dir, 0, seed=3, histories=[first[0] + [{"role": "assistant", "content": "Sure."}]],
                          progress=False)
    assert all(len(c) == 3 and c[-1]["role"] == "user" for c in follow)


def test_openers_steer_every_message_and_keep_the_seed_deterministic(target_dir):
    written = [[{"role": "user", "content": "What is rain?"}], [{"role": "user", "content": "How do I knit a scarf?"}],
               [{"role": "user", "content": "Hi"}]]
    openers = S.openers_of(written)
    assert openers == ["What is", "How do", "Hi"]
    steered = S.synthesize(target_dir, 5, seed=3, progress=False, openers=openers)
    assert steered == S.synthesize(target_dir, 5, seed=3, progress=False, openers=openers)
    assert len(steered) == 5 and all(c[0]["content"].startswith(tuple(openers)) for c in steered)
    assert steered != S.synthesize(target_dir, 5, seed=3, progress=False)


def test_shipped_prompts_are_a_corpus_disjoint_from_the_heldout_and_benchmark_prompts():
    from spectrt.runtime.decoding.bench import BENCH_DIR

    steered = (C.synth_prompts_path(2), C.synth_prompts_path(3))  # the shipped draft's (`make ship-draft`)
    synth = [c for path in (*C.SYNTH_PROMPTS, *steered) for c in C.read_prompts(path)]
    assert len(synth) >= 1000
    keys = {C.conv_key(c) for c in synth}
    assert len(keys) == len(synth) and not keys & {C.conv_key(c) for c in C.read_prompts(C.HELDOUT_PROMPTS)}
    texts = {S.normalized(m["content"]) for c in synth for m in c if m["role"] == "user"}
    bench = {S.normalized(line) for path in BENCH_DIR.glob("*.txt") for line in path.read_text().splitlines()}
    assert not texts & (bench - {""})


# ------------------------------------------------------------------------------------------- the shipped draft


def _fake_draft(path, scale: float = 1.0, top1: float = 0.5):
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    save_file({"fc.weight": torch.full((4, 12), scale), "d2t": torch.arange(4)}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (path / "draft_report.json").write_text(json.dumps({"heldout": {"distilled": {"top1": top1}}}))
    return path


def test_a_shipped_draft_installs_only_for_its_target_and_refuses_corruption(tmp_path, target_dir):
    from test_draft import make_tiny_target

    tiny = make_tiny_target(tmp_path / "tiny")
    other = make_tiny_target(tmp_path / "other", layers=2)
    drafts = tmp_path / "drafts"
    D.ship_draft(_fake_draft(tmp_path / "trained", 1.0 / 3), tiny, drafts / "tiny", "make it")
    assert D.shipped_draft(tiny, drafts) == drafts / "tiny" and D.shipped_draft(other, drafts) is None
    assert D.install_shipped(other, tmp_path / "no", drafts) is None and not (tmp_path / "no").exists()
    out = D.install_shipped(tiny, tmp_path / "installed", drafts)
    from safetensors.torch import load_file

    weights = load_file(out / "model.safetensors")
    assert weights["fc.weight"].dtype == torch.bfloat16 and weights["d2t"].dtype == torch.int64  # ids stay ids
    assert (out / "tokenizer.json").is_file() and json.loads((drafts / "tiny" / "ship.json").read_text())[
        "command"] == "make it"
    data = bytearray((drafts / "tiny" / "model.safetensors").read_bytes())
    data[-1] ^= 1
    (drafts / "tiny" / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors fails its sha256"):
        D.install_shipped(tiny, tmp_path / "again", drafts)


def test_an_installed_draft_knows_whether_it_is_the_one_shipped_now(tmp_path):
    """An installed shipped draft is current until another is shipped for its target (then `spectrt draft` installs
    the new one instead of reusing it); a draft made here is never taken for an installed one."""
    from test_draft import make_tiny_target

    tiny, other = make_tiny_target(tmp_path / "tiny"), make_tiny_target(tmp_path / "other", layers=2)
    drafts = tmp_path / "drafts"
    D.ship_draft(_fake_draft(tmp_path / "a", top1=0.45), tiny, drafts / "tiny", "first")
    out = D.install_shipped(tiny, tmp_path / "installed", drafts)
    assert D.installed_current(tiny, out, drafts) is True
    assert D.installed_current(other, out, drafts) is False  # shipped for another target's weights
    D.ship_draft(_fake_draft(tmp_path / "b", scale=2.0, top1=0.5), tiny, drafts / "tiny", "better")
    assert D.installed_current(tiny, out, drafts) is False
    assert D.installed_current(tiny, D.install_shipped(tiny, out, drafts), drafts) is True
    assert D.installed_current(tiny, _fake_draft(tmp_path / "made-here"), drafts) is None


def test_a_worse_draft_does_not_replace_the_shipped_one(tmp_path):
    """Shipping keeps the better draft: a lower held-out top-1 for the same target is refused with both figures,
    unless forced; a better one, or one for another target, replaces it."""
    from test_draft import make_tiny_target

    tiny, other = make_tiny_target(tmp_path / "tiny"), make_tiny_target(tmp_path / "other", layers=2)
    drafts = tmp_path / "drafts" / "tiny"
    D.ship_draft(_fake_draft(tmp_path / "a", top1=0.45), tiny, drafts, "first")
    with pytest.raises(ValueError, match=r"40.0% < 45.0%.*--force"):
        D.ship_draft(_fake_draft(tmp_path / "b", top1=0.40), tiny, drafts, "worse")
    assert json.loads((drafts / "ship.json").read_text())["command"] == "first"
    big = _fake_draft(tmp_path / "big", top1=0.9)  # too large to ship: refused, the shipped draft untouched
    from safetensors.torch import save_file

    save_file({"fc.weight": torch.zeros(D.SHIPPED_LIMIT_MB * 2**19 + 1, dtype=torch.float32)},
              big / "model.safetensors")
    with pytest.raises(ValueError, match="must stay under"):
        D.ship_draft(big, tiny, drafts, "too big")
    assert D.install_shipped(tiny, tmp_path / "still", drafts.parent) is not None  # every sha256 still holds
    assert (drafts / "model.safetensors").stat().st_mode & 0o777 == 0o644
    D.ship_draft(tmp_path / "b", tiny, drafts, "forced", force=True)
    D.ship_draft(_fake_draft(tmp_path / "c", top1=0.42), tiny, drafts, "better")
    D.ship_draft(_fake_draft(tmp_path / "d", top1=0.1), other, drafts, "another target")
    assert json.loads((drafts / "ship.json").read_text())["command"] == "another target"


def test_the_package_ships_a_draft_for_the_embedded_target_that_decodes_exactly(target_dir, tmp_path):
    """The shipped draft belongs to the embedded target and through `Decoder` greedy trees equal AR (batch 1, 3)."""
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.tree import Tree

    installed = D.install_shipped(target_dir, tmp_path / "draft")
    assert installed is not None, "no shipped draft for the embedded target"
    pipe = Pipeline(target_dir, installed, max_seq_len=256, measure_kernels=False, max_active=3)
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 28, 7018, 411][:6 + 4 * i]
               for i in range(3)]
    decoder = pipe.decoder
    ar = [decoder.generate(p, 24).token_ids for p in prompts]
    assert [decoder.generate(p, 24, Tree.parse("2,2,1")).token_ids for p in prompts] == ar
    from spectrt.runtime.decoding.decoder import Job

    jobs = decoder.run([Job(p, 24, Tree.parse("2,2,1")) for p in prompts])
    assert [j.out for j in jobs] == ar
