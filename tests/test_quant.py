"""INT8 target (quant/): recipes, ModelOpt calibration, the INT8 engines (native and torch), Q/DQ graphs on ONNX
Runtime and TensorRT-RTX, losslessness of tree decoding against the INT8 target, accuracy gates and the recipe
choice, the compare report, bad input.

Small cases (a random 2-layer LLaMA and the embedded model's first 2 layers) check numerics tightly; the full
embedded target is quantized once with the default recipe (8 calibration prompts, no generation: ~10 s) for the
plan and the decoding tests; the compare report runs on a tiny random model with the real tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ARCHS, EOS, PROMPTS, chat_ids
from spectrt.build.corpus import HELDOUT_PROMPTS, read_prompts
from spectrt.build.export import TreeVerifyModel, example_inputs
from spectrt.build.slice import slice_target
from spectrt.quant.accuracy import accuracy_report, agreement, gate_message, summarize
from spectrt.quant.quantize import (
    CALIBRATION_PROMPTS,
    QuantizeError,
    calibrate,
    export_qdq_graph,
    forward_sequence,
    load_quantized_module,
    quantize_target,
    save_quantized,
)
from spectrt.quant.recipes import DEFAULT_QFORMAT, RECIPES, Recipe, choose_recipe, get_recipe
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.int8 import Int8Linear
from spectrt.runtime.engines.model import Transformer


def _quantize(src: Path, out: Path, qformat: str, samples: list[torch.Tensor]) -> Path:
    """A checkpoint made as `spectrt quantize` makes it (the recipe's fields in config.json), without the gates."""
    model = calibrate(TreeVerifyModel.load(src), qformat, samples, progress=False)
    return save_quantized(model, src, out, {**get_recipe(qformat).meta(), "target": str(src)})


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt())


def _random_samples(vocab: int, n: int = 8, length: int = 48) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (length,), generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A random 2-layer LLaMA with a few outlier hidden channels (what SmoothQuant exists for)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= 30.0
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def small_quantized(tiny_llama, target_dir, tmp_path_factory):
    """(source checkpoint, quantized dir) for {tiny, embedded first 2 layers} x {int8_sq, int8_wo}, made on demand."""
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(source: str, qformat: str) -> tuple[Path, Path]:
        if (source, qformat) not in made:
            root = tmp_path_factory.mktemp(f"{source}-{qformat}")
            src = tiny_llama if source == "tiny" else slice_target(target_dir, 2, root / "slice2")
            vocab = 512 if source == "tiny" else 49152
            made[source, qformat] = src, _quantize(src, root / "int8", qformat, _random_samples(vocab))
        return made[source, qformat]

    return get


@pytest.fixture(scope="module")
def int8_target(target_dir, tokenizer, tmp_path_factory) -> tuple[Path, Path]:
    """(target link, its INT8 SmoothQuant checkpoint as `<target>-int8_sq`), calibrated on 8 real prompts."""
    root = tmp_path_factory.mktemp("int8_target")
    link = root / "smollm2"
    link.symlink_to(Path(target_dir).resolve())
    samples = [torch.tensor(chat_ids(tokenizer, conv)) for conv in read_prompts(CALIBRATION_PROMPTS)[:8]]
    return link, _quantize(link, root / "smollm2-int8_sq", "int8_sq", samples)


CASES = [(source, qformat) for source in ("tiny", "embedded")
         for qformat in ("int8_sq", "int8_sq_token", "int8_sq_static", "int8_wo")]


@pytest.mark.parametrize("source,qformat", CASES)
def test_int8_engine_matches_the_fake_quantized_module(small_quantized, source, qformat):
    src, qdir = small_quantized(source, qformat)
    recipe = get_recipe(qformat)
    # the module with the recipe's run-time numerics: ModelOpt's dynamic per-token quantizers for `per_token`
    module, engine = load_quantized_module(qdir, run_time=True), Transformer.load(qdir)
    ids = torch.randint(0, engine.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = forward_sequence(module, ids)
        plain = forward_sequence(TreeVerifyModel.load(src), ids)
    got = engine.forward(ids, torch.arange(40), torch.ones(40, 40, dtype=torch.bool).tril(), engine.new_cache(40, 40))
    # The engine quantizes with ModelOpt's arithmetic, so its int8 operands are the fake quantizer's and the
    # int32 GEMM is exact: what remains is fp32 reassociation (attention, the per-channel rescale), measured
    # ~4e-7 relative to the largest logit. 1e-4 leaves room for a rare activation landing on a rounding
    # boundary; quantization itself moves the logits >=10x more (checked below, so this test can fail).
    # A dynamic (per-token) scale is 127 / the row's maximum: a 1-ulp difference in that maximum (fp32
    # reassociation upstream, attention above all) moves every value of the row, so values on a rounding boundary
    # flip by one int8 step, more often with a scale per group, and that compounds over later positions (measured on
    # the embedded layers: the engine's native and torch paths differ by 0.12 on logits of ~30 at position 39).
    # So: the first position, which attends only to itself, to 1e-4 like the static recipes; the others must track
    # the quantized module much more closely than the FP model does.
    if recipe.activations == "per_token":
        assert float((got[0] - want[0]).abs().max()) <= 1e-4 * float(want.abs().max())
        assert float((plain[0] - want[0]).abs().max()) > 10 * 1e-4 * float(want.abs().max())
        assert _rms(got - want) <= 0.5 * _rms(plain - want)
    else:
        # A static scale does not compound: a boundary flip moves one position's logits by one int8 step's worth
        # (seen on an AVX2-only EPYC, whose torch reassociates differently: 1 position of 40 at 2x the bound, the
        # rest at 0.01x). So: nearly every position to 1e-4, and all of them far closer than the FP model.
        tol = 1e-4 * float(want.abs().max())
        off = int(((got - want).abs().amax(1) > tol).sum())
        assert off <= 2, f"{off} of 40 positions differ from the quantized module by more than {tol:.2g}"
        assert _rms(got - want) <= 0.05 * _rms(plain - want)
        assert float((plain - want).abs().max()) > 10 * tol
    projections = engine.layers[0]
    if not recipe.weights_only:  # W8A8 in integers; the kept projections stay high precision
        quantized = [n for n in ("wqkv", "wo", "w13", "w2") if n not in recipe.keep]
        assert all(isinstance(projections[n], Int8Linear) for n in quantized) and engine.row_invariant
        assert all(projections[n].per_token == (recipe.activations == "per_token") for n in quantized)
        assert all(len(projections[n].bounds) == -(-projections[n].weight.shape[1] // (recipe.group or 10**9))
                   for n in quantized)  # one scale per group of `group` input channels
        assert all(isinstance(projections[n], torch.Tensor) for n in recipe.keep)
        assert engine.weight_bytes() < 0.8 * Transformer.load(src).weight_bytes() or source == "embedded"
    else:  # weight-only: dequantized fp32 weights (no fast int8-weight kernel on CPU)
        assert all(isinstance(projections[n], torch.Tensor) for n in ("wqkv", "wo", "w13", "w2"))
        assert not engine.row_invariant
    if recipe.kept_dtype == "bf16":  # kept weights and the head are bf16 values, packed as bf16 (half the bytes)
        kept = [projections[n] for n in recipe.keep] + [engine.head]
        assert all(torch.equal(w, w.to(torch.bfloat16).float()) for w in kept)
        assert not torch.equal(engine.head, engine.embed)  # the embeddings stay exact
        assert engine.native is None or engine.native.head.dtype == torch.bfloat16


def test_per_token_int8_projection_is_row_invariant_and_matches_torch():
    from spectrt.runtime.engines import kernels

    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(130, 70, generator=gen), 3 * torch.randn(9, 70, generator=gen)  # K and N not multiples
    x[2] *= 50  # an outlier row: its scale is its own
    x[5] = 0  # an all-zero row quantizes to zero
    proj = Int8Linear(w, w.abs().amax(1), None, torch.rand(70, generator=gen) + 0.5, per_token=True)
    packed = kernels.pack_int8(proj)
    y = kernels.linear(x, packed, 130)
    # the same int8 operands and an exact int32 sum: equal to torch's _int_mm path up to the fp32 multiplies
    torch.testing.assert_close(y, proj(x), rtol=1e-6, atol=1e-4)
    assert torch.equal(y[5], torch.zeros(130))
    others = x.clone()
    others[[0, 1, 3]] *= 1000  # other rows' values never change a row: its scale depends on that row alone
    for i in range(9):
        assert torch.equal(kernels.linear(x[i:i + 1], packed, 130)[0], y[i])
    assert torch.equal(kernels.linear(others, packed, 130)[4:], y[4:])
    # per-token scales fit each row: far closer to the fp32 product than one static scale for the outlier's range
    static = Int8Linear(w, w.abs().amax(1), (x * proj.pre_quant_scale).abs().amax(), proj.pre_quant_scale)
    exact = (x * proj.pre_quant_scale) @ w.T
    rest = [i for i in range(9) if i != 2]
    assert (y[rest] - exact[rest]).abs().max() < 0.2 * (static(x)[rest] - exact[rest]).abs().max()


def test_grouped_int8_projection_is_row_invariant_and_matches_fake_quantization():
    from spectrt.quant.quantize import group_fake_quant
    from spectrt.runtime.engines import kernels

    gen = torch.Generator().manual_seed(8)
    w, x = torch.randn(130, 72, generator=gen), 3 * torch.randn(9, 72, generator=gen)  # groups of 32, 32, 8
    x[:, 66] *= 40  # an outlier channel coarsens only its own group (the last, of 8 channels)
    pre = torch.rand(72, generator=gen) + 0.5
    proj = Int8Linear(w, None, None, pre, per_token=True, group=32)
    assert proj.bounds == [(0, 32), (32, 64), (64, 72)]
    packed = kernels.pack_int8(proj)
    y = kernels.linear(x, packed, 130)
    # integer sums per group, then scales: equal to the torch path up to fp32 rounding, and to fake quantization
    # (quantize-dequantize both operands per group, an fp32 product) up to reassociation
    torch.testing.assert_close(y, proj(x), rtol=1e-6, atol=1e-4)
    fake = group_fake_quant(x * pre, 32) @ group_fake_quant(w, 32).T
    torch.testing.assert_close(y, fake, rtol=1e-5, atol=1e-3)
    for i in range(9):
        assert torch.equal(kernels.linear(x[i:i + 1], packed, 130)[0], y[i])
    exact = (x * pre) @ w.T
    whole = Int8Linear(w, w.abs().amax(1), None, pre, per_token=True)  # one scale per row / channel
    assert (y - exact).abs().max() < 0.5 * (whole(x) - exact).abs().max()
    with pytest.raises(ValueError, match="per-token activations and a multiple of 4"):
        Int8Linear(w, None, x.abs().amax(), pre, group=30)


@pytest.mark.parametrize("source,qformat", CASES)
def test_qdq_graph_on_onnxruntime_matches_the_fake_quantized_module(small_quantized, source, qformat, tmp_path):
    import onnx
    import onnxruntime as ort

    src, qdir = small_quantized(source, qformat)
    graph = export_qdq_graph(qdir, tmp_path / "model.int8.onnx", precision="fp32", log=lambda _: None)
    proto = onnx.load(str(graph), load_external_data=False)
    ops = [n.op_type for n in proto.graph.node]
    layers, recipe = 2, get_recipe(qformat)
    weights = (4 - len(set(recipe.keep) | set(recipe.tensorrt_keep))) * layers  # kept projections stay fp
    activations = 0 if recipe.weights_only else weights  # static scales even for a per-token recipe (TensorRT's)
    assert ops.count("QuantizeLinear") == activations  # weight quantizers are folded into int8 initializers
    assert ops.count("DequantizeLinear") == weights + activations
    assert sum(i.data_type == onnx.TensorProto.INT8 for i in proto.graph.initializer) == weights

    module = load_quantized_module(qdir)
    inputs = example_inputs(module.config, torch.float32, t=6, past=5, capacity=16)
    with torch.no_grad():
        want = [t.numpy() for t in module(*inputs)]
        plain = TreeVerifyModel.load(src)(*inputs)[0].detach().numpy()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC  # no DQ+MatMul rewrites
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})
    # Weights are the same int8 values (folded with ModelOpt's arithmetic), so weight-only graphs differ only by
    # fp32 reassociation (measured <2e-6 of the largest value). W8A8 activations go through ONNX QuantizeLinear,
    # which divides by amax/127 where ModelOpt multiplies by 127/amax: an ulp apart, enough to round a value on
    # a boundary one int8 step differently, which then propagates (seen: 2e-4 to 1.3e-3 of the largest logit).
    # The FP model misses by more than twice the tolerance in every case (checked: a graph without working
    # Q/DQ fails this test).
    tol = 1e-5 if recipe.weights_only else 1e-2
    for w, g in zip(want, got, strict=True):
        assert np.abs(w - g).max() <= tol * np.abs(w).max()
    assert np.abs(plain - want[0]).max() > 2 * tol * np.abs(want[0]).max()


def test_int8_plan_builds_with_tensorrt_rtx_and_is_smaller_than_fp16(int8_target, draft_dir, engines, tmp_path,
                                                                      capsys):
    from spectrt.build.engines import make_engines
    from spectrt.runtime.engines.onnx_engine import engine_models

    target, _ = int8_target
    # an INT8 build next to the FP16 one reuses what they share (the fp32 graphs, the draft's FP16 graph and plan),
    # as `make engines PRECISION=int8` into an existing folder does: only the target's Q/DQ graph and plan are built
    shutil.copytree(engines, tmp_path / "int8")
    lines = []
    out = make_engines(target, draft_dir, tmp_path / "int8", precision="int8", archs=ARCHS, log=lines.append)
    assert {line.strip() for line in lines if "reusing" in line} == {
        "reusing target/model.fp32.onnx", "reusing draft/model.fp32.onnx", "reusing draft/model.fp16.onnx",
        "reusing draft/model.fp16.plan"}
    manifest = json.loads((out / "manifest.json").read_text())
    fp16 = json.loads((engines / "manifest.json").read_text())
    int8_plan = manifest["models"]["target"]["plans"]["int8"]
    fp16_plan = fp16["models"]["target"]["plans"]["fp16"]
    assert int8_plan["archs"] == fp16_plan["archs"] == ARCHS
    assert manifest["models"]["target"]["graphs"]["int8"]["io"] == fp16["models"]["target"]["graphs"]["fp16"]["io"]
    assert "fp16" in manifest["models"]["draft"]["plans"]  # the draft stays FP16
    size = (out / int8_plan["file"]).stat().st_size
    # int8 q/k/v, o, gate/up (80M weights) + fp16 down-projection and embeddings: measured 0.72x (207 vs 289 MB)
    assert size < 0.8 * (engines / fp16_plan["file"]).stat().st_size
    engine_models(out, "onnxruntime")  # runs the FP graph: says so, and how to run INT8 on the CPU
    assert "--target <the `spectrt quantize` checkpoint>" in capsys.readouterr().err


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [chat_ids(tokenizer, p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3], PROMPTS[5])]


def test_int8_verify_rows_match_single_token_steps(int8_target, prompt_ids):
    ids = torch.tensor(prompt_ids[0])
    n = len(ids) - 4

    def run(engine: Transformer, batched: bool) -> list[torch.Tensor]:
        cache = engine.new_cache(len(ids) + 8, len(ids))
        engine.forward(ids[:n], torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), cache)
        cache.commit(n)
        if batched:  # four chained tokens in one verify forward
            return list(engine.forward(ids[n:], torch.arange(n, n + 4), torch.ones(4, 4, dtype=torch.bool).tril(),
                                       cache))
        rows = []
        for j in range(4):
            rows.append(engine.forward(ids[n + j:n + j + 1], torch.tensor([n + j]), torch.ones(1, 1, dtype=torch.bool),
                                       cache)[0])
            cache.commit(1)
        return rows

    def gap(rows: list[torch.Tensor], steps: list[torch.Tensor]) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(rows, steps, strict=True))

    # The native forward (int8 VNNI GEMMs, fp32 rest) computes every row as a single-token step does: bitwise.
    native = Transformer.load(int8_target[1])
    assert native.native is not None
    for row, step in zip(run(native, batched=True), run(native, batched=False), strict=True):
        assert torch.equal(row, step)
    # The torch reference path is row invariant only through its per-row mode (the fp32 LM head, the last op,
    # still runs batched: ~1e-5 on logits of ~30) ...
    reference = Transformer.load(int8_target[1], native=False)
    steps = run(reference, batched=False)
    invariant = gap(run(reference, batched=True), steps)
    assert invariant <= 1e-4
    # ... and without it, rows depend on the batch shape and int8 rounding amplifies that
    reference.row_invariant = False
    assert gap(run(reference, batched=True), steps) > 100 * max(invariant, 1e-4)


def test_tree_decoding_with_an_int8_target_equals_its_own_greedy_ar(int8_target, draft, prompt_ids):
    """Both trees against one AR and one FP run per prompt (computed once: the two trees used to be two tests
    each redoing them, ~50 s of the suite)."""
    target = Transformer.load(int8_target[1])
    ar = Decoder(target, None, EOS, max_seq_len=512)
    tree = Decoder(target, draft, EOS, max_seq_len=512)
    fp = Decoder(Transformer.load(int8_target[0]), None, EOS, max_seq_len=512)
    differs_from_fp = 0
    accepted = dict.fromkeys(("2,1", "3,2,1"), 0)
    for ids in prompt_ids:
        want = ar.generate(ids, 64).token_ids
        for spec in accepted:
            got = tree.generate(ids, 64, Tree.parse(spec))
            assert got.token_ids == want, spec
            accepted[spec] += sum(got.stats.accepted)
        differs_from_fp += fp.generate(ids, 64).token_ids != want
    # the untrained draft may accept nothing on one prompt (its kernels are timed at load), but not on all
    assert all(n > 0 for n in accepted.values()), accepted  # draft tokens were accepted: paths were compacted
    assert differs_from_fp > 0  # the INT8 target really is another model (W8A8 changes greedy text)


def test_accuracy_metrics_on_small_tensors():
    ref = torch.tensor([[4.0, 1.0, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 2.0], [2.0, 2.5, 0.0]])
    answer = torch.tensor([0, 1, 2, 1])
    same = agreement(ref, ref.clone(), answer)
    assert same["top1_matches"] == 4 and same["kl_sum"] == pytest.approx(0.0, abs=1e-6)
    assert same["nll_reference"] == pytest.approx(same["nll_candidate"])
    cand = ref.clone()
    cand[3] = torch.tensor([2.5, 2.0, 0.0])  # one argmax flipped
    part = agreement(ref, cand, answer)
    p, q = ref[3].log_softmax(-1), cand[3].log_softmax(-1)
    assert part["top1_matches"] == 3
    assert part["kl_sum"] == pytest.approx(float((p.exp() * (p - q)).sum()), rel=1e-5)
    report = summarize(part, gate=0.97)
    assert report["top1_agreement"] == 0.75 and not report["gate_passed"]
    assert report["perplexity_delta_pct"] > 0
    assert "ACCURACY GATE MISSED" in gate_message(report)
    assert "passed" in gate_message(summarize(same, gate=0.97))


def test_accuracy_report_on_the_int8_target(int8_target, prompt_ids, tmp_path, capsys):
    target, int8 = int8_target
    fp = Transformer.load(target)
    records = []
    for ids in prompt_ids[:2]:
        answer = Decoder(fp, None, EOS, max_seq_len=512).generate(ids, 24).token_ids
        records.append({"input_ids": torch.tensor(ids + answer), "prompt_len": len(ids)})
    positions = sum(len(r["input_ids"]) - r["prompt_len"] for r in records)
    logged: list[str] = []
    itself = accuracy_report(target, target, progress=False, log=logged.append, records=records)
    assert itself["positions"] == positions and itself["top1_agreement"] == 1.0 and itself["mean_kl"] < 1e-6
    assert itself["gate_passed"] and "passed" in logged[0] and not capsys.readouterr().err
    # a model that really differs (the target without its last 4 of 30 layers) fails the gate, loudly
    perturbed = accuracy_report(target, slice_target(target, 26, tmp_path / "slice26"), progress=False,
                                log=logged.append, records=records)
    assert not perturbed["gate_passed"] and perturbed["mean_kl"] > 0.1 and len(logged) == 1
    assert "ACCURACY GATE MISSED" in capsys.readouterr().err
    report = accuracy_report(target, int8, progress=False, log=lambda _: None, records=records)
    assert report["mean_kl"] > 1e-4  # quantization changes the distribution ...
    assert report["gate_passed"] == (report["top1_agreement"] >= 0.97)
    assert report["heldout_fingerprint"] == itself["heldout_fingerprint"]  # judged on the same positions


@pytest.fixture(scope="module")
def tiny_target(target_dir, tmp_path_factory) -> dict:
    """A random 2-layer LLaMA with the real tokenizer, its 1-layer draft, its INT8 checkpoints (the default W8A8
    recipe, the static one, weight-only) as `spectrt quantize` names them, and two held-out records."""
    from spectrt.build.slice import TOKENIZER_FILES
    from spectrt.quant.quantize import default_output
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=2)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[:3] *= 30.0
    root = tmp_path_factory.mktemp("tiny_target")
    path = root / "tiny"
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (Path(target_dir) / name).is_file():
            (path / name).write_bytes((Path(target_dir) / name).read_bytes())
    draft = slice_target(path, 1, root / "tiny-draft")
    checkpoints = {q: _quantize(path, default_output(path, q), q, _random_samples(49152))
                   for q in (DEFAULT_QFORMAT, "int8_sq_static", "int8_wo")}
    fp = Transformer.load(path)
    records = []
    for ids in ([1, 9707, 28, 11, 5], [1, 504, 2129, 314]):
        answer = Decoder(fp, None, EOS, max_seq_len=64).generate(ids, 16).token_ids
        records.append({"input_ids": torch.tensor(ids + answer), "prompt_len": len(ids)})
    return {"target": path, "draft": draft, "checkpoints": checkpoints, "records": records}


def test_compare_report_rows_come_from_the_run(tiny_target, tmp_path):
    from spectrt.quant.compare import MODES, VERIFY_T, run_compare

    target = tiny_target["target"]
    models = {"fp32": (target, "fp32"), "bf16": (target, "bf16"),
              DEFAULT_QFORMAT: (tiny_target["checkpoints"][DEFAULT_QFORMAT], "fp32"),
              "int8_wo": (tiny_target["checkpoints"]["int8_wo"], "fp32")}
    sets = {"chat": ["List five animals that live in the ocean.", "What is 12 times 15?"],
            "repetitive": ["Repeat after me: one two three.", "Fix the typo: teh cat sat."]}
    out = tmp_path / "out"
    result = run_compare(target, tiny_target["draft"], models, sets, 12, out, batch=3, progress=False,
                         log=lambda _: None, records=tiny_target["records"])
    rows = {(r["set"], r["precision"], r["mode"]): r for r in result["results"]}
    assert set(rows) == {(s, p, m) for s in sets for p in models for m in MODES}  # every configuration, once
    fields = {"tokens_per_second", "vs_fp32_ar", "vs_bf16_ar", "worst_prompt_vs_own_ar", "tau", "tau_vs_fp32",
              "token_match_vs_fp32", "identical_to_fp32", "equal_to_own_ar"}
    assert all(fields <= set(r) and r["tokens_per_second"] > 0 for r in rows.values())
    for s in sets:
        assert rows[s, "fp32", "AR"]["vs_fp32_ar"] == 1.0 and rows[s, "bf16", "AR"]["vs_bf16_ar"] == 1.0
        assert rows[s, "fp32", "spec"]["identical_to_fp32"] == "2/2"  # lossless against the fp32 target
    precisions = result["precisions"]
    for label, p in precisions.items():
        assert p["exact"]  # every precision here runs the native, row-invariant forward ...
        assert all(rows[s, label, m]["equal_to_own_ar"] == "2/2" for s in sets for m in MODES)  # ... so tree == AR
        assert result["gates"][label]["equal_to_own_ar"]
        assert list(p["verify_ms"]) == [str(t) for t in VERIFY_T] and all(v > 0 for v in p["verify_ms"].values())
    assert precisions[DEFAULT_QFORMAT]["weight_bytes"] < precisions["bf16"]["weight_bytes"] \
        < precisions["fp32"]["weight_bytes"]
    prints = {p["accuracy"]["heldout_fingerprint"] for label, p in precisions.items() if label != "fp32"}
    assert len(prints) == 1 and "accuracy" not in precisions["fp32"]  # one set of held-out positions for all
    assert set(result["gates"][DEFAULT_QFORMAT]) == {"equal_to_own_ar", "top1_agreement", "verify_speedup"}
    assert result["gates"][DEFAULT_QFORMAT]["top1_agreement"] == (
        precisions[DEFAULT_QFORMAT]["accuracy"]["top1_agreement"] >= 0.97)
    batched = {(b["precision"], b["mode"]): b for b in result["batched"]}
    assert set(batched) == {(p, m) for p in models for m in MODES}
    for b in batched.values():  # row-invariant forwards: a batch of requests decodes each exactly as alone
        assert set(b["tokens_per_second"]) == {"1", "3"} and b["batched_equal_to_one_at_a_time"] == "3/3"
    saved = json.loads((out / "compare.json").read_text())
    assert saved["results"] == json.loads(json.dumps(result["results"]))
    table = (out / "compare.md").read_text()
    assert f"| chat | {DEFAULT_QFORMAT} | spec |" in table and "| repetitive | bf16 | AR |" in table
    assert "unverified until a GPU runs it" in table
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_choose_recipe_never_picks_one_that_misses_the_gate():
    rows = [{"name": "fast_but_lossy", "top1_agreement": 0.95, "verify_ms": {"1": 5.0, "8": 7.0}},
            {"name": "slow", "top1_agreement": 0.99, "verify_ms": {"1": 9.0, "8": 12.0}},
            {"name": "fast_enough", "top1_agreement": 0.978, "verify_ms": {"1": 7.0, "8": 9.0}},
            {"name": "barely", "top1_agreement": 0.972, "verify_ms": {"1": 6.0, "8": 8.0}}]
    assert choose_recipe(rows, gate=0.97) == "fast_enough"  # "barely" passes, but within the noise margin
    assert choose_recipe(rows, gate=0.98) == "slow"
    assert choose_recipe(rows, gate=0.995) is None  # nothing passes: nothing becomes the default


def test_recipe_search_judges_every_recipe_on_the_same_positions(tiny_target, tmp_path):
    from spectrt.quant.search import search_recipes

    names = [DEFAULT_QFORMAT, "int8_sq_static", "int8_wo"]
    target = tmp_path / "tiny"  # its own checkpoints (<target>-<recipe>), calibrated here on 2 generated answers
    target.symlink_to(tiny_target["target"])
    result = search_recipes(target, names, tmp_path, records=tiny_target["records"], progress=False,
                            log=lambda _: None, samples=2)
    rows = result["rows"]
    assert [r["name"] for r in rows] == names
    assert len({(r["positions"], r["heldout_fingerprint"]) for r in rows}) == 1
    for r in rows:
        assert r["gate_passed"] == (r["top1_agreement"] >= result["gate_top1"])
        assert set(r["verify_ms"]) == {"1", "4", "8", "16"}
    assert result["chosen"] == choose_recipe([r for r in rows if not r["weights_only"]], result["gate_top1"])
    table = (tmp_path / "recipes.md").read_text()
    for r in rows:
        line = next(x for x in table.splitlines() if x.startswith(f"| `{r['name']}`"))
        assert ("**FAILED**" in line) != r["gate_passed"]
        assert ("(chosen)" in line) == (r["name"] == result["chosen"])
    # and the recipe that misses the gate is never the one chosen, whatever its speed
    worst = min(rows, key=lambda r: r["top1_agreement"])
    assert choose_recipe(rows, worst["top1_agreement"] + 1e-6) != worst["name"]


def test_the_shipped_default_recipe_is_the_measured_choice():
    """bench/results/compare/recipes.json is `spectrt quantize --search` on the embedded target: the default recipe
    must be the one it chose (the fastest W8A8 recipe that passed the gate), never a failed one."""
    measured = json.loads((Path(__file__).resolve().parent.parent / "bench/results/compare/recipes.json").read_text())
    rows = {r["name"]: r for r in measured["rows"]}
    assert measured["chosen"] == DEFAULT_QFORMAT and rows[DEFAULT_QFORMAT]["gate_passed"]
    assert rows[DEFAULT_QFORMAT]["top1_agreement"] >= measured["gate_top1"] >= 0.97
    assert len({r["heldout_fingerprint"] for r in rows.values()}) == 1
    assert set(rows) <= set(RECIPES)


def test_recipes_are_data_the_engines_read(small_quantized):
    _, qdir = small_quantized("tiny", DEFAULT_QFORMAT)
    spec = json.loads((Path(qdir) / "config.json").read_text())["spectrt_quant"]
    assert {k: spec[k] for k in ("activations", "kept_dtype", "keep")} == {
        k: v for k, v in get_recipe(DEFAULT_QFORMAT).meta().items() if k in ("activations", "kept_dtype", "keep")}
    with pytest.raises(ValueError, match="activations must be one of"):
        Recipe("bad", activations="per_channel")
    with pytest.raises(ValueError, match="weight-only recipe keeps fp32"):
        Recipe("bad", weights_only=True, kept_dtype="bf16")


def test_quantize_refuses_bad_input_before_any_work(target_dir, tmp_path):
    out = tmp_path / "never"
    with pytest.raises(QuantizeError, match="--qformat 'int4' is not supported.*int8_sq.*int8_wo"):
        quantize_target(target_dir, out, qformat="int4")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    with pytest.raises(QuantizeError, match="calibration set .* is empty"):
        quantize_target(target_dir, out, calib_prompts=empty)
    overlapping = tmp_path / "calib.txt"
    heldout = read_prompts(HELDOUT_PROMPTS)[3][-1]["content"]
    overlapping.write_text(f"Tell me a joke.\n{heldout}\n")
    with pytest.raises(QuantizeError, match="overlap the evaluation set .*heldout.txt"):
        quantize_target(target_dir, out, calib_prompts=overlapping)
    with pytest.raises(QuantizeError, match="at least 1 calibration sample"):
        quantize_target(target_dir, out, samples=0)
    assert not out.exists()
    lone = tmp_path / "lone"
    lone.symlink_to(Path(target_dir).resolve())
    with pytest.raises(QuantizeError, match="no INT8 checkpoint.*spectrt quantize"):
        export_qdq_graph(lone, tmp_path / "g.onnx")


def test_cli_errors_name_the_fix(capsys):
    from spectrt.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["quantize", "--qformat", "fp4"])
    assert exit_info.value.code == 2
    assert "spectrt: error: --qformat 'fp4' is not supported" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # compare measures the CPU engines: a --backend would be ignored
        main(["compare", "--backend", "onnxruntime"])
    assert exit_info.value.code == 2
    assert "compare runs every precision" in capsys.readouterr().err


def test_a_quantized_checkpoint_is_not_a_plain_hf_checkpoint(small_quantized):
    from spectrt.runtime.engines.checkpoint import default_draft

    src, qdir = small_quantized("tiny", "int8_sq")
    assert default_draft(qdir) == default_draft(src)  # an INT8 target speculates with its FP source's draft
    assert not any(p.name == "model.safetensors" for p in Path(qdir).iterdir())  # HF loaders refuse it
    assert oct(os.stat(Path(qdir) / "quantized.safetensors").st_mode & 0o777) == "0o644"
    with pytest.raises(ValueError, match="use --dtype fp32"):
        Transformer.load(qdir, torch.bfloat16)
