"""The `tensorrt` backend's EAGLE-3 path on the CPU: TensorRTEngine over a target plan that returns `features` and
over a head plan (build/export_eagle3.py), driven through a stand-in TensorRT module that runs the same ONNX graph
with ONNX Runtime on the addresses and shapes the engine binds (as tests/test_engines.py does for the plain target
graph), compared with OnnxEngine on that graph; and real head / target-with-features plans built by tensorrt_rtx.

A tiny 4-layer target and a random EAGLE-3 head for it are made and exported once (~15 s on 2 cores).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import StandInTRT
from spectrt.build import eagle3 as B
from spectrt.build.compile import default_profiles
from spectrt.build.export import export_graph, graph_io
from spectrt.build.export_eagle3 import export_head_graph
from spectrt.runtime.engines.batch_inputs import FEATURES, HEAD_INPUT_NAMES, INPUT_NAMES
from spectrt.runtime.engines.eagle3 import Eagle3Config, draft_ids, read_weights
from spectrt.runtime.engines.graph_head import GraphHead
from spectrt.runtime.engines.model import ModelConfig, Transformer
from spectrt.runtime.engines.onnx_engine import EngineDirError, OnnxEngine
from spectrt.runtime.engines.trt_engine import TensorRTEngine
from test_draft import make_tiny_target
from test_eagle3 import _random_module

LAYERS = (1, 2, 4)  # the head's feature layers (4: the tiny target's last layer's output)
PROFILE = default_profiles(16, 64, 2)[0]  # what the plans are built for: batch 2, 16 rows per request, capacity 64


def profile_dict(config: ModelConfig, io: dict) -> dict:
    """The manifest's recorded profile (build/compile.py build_plan) for a graph of this io."""
    rows = {n: int(io["inputs"][n]["shape"][1]) for n in HEAD_INPUT_NAMES[len(INPUT_NAMES):] if n in io["inputs"]}
    return {"name": PROFILE.name, **{k: [list(s) for s in v] for k, v in PROFILE.shapes(config, rows).items()}}


def trt_engine(graph: Path, config: ModelConfig, **kwargs) -> TensorRTEngine:
    """TensorRTEngine over `graph` (its io as the manifest records it) through the stand-in module."""
    io = graph_io(graph)
    return TensorRTEngine(graph, config, io, profile_dict(config, io), device="cpu", trt=StandInTRT(graph), **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("trt_head")
    target_dir = make_tiny_target(d / "target", layers=4)
    target = Transformer.load(target_dir, measure_kernels=False)
    head_dir = B.save_head(_random_module(target), target_dir, d / "head", LAYERS)
    log = lambda msg: None  # noqa: E731
    out = {"target_dir": target_dir, "head_dir": head_dir, "config": target.config,
           "head_config": Eagle3Config.from_dir(head_dir, target.config)}
    for precision in ("fp32", "fp16"):
        out[f"target.{precision}"] = export_graph(target_dir, d / f"target.{precision}.onnx", precision, LAYERS, log)
        out[f"head.{precision}"] = export_head_graph(head_dir, target_dir, d / f"head.{precision}.onnx", precision,
                                                     log)
    out["head_ids"] = draft_ids(read_weights(head_dir), out["head_config"])
    return out


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


def _ids(n: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """The same graph on ONNX Runtime behind both engines: equal up to another thread split of the GEMMs."""
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_target_plan_with_features_equals_onnxruntime(tiny):
    """Logits, features and pool writes of the tensorrt engine (target graph with `features`) = OnnxEngine's on the
    same graph: a prompt chunk, then a batch of a chain and a second request's prompt in one plan execution."""
    config, graph = tiny["config"], tiny["target.fp32"]
    ref = OnnxEngine(graph, config, feature_layers=LAYERS)
    eng = trt_engine(graph, config, feature_layers=LAYERS)
    assert list(eng.widths) == ["logits", FEATURES] and eng.widths[FEATURES] == 3 * config.hidden_size
    assert eng.graph_features == LAYERS and eng.row_inputs == {}
    v = config.vocab_size
    ref_caches, caches = ref.new_caches(2, 64, 16), eng.new_caches(2, 64, 16)
    prompt = _ids(12, v, 0)
    (rl,), (rf,) = ref.forward_features([(prompt, torch.arange(12), _causal(12), ref_caches[0])], LAYERS)
    (gl,), (gf,) = eng.forward_features([(prompt, torch.arange(12), _causal(12), caches[0])], LAYERS)
    assert gl.shape == (12, v) and gf.shape == (12, 3 * config.hidden_size)
    close(gl, rl)
    close(gf, rf)
    for c in (ref_caches[0], caches[0]):
        c.commit(12)
    other = _ids(9, v, 1)
    chain = _ids(4, v, 2)

    def batch(cs):
        return [(chain, torch.arange(12, 16), _causal(4), cs[0]), (other, torch.arange(9), _causal(9), cs[1])]

    runs = eng.runs
    want_logits, want_feats = ref.forward_features(batch(ref_caches), LAYERS, logit_rows=[1, None])
    got_logits, got_feats = eng.forward_features(batch(caches), LAYERS, logit_rows=[1, None])
    assert eng.runs == runs + 1, "one plan execution for the batch"
    assert [t.shape[0] for t in got_logits] == [1, 9] and [t.shape[0] for t in got_feats] == [4, 9]
    for a, b in zip(got_logits + got_feats, want_logits + want_feats, strict=True):
        close(a, b)
    for a, b in ((caches[0].pool_k, ref_caches[0].pool_k), (caches[0].pool_v, ref_caches[0].pool_v)):
        close(a, b)
    close(eng.forward_many(batch(caches))[1], ref.forward_many(batch(ref_caches))[1])
    with pytest.raises(EngineDirError, match="returns target features of layers"):
        eng.forward_features(batch(caches), (0, 1, 2))


def _head_steps(head: GraphHead, features: list[torch.Tensor], prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per request, a catch-up over its prompt's target features (rows for tokens 1..n-1, all requests in one call),
    then one draft level of two nodes from the last row's output hidden (one call): every logits, hidden and the K/V
    the head's cache holds afterwards."""
    b = len(prompts)
    caches = head.new_caches(b, 64, 16)
    segs = [(p[1:], torch.arange(1, len(p)), _causal(len(p) - 1), c, f[:-1])
            for p, f, c in zip(prompts, features, caches, strict=True)]
    caught = head.forward_many(segs, full_vocab=False)
    for c, p in zip(caches, prompts, strict=True):
        c.commit(len(p) - 1)
    level = [(torch.tensor([3, 7 + i]), torch.full((2,), len(p)), torch.eye(2, dtype=torch.bool), c,
              hidden[-1:].expand(2, -1).contiguous())
             for i, (p, c, (_, hidden)) in enumerate(zip(prompts, caches, caught, strict=True))]
    drafted = head.forward_many(level, full_vocab=False)
    full = head.forward_many([(s[0], s[1], s[2], s[3], s[4]) for s in level[:1]])[0][0]  # full-vocabulary rows too
    out = [t for pair in caught + drafted for t in pair] + [full]
    return out + [c.pool_k[c.slot, :, :, :c.length + 2] for c in caches] + [
        c.pool_v[c.slot, :, :, :c.length + 2] for c in caches]


@pytest.mark.parametrize("batch", [1, 2])
def test_head_plan_through_graph_head_equals_onnxruntime(tiny, batch):
    """GraphHead over a TensorRTEngine of the head graph = GraphHead over OnnxEngine of it: catch-up rows from target
    features, then a draft level from hidden rows, one request and two in one plan execution each."""
    config, hc, graph = tiny["config"], tiny["head_config"], tiny["head.fp32"]
    target = OnnxEngine(tiny["target.fp32"], config, feature_layers=LAYERS)
    prompts = [_ids(11 + 3 * i, config.vocab_size, 10 + i) for i in range(batch)]
    caches = target.new_caches(batch, 64, 16)
    _, features = target.forward_features([(p, torch.arange(len(p)), _causal(len(p)), c)
                                           for p, c in zip(prompts, caches, strict=True)], LAYERS)
    ref = GraphHead(OnnxEngine(graph, hc.model, input_names=HEAD_INPUT_NAMES), hc, tiny["head_ids"])
    engine = trt_engine(graph, hc.model, input_names=HEAD_INPUT_NAMES)
    got_head = GraphHead(engine, hc, tiny["head_ids"])
    assert engine.row_inputs == {"target_features": 3 * config.hidden_size, "hidden_states": hc.model.hidden_size}
    assert list(engine.widths) == ["logits", "hidden_out"] and engine.widths["logits"] == hc.draft_vocab_size
    runs = engine.runs
    want, got = _head_steps(ref, features, prompts), _head_steps(got_head, features, prompts)
    assert engine.runs == runs + 3, "one plan execution per call, whatever the batch"
    shapes = engine._eager.shapes  # the last call (a draft level of 2 rows): no feature rows, the hidden rows
    assert shapes["target_features"] == (0, 3 * config.hidden_size) and shapes["hidden_states"] == (2, 64)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        if a.isinf().any():  # full-vocabulary rows: -inf outside the draft vocabulary
            assert torch.equal(a.isinf(), b.isinf())
            a, b = a.nan_to_num(0.0, 0.0, 0.0), b.nan_to_num(0.0, 0.0, 0.0)
        close(a.float(), b.float())


def test_tensorrt_engine_refuses_other_graphs_and_inputs(tiny):
    config, hc = tiny["config"], tiny["head_config"]
    with pytest.raises(EngineDirError, match="not the batched tree-verify graph's"):
        trt_engine(tiny["head.fp32"], hc.model)
    with pytest.raises(EngineDirError, match="not an EAGLE-3 head's graph's"):
        trt_engine(tiny["target.fp32"], config, input_names=HEAD_INPUT_NAMES)
    with pytest.raises(ValueError, match="input_names must be"):
        trt_engine(tiny["target.fp32"], config, input_names=INPUT_NAMES[:-1])
    engine = trt_engine(tiny["head.fp32"], hc.model, input_names=HEAD_INPUT_NAMES)
    cache = engine.new_cache(64, 16)
    seg = [(torch.tensor([1, 2]), torch.arange(2), _causal(2), cache)]
    with pytest.raises(ValueError, match="takes the extra inputs"):
        engine.run(seg)
    hidden = torch.zeros(0, hc.model.hidden_size)
    with pytest.raises(ValueError, match="must add up"):
        engine.run(seg, {"target_features": torch.zeros(1, 3 * config.hidden_size), "hidden_states": hidden})
    with pytest.raises(ValueError, match=r"must be \[rows, 192\]"):
        engine.run(seg, {"target_features": torch.zeros(2, 5), "hidden_states": hidden})


def test_head_and_feature_plans_build_with_tensorrt_rtx(tiny, tmp_path):
    """Real plans: the fp16 head graph (its two row inputs get 0..N-row profile ranges) and the fp16 target graph with
    `features`; the recorded io and profile drive a TensorRTEngine (stand-in execution) of the head."""
    pytest.importorskip("tensorrt_rtx")
    from spectrt.build.compile import build_plan

    config, hc = tiny["config"], tiny["head_config"]
    log = lambda msg: None  # noqa: E731
    head = build_plan(tiny["head.fp16"], tmp_path / "head.plan", hc.model, [PROFILE], ["sm89"], "fp16",
                      module="tensorrt_rtx", log=log)
    assert head.bytes > 0 and (tmp_path / "head.plan").stat().st_size == head.bytes
    assert tuple(head.io["inputs"]) == HEAD_INPUT_NAMES
    f, h, n = 3 * config.hidden_size, hc.model.hidden_size, PROFILE.rows
    assert head.io["inputs"]["target_features"] == {"dtype": "float32", "shape": [-1, f]}
    assert head.io["outputs"]["hidden_out"] == {"dtype": "float32", "shape": [-1, h]}
    assert head.profiles[0]["target_features"] == [[0, f], [0, f], [n[2], f]]
    assert head.profiles[0]["hidden_states"] == [[0, h], [n[1], h], [n[2], h]]
    assert head.profiles[0]["pool_k"][2] == [2, 1, hc.model.num_kv_heads, 64, hc.model.head_dim]
    target = build_plan(tiny["target.fp16"], tmp_path / "target.plan", config, [PROFILE], ["sm89"], "fp16",
                        module="tensorrt_rtx", log=log)
    assert target.io["outputs"][FEATURES] == {"dtype": "float32", "shape": [-1, f]}
    assert "target_features" not in target.profiles[0] and tuple(target.io["inputs"]) == INPUT_NAMES

    engine = TensorRTEngine(tmp_path / "head.plan", hc.model, head.io, head.profiles[0], device="cpu",
                            trt=StandInTRT(tiny["head.fp16"]), input_names=HEAD_INPUT_NAMES)
    assert engine.kv_dtype == torch.float16 and engine.max_rows == n[2]
    graph_head = GraphHead(engine, hc, tiny["head_ids"])
    cache = graph_head.new_cache(64, 16)
    feats = torch.randn(5, f)
    logits, hidden = graph_head.forward(torch.arange(1, 6), torch.arange(1, 6), _causal(5), cache, feats, False)
    assert logits.shape == (5, hc.draft_vocab_size) and hidden.shape == (5, h) and logits.isfinite().all()
