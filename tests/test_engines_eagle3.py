"""The EAGLE-3 head through the engines path: the target graph's feature rows, the head's own batched graph, and
speculative decoding on ONNX Runtime equal to the same engine's autoregressive output.

`head_engines` (conftest) is `spectrt engines --no-plans` for the embedded target and its default draft, the shipped
head, run with every training entry point made to fail. Tolerances: exported fp32 graphs against the native fp32
forward differ by float rounding only; feature rows carry outlier dimensions (~2e4 in SmolLM2's middle layers), so they
are compared relative to each row's largest magnitude (1e-5), logits absolutely (1e-3 on values of ~30).
"""

from __future__ import annotations

import json

import pytest
import torch
from spectrt.build.engines import EngineBuildError, make_engines
from spectrt.runtime.engines.eagle3 import Eagle3Head
from spectrt.runtime.engines.engine import load_engine
from spectrt.runtime.engines.graph_head import GraphHead
from spectrt.runtime.engines.onnx_engine import EngineDirError, OnnxEngine

PROMPTS = ["Explain why the sky is blue in two sentences.", "Write a haiku about autumn leaves.",
           "What are three uses of a paperclip?"]


def _causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def _close_rows(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> bool:
    scale = a.abs().amax(-1, keepdim=True).clamp_min(1.0)
    return bool(((a - b).abs() / scale).max() <= rel)


@pytest.fixture(scope="module")
def graphs(head_engines, target_dir):
    engines, _ = head_engines
    target = OnnxEngine.load(engines / "target")
    return engines, target, GraphHead.load(engines / "draft", target.config)


def test_default_engines_carry_the_shipped_head_and_train_nothing(head_engines, head_dir):
    engines, printed = head_engines
    manifest = json.loads((engines / "manifest.json").read_text())
    draft, target = manifest["models"]["draft"], manifest["models"]["target"]
    head_config = json.loads((head_dir / "config.json").read_text())
    assert draft["kind"] == "eagle3" and draft["source"]["path"] == str(head_dir.resolve())
    assert target["feature_layers"] == head_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert target["graphs"]["fp32"]["io"]["outputs"]["features"]["shape"] == ["N", 3 * 576]
    assert "draft/d2t.safetensors" in manifest["files"] and "EAGLE-3 head" in printed


def test_target_graph_features_equal_the_native_forward(graphs, target):
    """A prompt chunk, then a tree and a second request's chunk in one batched run: logits and feature rows."""
    _, ort_target, head = graphs
    layers = head.feature_layers
    caches = [target.new_caches(2, 128, 32), ort_target.new_caches(2, 128, 32)]
    prompt = _ids(20, 0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    results = []
    for engine, (c0, c1) in zip((target, ort_target), caches, strict=True):
        (l0,), (f0,) = engine.forward_features([(prompt, torch.arange(20), _causal(20), c0)], layers)
        c0.commit(20)
        segments = [(_ids(4, 1), torch.tensor([20, 21, 21, 22]), tree, c0),
                    (_ids(9, 2), torch.arange(9), _causal(9), c1)]
        logits, feats = engine.forward_features(segments, layers)
        results.append([l0, f0, *logits, *feats])
    for i, (want, got) in enumerate(zip(*results, strict=True)):
        if i in (0, 2, 3):  # logits
            assert (want - got).abs().max() < 1e-3, i
        else:
            assert want.shape[1] == 3 * 576 and _close_rows(want, got), i


def test_head_graph_equals_the_head_at_batch_1_and_4(graphs, target, head_dir):
    """Catch-up rows over target features, then a draft level from the head's hidden rows, for one request alone and
    for four in one run; a row does not change when another request's rows or cache change (bitwise)."""
    _, ort_target, graph_head = graphs
    head = Eagle3Head.load(head_dir, target)
    features = torch.randn(4, 12, graph_head.feature_width, generator=torch.Generator().manual_seed(3)) * 50
    level = torch.tensor([[1, 0], [0, 1]], dtype=torch.bool)
    outs = {}
    for batch in (1, 4):
        for name, engine in (("native", head), ("graph", graph_head)):
            caches = engine.new_caches(4, 128, 16)
            catch = [(_ids(12, 10 + r), torch.arange(1, 13), _causal(12), caches[r], features[r])
                     for r in range(batch)]
            first = engine.forward_many(catch, full_vocab=False)
            for c in caches[:batch]:
                c.commit(12)
            drafts = [(_ids(2, 20 + r), torch.tensor([13, 13]), level, caches[r],
                       first[r][1][-1:].expand(2, -1).contiguous()) for r in range(batch)]
            outs[name, batch] = (first, engine.forward_many(drafts, full_vocab=False))
    for batch in (1, 4):
        for step in (0, 1):
            for (lw, hw), (lg, hg) in zip(outs["native", batch][step], outs["graph", batch][step], strict=True):
                assert (lw - lg).abs().max() < 1e-3 and _close_rows(hw, hg, 1e-4)
    # request 0 alone == request 0 among four (the others' rows and caches are other values)
    for step in (0, 1):
        alone, batched = outs["graph", 1][step][0], outs["graph", 4][step][0]
        assert torch.equal(alone[0], batched[0]) and torch.equal(alone[1], batched[1])


def test_engines_path_speculation_equals_its_autoregressive_output(head_engines):
    """Greedy, default policy, the head drafting on ONNX Runtime: the same tokens as the target graph alone."""
    from spectrt.runtime.decoding.pipeline import Pipeline

    engines, _ = head_engines
    spec = Pipeline(engines / "target", engines / "draft", backend="onnxruntime", max_seq_len=256)
    plain = Pipeline(engines / "target", None, backend="onnxruntime", max_seq_len=256)
    accepted = 0
    for prompt in PROMPTS:
        want = plain.generate(prompt, 40, None)
        got = spec.generate(prompt, 40)
        assert got.token_ids == want.token_ids, prompt
        accepted += sum(got.stats.accepted)
        assert got.stats.draft_passes > 0
    assert accepted > 0  # the head's guesses were checked and some kept


def test_a_graph_without_the_heads_features_is_refused(graphs, engines):
    """A head beside a target exported without features (the slice's engines): refused at load, naming the fix."""
    from spectrt.runtime.decoding.pipeline import Pipeline

    head_dir_engines = graphs[0]
    with pytest.raises(EngineDirError, match="rebuild the engines with this head"):
        Pipeline(engines / "target", head_dir_engines / "draft", backend="onnxruntime", max_seq_len=256)
    plain = load_engine(engines / "target", "onnxruntime")
    with pytest.raises(EngineDirError, match="returns target features of none"):
        plain.forward_features([(_ids(3, 0), torch.arange(3), _causal(3), plain.new_cache(16, 8))], (2, 15, 27))


def test_a_head_for_another_target_is_refused_before_building(target_dir, family_checkpoints, tmp_path):
    from spectrt.build import eagle3 as B
    from spectrt.runtime.engines.model import Transformer

    tiny = family_checkpoints("qwen3")
    head = B.save_head(B.Eagle3Module(Transformer.load(tiny).config, torch.arange(100)), tiny, tmp_path / "head",
                       (1, 1, 1))
    with pytest.raises(EngineBuildError, match="use a head trained for this target"):
        make_engines(target_dir, head, tmp_path / "engines", plans=False)
    assert not (tmp_path / "engines" / "manifest.json").exists()


def test_a_tiny_head_for_a_tiny_qwen3_exports_and_decodes(family_checkpoints, tmp_path):
    """A user's own EAGLE-3 head (SpecForge layout, made here) for a target of another family: engines built, and
    greedy speculation on ONNX Runtime equals the target graph alone."""
    from spectrt.build import eagle3 as B
    from spectrt.runtime.decoding.decoder import Decoder
    from spectrt.runtime.decoding.tree import Tree
    from spectrt.runtime.engines.model import Transformer

    tiny = family_checkpoints("qwen3")
    module = B.Eagle3Module(Transformer.load(tiny).config, torch.randperm(49152)[:300].sort().values, init_std=0.2)
    head = B.save_head(module.eval(), tiny, tmp_path / "head", (1, 1, 2))
    out = make_engines(tiny, head, tmp_path / "engines", plans=False, max_seq_len=96, max_tree_tokens=16)
    target = OnnxEngine.load(out / "target")
    graph_head = GraphHead.load(out / "draft", target.config)
    prompt = _ids(10, 5).tolist()
    want = Decoder(target, None, set(), max_seq_len=96, max_tree_tokens=16).generate(prompt, 16, None).token_ids
    result = Decoder(target, graph_head, set(), max_seq_len=96, max_tree_tokens=16).generate(
        prompt, 16, Tree.parse("2,1"))
    assert result.token_ids == want and result.stats.draft_passes > 0
