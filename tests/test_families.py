"""Users' own targets: Llama 3.x (llama3 RoPE), Mistral, Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k norms,
head_dim independent of the hidden size) through every path, on tiny random checkpoints made here with transformers.

Each family's checkpoint (2 layers, hidden 64, the embedded tokenizer's 49152-token vocabulary and files) is saved
with `save_pretrained`; norms and biases are randomized (transformers initialises them to 1 and 0, which would hide
a missing bias or norm). Checked per family: logits vs Hugging Face, greedy tree decoding == autoregressive, the
tree-verify ONNX graph vs torch, a sliced draft, INT8 (W8A8) engine vs the fake-quantized module, and engines
(FP16 graphs + TensorRT-RTX plans built on the CPU, manifest round trip). Unsupported features are refused at load.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import COMMON, FAMILIES, VOCAB
from spectrt.build.export import TreeVerifyModel, example_inputs, export_graph
from spectrt.build.slice import load_state_dict, slice_target
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.checkpoint import CheckpointError, resolve_target
from spectrt.runtime.engines.engine import check_draft_matches, load_engine
from spectrt.runtime.engines.families import rope_frequencies
from spectrt.runtime.engines.model import ModelConfig, Transformer

REPO = Path(__file__).resolve().parent.parent

@pytest.fixture(scope="module")
def checkpoints(family_checkpoints):
    return family_checkpoints


@pytest.fixture(scope="module")
def drafts(checkpoints, tmp_path_factory):
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = slice_target(checkpoints(family), 1, tmp_path_factory.mktemp(f"{family}-draft"))
        return made[family]

    return get


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _causal(t: int) -> torch.Tensor:
    return torch.ones(t, t, dtype=torch.bool).tril()


@pytest.mark.parametrize("family", FAMILIES + ["llama-linear", "llama-yarn-bias", "qwen3-bias"])
def test_engine_matches_hugging_face(checkpoints, family):
    from transformers import AutoModelForCausalLM

    path = checkpoints(family)
    ids = _ids(100)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    engine = Transformer.load(path)
    cache = engine.new_cache(128, 80)
    first = engine.forward(ids[:80], torch.arange(80), _causal(80), cache)  # positions past llama3/YaRN's 64
    cache.commit(80)
    got = torch.cat([first, engine.forward(ids[80:], torch.arange(80, 100), _causal(20), cache)])
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())
    # the family's extra tensors are used: dropping them moves the logits far more than the tolerance
    c = engine.config
    assert c.attention_bias == (family in ("qwen2", "llama-yarn-bias", "qwen3-bias"))
    assert c.qk_norm == family.startswith("qwen3") and bool(c.rope_scaling) == (family.startswith("llama"))


@pytest.mark.parametrize("rope", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.1
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},  # Llama 3.2
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},  # Qwen2.5 long context
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
     "mscale": 1.0, "mscale_all_dim": 0.707, "truncate": False},
])
def test_rope_tables_equal_hugging_face_at_real_sizes(rope, tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(hidden_size=4096, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
                     rope_parameters={**rope, "rope_theta": 500000.0})
    (tmp_path / "config.json").write_text(hf.to_json_string())
    want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    got, scale = rope_frequencies(ModelConfig.from_dir(tmp_path))
    assert torch.allclose(got, want, rtol=1e-6, atol=0) and scale == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tree_decoding_equals_autoregressive(checkpoints, drafts, family):
    target = Transformer.load(checkpoints(family))
    prompt = _ids(12, seed=2).tolist()
    ar = Decoder(target, None, set(), max_seq_len=128).generate(prompt, 40)
    for draft, spec in ((Transformer.load(drafts(family)), "2,1"), (target, "2,1,1")):
        result = Decoder(target, draft, set(), max_seq_len=128).generate(prompt, 40, Tree.parse(spec))
        assert result.token_ids == ar.token_ids
    assert max(result.stats.accepted) == 3  # the target drafting for itself: whole paths accepted and compacted


@pytest.mark.parametrize("family", FAMILIES)
def test_onnx_graph_matches_torch(checkpoints, family, tmp_path):
    from spectrt.runtime.engines.onnx_engine import OnnxEngine

    path = checkpoints(family)
    graph = export_graph(path, tmp_path / "model.fp32.onnx", "fp32", log=lambda _: None)
    reference = Transformer.load(path)
    ort = OnnxEngine(graph, reference.config, optimization="basic")
    caches = reference.new_cache(64, 32), ort.new_cache(64, 32)
    tree = Tree.parse("3,2,1")
    outs = []
    for engine, cache in zip((reference, ort), caches, strict=True):
        a = engine.forward(_ids(20), torch.arange(20), _causal(20), cache).clone()  # ORT reuses its output buffer
        cache.commit(20)
        b = engine.forward(_ids(len(tree), seed=3), tree.positions(20), tree.mask, cache)
        outs.append(torch.cat([a, b]).float())
    assert float((outs[0] - outs[1]).abs().max()) <= 1e-4 * float(outs[0].abs().max())
    used = 20 + len(tree)
    for ref, got in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
        assert float((ref[:, :, :used] - got[:, :, :used].float()).abs().max()) <= 1e-4 * float(ref.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_sliced_draft_carries_the_family_tensors(checkpoints, drafts, family):
    from transformers import AutoConfig

    target, draft = checkpoints(family), drafts(family)
    check_draft_matches(target, draft)
    t_state, d_state = load_state_dict(target), load_state_dict(draft)
    layer0 = {n for n in t_state if n.startswith("model.layers.0.")}
    assert layer0 <= d_state.keys() and not any(n.startswith("model.layers.1.") for n in d_state)
    assert all(torch.equal(t_state[n], d_state[n]) for n in layer0)
    config = ModelConfig.from_dir(draft)
    AutoConfig.from_pretrained(draft)  # transformers loads the slice too (the draft maker trains it with transformers)
    assert (config.attention_bias, config.qk_norm, config.rope_scaling) == (
        ModelConfig.from_dir(target).attention_bias, ModelConfig.from_dir(target).qk_norm,
        ModelConfig.from_dir(target).rope_scaling)
    assert Transformer.load(draft).forward(_ids(8), torch.arange(8), _causal(8), Transformer.load(draft).new_cache(
        16, 8)).isfinite().all()


@pytest.mark.parametrize("family", FAMILIES)
def test_int8_engine_matches_the_fake_quantized_module(checkpoints, family, tmp_path):
    import onnxruntime as ort
    from spectrt.quant.quantize import (
        calibrate,
        export_qdq_graph,
        forward_sequence,
        load_quantized_module,
        save_quantized,
    )
    from spectrt.runtime.engines.int8 import Int8Linear

    src = checkpoints(family)
    samples = [_ids(32, seed=s) for s in range(4)]
    model = calibrate(TreeVerifyModel.load(src), "int8_sq", samples, progress=False)
    qdir = save_quantized(model, src, tmp_path / "int8", {"qformat": "int8_sq", "target": str(src)})
    module, engine = load_quantized_module(qdir), Transformer.load(qdir)
    assert isinstance(engine.layers[0]["wqkv"], Int8Linear)
    ids = _ids(40, seed=5)
    with torch.no_grad():
        want = forward_sequence(module, ids)
        plain = forward_sequence(TreeVerifyModel.load(src), ids)
    got = engine.forward(ids, torch.arange(40), _causal(40), engine.new_cache(40, 40))
    tol = 1e-4 * float(want.abs().max())  # int8 operands are the fake quantizer's: fp32 reassociation only
    assert float((got - want).abs().max()) <= tol
    assert float((plain - want).abs().max()) > 10 * tol  # quantization did happen

    # the Q/DQ graph TensorRT compiles into an INT8 plan (fp32 remainder here, for ONNX Runtime); the tolerance is
    # tests/test_quant.py's: QuantizeLinear divides where ModelOpt multiplies, so a boundary value may round apart.
    # Exported for an EAGLE-3 head: the feature rows of its layers come out too, and match the module's
    graph = export_qdq_graph(qdir, tmp_path / "model.int8.onnx", precision="fp32", log=lambda _: None,
                             feature_layers=(1, 2, 2))
    module.feature_layers = (1, 2, 2)
    inputs = example_inputs(module.config, torch.float32, t=6, past=5, capacity=16)
    with torch.no_grad():
        want = [t.numpy() for t in module(*inputs)]
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})
    assert [o.name for o in session.get_outputs()] == ["logits", "new_k", "new_v", "features"]
    for w, g in zip(want, got, strict=True):
        assert np.abs(w - g).max() <= 1e-2 * np.abs(w).max()


@pytest.mark.parametrize("family", FAMILIES)
def test_engines_build_and_run(checkpoints, drafts, family, tmp_path):
    """FP16 graphs + TensorRT-RTX plans (built on the CPU; executing them needs a GPU) and the fp32 graphs on ONNX
    Runtime through the engines directory, whose manifest carries the family's config (RoPE scaling included)."""
    from spectrt.build.engines import make_engines

    target, draft = checkpoints(family), drafts(family)
    out = make_engines(target, draft, tmp_path / family, precision="fp16", archs=["sm86"], max_seq_len=128,
                       max_tree_tokens=16, log=lambda _: None)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["models"]["target"]["plans"]["fp16"]["bytes"] > 0
    engine = load_engine(out / "target", "onnxruntime")
    assert engine.config == ModelConfig.from_dir(target)
    # the fp16 graph the plan is compiled from (biases, q/k norms and the RoPE table in fp16), run by ONNX Runtime
    import onnxruntime as ort

    graph = out / manifest["models"]["target"]["graphs"]["fp16"]["file"]
    inputs = example_inputs(engine.config, torch.float16, t=6, past=5, capacity=16)
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})[0]
    with torch.no_grad():
        want = TreeVerifyModel.load(target)(*inputs[:-2], inputs[-2].float(), inputs[-1].float())[0].numpy()
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    reference = Transformer.load(target)
    prompt = _ids(10, seed=4).tolist()
    ar = Decoder(reference, None, set(), max_seq_len=96).generate(prompt, 24)
    spec = Decoder(engine, load_engine(out / "draft", "onnxruntime"), set(), max_seq_len=96)
    assert spec.generate(prompt, 24, Tree.parse("2,1")).token_ids == ar.token_ids


def test_draft_maker_distills_a_family_slice(checkpoints, tmp_path):
    """`spectrt draft` end to end on Qwen2 (biases in the trained layer): target answers, training, a draft the
    runtime accepts and decodes with losslessly."""
    from spectrt.build.draft import make_draft

    target = checkpoints("qwen2")
    (tmp_path / "train.txt").write_text("Name three colors.\nWhat is two plus two?\nSay hello.\n")
    (tmp_path / "heldout.txt").write_text("Count to five.\n")
    draft = make_draft(target, tmp_path / "draft", layers=1, budget_minutes=0.5, prompts=tmp_path / "train.txt",
                       heldout=tmp_path / "heldout.txt", max_steps=3, progress=False, max_new_tokens=16,
                       eval_max_new_tokens=16, samples_per_prompt=1)
    check_draft_matches(target, draft)
    report = json.loads((draft / "draft_report.json").read_text())
    assert report["train"]["steps"] == 3
    trained, sliced = load_state_dict(draft), load_state_dict(target)
    bias = "model.layers.0.self_attn.q_proj.bias"
    assert not torch.equal(trained[bias], sliced[bias])
    target_engine = Transformer.load(target)
    prompt = _ids(12, seed=6).tolist()
    ar = Decoder(target_engine, None, set(), max_seq_len=96).generate(prompt, 24)
    spec = Decoder(target_engine, Transformer.load(draft), set(), max_seq_len=96)
    assert spec.generate(prompt, 24, Tree.parse("2,1")).token_ids == ar.token_ids


def test_cli_generate_tree_equals_no_spec(checkpoints, drafts):
    target, draft = checkpoints("qwen3"), drafts("qwen3")

    def generate(*extra: str) -> dict:
        args = ["generate", "--target", str(target), "--prompt", "Name three colors.", "--max-new-tokens", "20",
                "--json", *extra]
        result = subprocess.run([sys.executable, "-m", "spectrt", *args], cwd=REPO, capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    spec, ar = generate("--draft", str(draft), "--tree", "2,1"), generate("--no-spec")
    assert spec["token_ids"] == ar["token_ids"] and spec["text"] == ar["text"]
    assert spec["stats"]["draft_passes"] > 0 and ar["stats"]["draft_passes"] == 0


# ---- refused at load, with the model type and the feature named ----

def _config(base: str, **changes) -> dict:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[base]
    raw = cls(**COMMON).to_dict()
    raw.update(changes)
    return raw


REFUSED = [
    (lambda: _config("mistral", sliding_window=1024), "'mistral' model with sliding-window attention"),
    (lambda: _config("qwen2", use_sliding_window=True, sliding_window=512, max_window_layers=1,
                     layer_types=["full_attention", "sliding_attention"]), "'qwen2' model with sliding-window"),
    (lambda: _config("mistral", model_type="mixtral", num_local_experts=8), "'mixtral' model with mixture-of-experts"),
    (lambda: _config("qwen2", model_type="qwen2_moe", num_experts=4), "'qwen2_moe' model with mixture-of-experts"),
    (lambda: _config("qwen2", model_type="qwen2_vl", vision_config={"depth": 2}), "'qwen2_vl' model with multimodal"),
    (lambda: _config("llama", model_type="gpt_neox"), "model_type 'gpt_neox' is not supported"),
    (lambda: _config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "'llama' model with dynamic NTK RoPE scaling"),
    (lambda: _config("llama", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "RoPE type 'longrope'"),
    (lambda: _config("llama", rope_scaling={"type": "llama3", "factor": 8.0}), "needs ['low_freq_factor'"),
    (lambda: _config("llama", mlp_bias=True), "'llama' model with MLP biases"),
    (lambda: _config("llama", hidden_act="gelu"), "'llama' model with activation 'gelu'"),
]


@pytest.mark.parametrize("make, message", REFUSED)
def test_unsupported_features_are_refused_at_load(make, message, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(make()))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_dir(tmp_path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        resolve_target(tmp_path)


def test_sliding_window_covering_the_context_is_full_attention(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_config("mistral", sliding_window=4096)))
    assert ModelConfig.from_dir(tmp_path).num_layers == 2


@pytest.mark.parametrize("scaling", ["rope_freqs", "yarn"])
def test_gguf_with_rope_scaling_transformers_drops_is_refused(scaling, tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if scaling == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
    else:  # how llama.cpp stores a Llama 3.x model's llama3 RoPE scaling
        writer.add_tensor("rope_freqs.weight", np.ones(8, dtype=np.float32))
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match="RoPE scaling, which transformers' GGUF loader drops"):
        resolve_target(path, artifacts=tmp_path / "artifacts")


@pytest.mark.parametrize(("field", "value", "tensor"), [
    ("intermediate_size", 2 * COMMON["intermediate_size"], "model.layers.0.mlp.gate_proj.weight"),
    ("vocab_size", 2 * VOCAB, "model.embed_tokens.weight"),
    ("num_hidden_layers", COMMON["num_hidden_layers"] + 1, f"model.layers.{COMMON['num_hidden_layers']}."),
])
def test_a_config_that_disagrees_with_its_tensors_is_refused_naming_the_tensor(checkpoints, field, value, tensor,
                                                                             tmp_path):
    """The native forward sizes every loop from config.json: an edited copy used to read weights out of bounds
    (garbage, or a segfault that took a served instance down); the load now names the tensor and the fix."""
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(checkpoints("llama3"), copy)
    config = json.loads((copy / "config.json").read_text())
    config[field] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=re.escape(tensor)) as refused:
        Transformer.load(copy)
    assert "config.json" in str(refused.value)


@pytest.mark.unit
def test_a_context_past_the_trained_one_is_refused(tmp_path):
    from spectrt.runtime.decoding.pipeline import check_context

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
    check_context(tmp_path, 2048)
    with pytest.raises(ValueError, match=r"--max-seq-len 4096 exceeds .* trained context of 2048 tokens"):
        check_context(tmp_path, 4096)
    (tmp_path / "config.json").write_text(json.dumps({}))  # no limit stated: nothing to check against
    check_context(tmp_path, 1 << 20)
