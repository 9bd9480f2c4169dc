"""Prepared device check (called by scripts/gpu_check.sh): TensorRT tree decoding vs the torch backend.

On a machine with an NVIDIA GPU:
1. the embedded pair (artifacts/smollm2-135m-instruct + its draft) when present, else **random weights of
   the real SmolLM2-135M shapes** (the checkpoint cannot travel to every GPU machine; said in the JSON);
2. if a TensorRT module is importable (`tensorrt`, or `tensorrt_rtx` on a GPU it supports): build (or load,
   --engines DIR) FP32 and FP16 plans, run greedy tree decoding with the `tensorrt` backend and assert the
   FP32 plan's output (AR and trees) equals the torch backend's greedy AR output (FP16: agreement with AR
   and with torch reported as rates: near-ties flip in half precision); **batched verification**: one plan
   execution over a batch mixing a prompt chunk, a chain, a tree, a single token and a draft level, against
   ONNX Runtime running the same batched graph (the engines dir's fp32 ONNX); and tokens/s of the batched decode
   loop at batch 1 and batch 8;
3. always: the torch engine on CUDA (fp32, bf16): tree == AR asserted in fp32, verify cost vs T (1..64),
   tokens/s for AR and trees, and at batch 1 and 8; with TensorRT the same numbers for the plans.
4. engines whose draft is an EAGLE-3 head (manifest `models.draft.kind == "eagle3"`, the target's plan returning
   `features` of `models.target.feature_layers`): the draft is the head's plan (GraphHead over TensorRTEngine), and
   the head check compares both plans with ONNX Runtime on the engines dir's fp32 graphs: a prompt chunk through
   the target (logits, features), the head's catch-up over the reference's features, one draft level from hidden
   rows and a catch-up of a few accepted rows (max |diff| of logits and hidden, top-1 agreement). **Unverified:**
   written without a GPU with TensorRT (its logic ran on a CPU with TensorRT stood in by ONNX Runtime only).
Without TensorRT it says so in the JSON (`tensorrt.available: false` + the reason) and measures the torch
engine alone. `--device cpu` runs the same code on a CPU (a smoke test of this script; with --engines also
the onnxruntime backend). Results: one JSON file (--out). Exit status 0 = all assertions held.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
SMOLLM2 = {  # SmolLM2-135M-Instruct's config.json (what random weights are shaped like)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True,
    "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
TREES = ["2,1", "3,2,1", "1,1,1"]
TOKENS = [1, 2, 4, 8, 16, 32, 64]


class Check:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self.start = time.perf_counter()
        self.results: dict = {"checks": [], "skipped": []}
        self.failed = False

    def left(self) -> float:
        return self.deadline - (time.perf_counter() - self.start)

    def log(self, msg: str) -> None:
        print(f"[gpu_check {time.perf_counter() - self.start:6.1f}s] {msg}", flush=True)

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.results["checks"].append({"name": name, "ok": bool(ok), "detail": detail})
        self.failed |= not ok
        self.log(f"{'PASS' if ok else 'FAIL'} {name} {detail}")


# --------------------------------------------------------------------------------------------------
# models


def random_weights(config: dict, device: torch.device, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(seed)
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    rnd = lambda *shape: torch.randn(*shape, generator=g, device=device) * 0.02  # noqa: E731
    w = {"model.embed_tokens.weight": rnd(config["vocab_size"], h), "model.norm.weight": torch.ones(h, device=device)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": rnd(q, h), p + "self_attn.k_proj.weight": rnd(kv, h),
              p + "self_attn.v_proj.weight": rnd(kv, h), p + "self_attn.o_proj.weight": rnd(h, q),
              p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
              p + "mlp.down_proj.weight": rnd(h, inter),
              p + "input_layernorm.weight": torch.ones(h, device=device),
              p + "post_attention_layernorm.weight": torch.ones(h, device=device)}
    return w


def write_checkpoint(weights: dict, config: dict, layers: int, out: Path) -> Path:
    """A HF-style dir (config.json, safetensors, a stand-in tokenizer.json) that build/engines.py accepts."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    keep = {k: v.detach().float().cpu().contiguous() for k, v in weights.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    (out / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {}}, "added_tokens": []}))
    return out


class TorchOn:
    """The torch engine (runtime/engines/model.py) on a device, returning host logits like the tensorrt engine."""

    def __init__(self, config, weights, dtype: torch.dtype, device: torch.device):
        from spectrt.runtime.engines.model import Transformer

        self.device = device
        # the torch reference path (the native forward is a CPU kernel; on CPU this script measures the reference)
        self.model = Transformer(config, weights, dtype, measure_kernels=device.type == "cpu", native=False)
        self.model.inv_freq = self.model.inv_freq.to(device)
        self.config = config

    def new_caches(self, slots: int, capacity: int, max_window: int):
        from spectrt.runtime.engines.model import KVCache

        with torch.device(self.device):
            return KVCache.pool(self.config, slots, capacity, max_window, self.model.dtype)

    def new_cache(self, capacity: int, max_window: int):
        return self.new_caches(1, capacity, max_window)[0]

    def forward(self, tokens, positions, tree_mask, cache):
        d = self.device
        return self.model.forward(tokens.to(d), positions.to(d), tree_mask.to(d), cache).cpu()

    def forward_many(self, segments, logit_rows=None):  # the torch reference path runs one segment at a time
        from spectrt.runtime.engines.kernels import last_rows

        return last_rows([self.forward(*segment) for segment in segments], logit_rows)


def smollm2_config(layers: int | None = None):
    from spectrt.runtime.engines.model import ModelConfig

    c = SMOLLM2
    return ModelConfig(c["vocab_size"], c["hidden_size"], c["intermediate_size"], layers or c["num_hidden_layers"],
                       c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rms_norm_eps"],
                       c["rope_theta"], c["tie_word_embeddings"])


def load_pair(device: torch.device, dtype: torch.dtype, target_dir: Path | None, draft_dir: Path | None,
              weights: dict | None = None):
    """(target, draft, target weights): the checkpoint's, or random real-shaped ones (draft = first 4 layers)."""
    from spectrt.runtime.engines.model import ModelConfig

    if target_dir is None:
        weights = weights if weights is not None else random_weights(SMOLLM2, device)
        return (TorchOn(smollm2_config(), weights, dtype, device), TorchOn(smollm2_config(4), weights, dtype, device),
                weights)
    from spectrt.build.slice import load_state_dict

    config = ModelConfig.from_dir(target_dir)
    weights = {k: v.to(device) for k, v in load_state_dict(target_dir).items()}
    if draft_dir is not None:
        d_config = ModelConfig.from_dir(draft_dir)
        d_weights = {k: v.to(device) for k, v in load_state_dict(draft_dir).items()}
    else:
        d_config, d_weights = dataclasses.replace(config, num_layers=4), weights
    return TorchOn(config, weights, dtype, device), TorchOn(d_config, d_weights, dtype, device), weights


def prompts(target_dir: Path | None, n: int) -> list[list[int]]:
    texts = ["Write a Python function that checks whether a number is prime.",
             "Explain what photosynthesis is to a child.", "List five animals that live in the ocean.",
             "Give three tips for learning a new language."][:n]
    if target_dir is not None and (target_dir / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target_dir)
        return [list(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"]) for t in texts]
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (60 + 10 * i,), generator=g).tolist() for i in range(n)]


# --------------------------------------------------------------------------------------------------
# measurements


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def verify_cost(engine, device: torch.device, tokens=TOKENS, past: int = 256, iters: int = 20) -> dict:
    """Median ms of one forward of T causal new tokens after `past` cached ones."""
    cache = engine.new_cache(past + max(tokens) + 64, max(tokens))
    out = {}
    for t in tokens:
        cache.length = past
        ids = torch.randint(3, engine.config.vocab_size, (t,))
        pos = torch.arange(past, past + t)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        for _ in range(3):
            engine.forward(ids, pos, mask, cache)
        sync(device)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            engine.forward(ids, pos, mask, cache)
            sync(device)
            times.append(time.perf_counter() - start)
        out[t] = round(statistics.median(times) * 1000, 3)
    return out


def decode_all(target, draft, ids_list, tree_spec: str | None, new_tokens: int, max_seq_len: int = 512):
    from spectrt.runtime.decoding.decoder import Decoder
    from spectrt.runtime.decoding.tree import Tree

    decoder = Decoder(target, draft if tree_spec else None, {2}, max_seq_len=max_seq_len, max_tree_tokens=64)
    outs, tokens, seconds, passes = [], 0, 0.0, 0
    for ids in ids_list:
        r = decoder.generate(ids, new_tokens, Tree.parse(tree_spec) if tree_spec else None)
        outs.append(r.token_ids)
        tokens += r.stats.new_tokens
        seconds += r.stats.decode_seconds
        passes += r.stats.target_passes
    return outs, {"tokens_per_s": round(tokens / seconds, 2) if seconds else None,
                  "tau": round(tokens / max(passes, 1), 3)}


def bench_engine(ck: Check, label: str, target, draft, device, ids_list, new_tokens: int, exact: bool,
                 reference: list[list[int]] | None = None, trees=TREES, tokens=TOKENS) -> tuple[dict, list]:
    """Verify cost vs T, tokens/s for AR and trees, tree == AR (and == reference when given)."""
    res: dict = {}
    ck.log(f"{label}: verify cost vs T")
    res["verify_ms"] = verify_cost(target, device, tokens)
    ck.log(f"{label}: verify ms {res['verify_ms']}")
    ar, res["autoregressive"] = decode_all(target, None, ids_list, None, new_tokens)
    if reference is not None:
        same = sum(a == b for a, b in zip(ar, reference, strict=True))
        if exact:
            ck.check(f"{label} AR == torch AR", same == len(ar), f"{same}/{len(ar)} prompts")
        res["ar_equal_to_torch_fp32"] = f"{same}/{len(ar)}"
    for spec in trees:
        if ck.left() < 30:
            ck.results["skipped"].append(f"{label} tree {spec} (time)")
            continue
        for name, d in (("draft", draft), ("self", target)):
            outs, stats = decode_all(target, d, ids_list, spec, new_tokens)
            same = sum(a == b for a, b in zip(outs, ar, strict=True))
            res[f"tree {spec} ({name}-drafted)"] = {**stats, "equal_to_ar": f"{same}/{len(ar)}"}
            if exact:  # fp32: greedy tree decoding is lossless token for token
                ck.check(f"{label} tree {spec} ({name}-drafted) == AR", same == len(ar), f"{same}/{len(ar)}; {stats}")
            else:  # fp16/bf16: near-ties flip when GEMM shapes change, so this is a rate, not an assertion
                ck.log(f"{label} tree {spec} ({name}-drafted): equal to AR {same}/{len(ar)}; {stats}")
            if reference is not None and exact:
                ref_same = sum(a == b for a, b in zip(outs, reference, strict=True))
                ck.check(f"{label} tree {spec} ({name}-drafted) == torch AR", ref_same == len(ar),
                         f"{ref_same}/{len(ar)}")
    return res, ar


def mixed_batch(engine, vocab: int, seed: int = 5) -> list[torch.Tensor]:
    """Logits of one forward_many over five requests: a prompt chunk at past 0, a chain after 30 tokens, a 3,2,1
    tree after 17, one token after 40, a draft's second level of a 2,2 tree (W = 6 > T = 4) after 12 + its first."""
    from spectrt.runtime.decoding.tree import Tree

    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g)  # noqa: E731
    causal = lambda n: torch.ones(n, n, dtype=torch.bool).tril()  # noqa: E731
    caches = engine.new_caches(5, 256, 48)
    tree, level = Tree.parse("3,2,1"), Tree.parse("2,2")
    for cache, n in zip(caches[1:], (30, 17, 40, 12), strict=True):
        engine.forward(ids(n), torch.arange(n), causal(n), cache)
        cache.commit(n)
    engine.forward(ids(2), level.positions(12)[1:3], level.mask[1:3, 1:3], caches[4])
    return engine.forward_many([(ids(24), torch.arange(24), causal(24), caches[0]),
                                (ids(4), torch.arange(30, 34), causal(4), caches[1]),
                                (ids(len(tree)), tree.positions(17), tree.mask, caches[2]),
                                (ids(1), torch.tensor([40]), causal(1), caches[3]),
                                (ids(4), level.positions(12)[3:], level.mask[3:, 1:], caches[4])])


def batched_parity(ck: Check, label: str, engine, reference, exact: bool) -> dict:
    """`engine`'s batched forward against `reference`'s (the same batch): max |diff| / max |logit| and top-1
    agreement; asserted tight for fp32, a floor for half precision."""
    got, want = mixed_batch(engine, engine.config.vocab_size), mixed_batch(reference, reference.config.vocab_size)
    rel = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
              for a, b in zip(got, want, strict=True))
    agree = float(torch.cat([(a.argmax(-1) == b.argmax(-1)).float() for a, b in zip(got, want, strict=True)]).mean())
    res = {"max_rel_diff": round(rel, 6), "top1_agreement": round(agree, 4)}
    if exact:
        ck.check(f"{label} batched verification == reference", rel <= 1e-3 and agree >= 0.99, str(res))
    else:
        ck.check(f"{label} batched verification ~ reference", agree >= 0.9, str(res))
    return res


def batch_throughput(ck: Check, label: str, target, draft, ids_list, new_tokens: int, tree: str | None,
                     batches=(1, 8), invariant: bool = False) -> dict:
    """Decode tokens/s of the batched decode loop (decoding/decoder.py) at each batch size over the same 8 requests
    (the prompts cycled), wall time of the whole run; greedy outputs at every batch size compared with batch 1's
    (asserted equal for a batch-invariant engine: ONNX Runtime's fp32 graph, the per-segment torch path)."""
    from spectrt.runtime.decoding.decoder import Decoder, Job
    from spectrt.runtime.decoding.tree import Tree

    jobs = lambda: [Job(ids_list[i % len(ids_list)], new_tokens, Tree.parse(tree) if tree else None)  # noqa: E731
                    for i in range(max(batches))]
    res, first = {"tree": tree or "none (target alone)", "requests": max(batches)}, None
    for b in batches:
        decoder = Decoder(target, draft if tree else None, {2}, max_seq_len=512, max_tree_tokens=64,
                          max_active=b)
        decoder.run(jobs()[:2])  # warm-up (first forwards, CUDA graph capture)
        start = time.perf_counter()
        done = decoder.run(jobs())
        wall = time.perf_counter() - start
        tokens = sum(len(j.out) for j in done)
        res[f"batch {b}"] = {"tokens_per_s": round(tokens / wall, 2), "wall_s": round(wall, 2), "tokens": tokens}
        outs = [j.out for j in done]
        if first is None:
            first = outs
        else:
            same = sum(a == o for a, o in zip(first, outs, strict=True))
            res[f"batch {b}"]["equal_to_batch_1"] = f"{same}/{len(outs)}"
            if invariant:
                ck.check(f"{label} batch {b} == batch 1 (greedy)", same == len(outs), f"{same}/{len(outs)}")
        ck.log(f"{label} batch {b}: {res[f'batch {b}']}")
    if len(batches) > 1:
        res["speedup"] = round(res[f"batch {batches[-1]}"]["tokens_per_s"] / res[f"batch {batches[0]}"]["tokens_per_s"],
                               2)
    return res


# --------------------------------------------------------------------------------------------------
# TensorRT


def trt_available() -> tuple[object | None, str]:
    try:
        from spectrt.build.compile import trt_module

        trt = trt_module()
        return trt, f"{trt.__name__} {trt.__version__}"
    except Exception as e:
        return None, str(e)


def trt_section(ck: Check, args, device, weights, target_dir, draft_dir, ids_list, reference, trees=TREES,
                tokens=TOKENS) -> dict:
    from spectrt.build.compile import RTX_ARCHS
    from spectrt.runtime.engines.graph_head import GraphHead
    from spectrt.runtime.engines.trt_engine import TensorRTEngine, device_arch

    trt, why = trt_available()
    if trt is None:
        return {"available": False, "reason": f"no TensorRT Python module on this machine ({why}); measured the "
                "torch engine on CUDA instead"}
    arch = device_arch()
    if trt.__name__ == "tensorrt_rtx" and arch not in RTX_ARCHS:
        return {"available": False, "module": why, "reason": f"TensorRT-RTX has no {arch} target (supports "
                f"{','.join(RTX_ARCHS)}); install NVIDIA's `tensorrt` here to build native plans"}
    out: dict = {"available": True, "module": why, "arch": arch}
    from spectrt.build.engines import make_engines

    if args.engines is not None and (args.engines / "manifest.json").is_file():  # plans built elsewhere
        manifest = json.loads((args.engines / "manifest.json").read_text())
        built = {manifest["precision"]: args.engines}
    else:
        built = {}
    work = Path(args.engines) if args.engines and not built else Path(tempfile.mkdtemp(prefix="spectrt-engines-"))
    if not built and target_dir is None:
        target_dir = write_checkpoint(weights, SMOLLM2, SMOLLM2["num_hidden_layers"], work / "random-target")
        draft_dir = write_checkpoint(weights, SMOLLM2, 4, work / "random-draft")
    elif not built and draft_dir is None:
        from spectrt.build.slice import slice_target

        draft_dir = slice_target(target_dir, 4, work / "slice4")
    for precision in list(built) or ["fp32", "fp16"]:
        if ck.left() < 120:
            ck.results["skipped"].append(f"tensorrt {precision} (time)")
            continue
        start = time.perf_counter()
        if precision in built:
            engines = built[precision]
            ck.log(f"tensorrt {precision}: loading the plans in {engines}")
        else:
            ck.log(f"tensorrt {precision}: building plans in {work}")
            engines = make_engines(target_dir, draft_dir, work / f"pair-{precision}", precision=precision,
                                   archs=[arch], max_seq_len=1024, max_tree_tokens=64, log=ck.log)
        build_s = time.perf_counter() - start
        manifest = json.loads((engines / "manifest.json").read_text())
        eagle3 = manifest["models"]["draft"].get("kind") == "eagle3"
        target = TensorRTEngine.load(engines / "target")
        if eagle3:  # the head's plan behind Eagle3Head's interface (it drafts from the target plan's features)
            draft = GraphHead.load(engines / "draft", target.config, backend="tensorrt")
        else:
            draft = TensorRTEngine.load(engines / "draft")
        res, _ = bench_engine(ck, f"tensorrt {precision}", target, draft, device, ids_list, args.new_tokens,
                              exact=precision == "fp32", reference=reference, trees=trees, tokens=tokens)
        res["batched_verification_vs_onnxruntime"] = {
            role: batched_parity(ck, f"tensorrt {precision} {role}", engine, ort_reference(engines, role),
                                 exact=precision == "fp32")
            for role, engine in (("target", target),) + ((("draft", draft),) if not eagle3 else ())}
        if eagle3:
            ref_target = ort_reference(engines, "target")
            res["eagle3_head_vs_onnxruntime"] = head_check(
                ck, f"tensorrt {precision}", target, draft, ref_target,
                GraphHead.load(engines / "draft", ref_target.config), manifest["models"]["target"]["feature_layers"],
                exact=precision == "fp32", capacity=manifest["capacity"], window=manifest["max_tree_tokens"])
        res["batched_decoding"] = {tree or "AR": batch_throughput(ck, f"tensorrt {precision}", target, draft, ids_list,
                                                                  args.new_tokens, tree)
                                   for tree in (None, trees[0])}
        res["build_or_load_seconds"] = round(build_s, 1)
        res["plan_bytes"] = {p.relative_to(engines).as_posix(): p.stat().st_size for p in engines.glob("*/*.plan")}
        out[precision] = res
        del target, draft
        torch.cuda.empty_cache()
    return out


def head_check(ck: Check, label: str, target, head, ref_target, ref_head, layers, exact: bool, capacity: int,
               window: int, seed: int = 3) -> dict:
    """An EAGLE-3 head's plan (and the target plan's features) against ONNX Runtime on the same graphs: a prompt chunk
    through both targets, then both heads fed the reference's features and hidden (so each step measures one head
    call): the catch-up over the chunk (rows for tokens 1..n-1), one draft level of two nodes from the last row's
    hidden, and a catch-up of three accepted tokens. Max |diff| and top-1 agreement per step; asserted tight for an
    FP32 plan, a floor for FP16/INT8. Runs on a GPU only (the tensorrt engines); unverified there so far."""
    g = torch.Generator().manual_seed(seed)
    n, capacity = min(24, window), min(256, capacity)
    ids = torch.randint(3, target.config.vocab_size, (n + 3,), generator=g)
    causal = lambda k: torch.ones(k, k, dtype=torch.bool).tril()  # noqa: E731
    t_cache, r_cache = target.new_cache(capacity, window), ref_target.new_cache(capacity, window)
    h_cache, rh_cache = head.new_cache(capacity, window), ref_head.new_cache(capacity, window)
    res: dict = {}

    def diff(step: str, got: tuple, want: tuple) -> None:
        (gl, gx), (wl, wx) = got, want
        agree = float((gl.argmax(-1) == wl.argmax(-1)).float().mean())
        res[step] = {"max_abs_diff_logits": round(float((gl - wl).abs().max()), 6),
                     "max_abs_diff_second": round(float((gx - wx).abs().max()), 6),
                     "max_abs_logit": round(float(wl.abs().max()), 3), "top1_agreement": round(agree, 4)}
        rel = res[step]["max_abs_diff_logits"] / max(res[step]["max_abs_logit"], 1e-6)
        if exact:
            ck.check(f"{label} EAGLE-3 {step} == onnxruntime", rel <= 1e-3 and agree >= 0.99, str(res[step]))
        else:
            ck.check(f"{label} EAGLE-3 {step} ~ onnxruntime", agree >= 0.9, str(res[step]))

    def both(engine, cache, tokens, positions, mask):
        (logits,), (features,) = engine.forward_features([(tokens, positions, mask, cache)], layers)
        return logits, features

    # target: the prompt chunk (the features the head reads: logits and features compared)
    want = both(ref_target, r_cache, ids[:n], torch.arange(n), causal(n))
    diff("target prompt chunk (logits, features)", both(target, t_cache, ids[:n], torch.arange(n), causal(n)), want)
    feats = want[1]
    # head catch-up: row p reads token p and the features of p - 1
    step = (ids[1:n], torch.arange(1, n), causal(n - 1))
    want = ref_head.forward(*step, rh_cache, feats[:-1], full_vocab=False)
    diff("head catch-up (logits, hidden)", head.forward(*step, h_cache, feats[:-1], full_vocab=False), want)
    h_cache.commit(n - 1)
    rh_cache.commit(n - 1)
    # one draft level: two nodes at position n from the last row's hidden (not committed, as the proposer does)
    hidden = want[1][-1:].expand(2, -1).contiguous()
    tokens = ref_head.head_ids[want[0][-1].topk(2).indices].to(ids.dtype)  # draft-vocabulary columns -> ids
    level = (tokens, torch.full((2,), n), torch.eye(2, dtype=torch.bool))
    diff("head draft level (logits, hidden)", head.forward(*level, h_cache, hidden, full_vocab=False),
         ref_head.forward(*level, rh_cache, hidden, full_vocab=False))
    # three accepted tokens: the target verifies them, the head catches up on their rows
    r_cache.commit(n)
    (_, acc_feats) = both(ref_target, r_cache, ids[n:], torch.arange(n, n + 3), causal(3))
    step = (ids[n:], torch.arange(n, n + 3), causal(3))
    rows = torch.cat([feats[-1:], acc_feats[:2]])
    diff("head catch-up of accepted rows (logits, hidden)", head.forward(*step, h_cache, rows, full_vocab=False),
         ref_head.forward(*step, rh_cache, rows, full_vocab=False))
    return res


def ort_reference(engines: Path, role: str):
    """ONNX Runtime on this machine's CPU running the engines dir's fp32 batched graph (the reference for plans); an
    EAGLE-3 draft is its head graph behind `GraphHead`."""
    from spectrt.runtime.engines.engine import load_engine
    from spectrt.runtime.engines.graph_head import GraphHead
    from spectrt.runtime.engines.onnx_engine import EngineDir

    if role == "draft" and EngineDir(engines / role).entry.get("kind") == "eagle3":
        return GraphHead.load(engines / role, EngineDir(engines / "target").config)
    return load_engine(engines / role, "onnxruntime")


def ort_section(ck: Check, args, device, ids_list, reference, trees, tokens) -> dict:
    """CPU only: the onnxruntime backend from an engines dir, same measurements (the CPU benchmark), and the batched
    graph: one run over a mixed batch = each request alone, tokens/s at batch 1 and 8."""
    target, draft = ort_reference(args.engines, "target"), ort_reference(args.engines, "draft")
    res, _ = bench_engine(ck, "onnxruntime fp32", target, draft, device, ids_list, args.new_tokens, exact=True,
                          reference=reference, trees=trees, tokens=tokens)
    res["batched_verification_vs_one_at_a_time"] = batched_parity(ck, "onnxruntime fp32", target, OneAtATime(target),
                                                                  exact=True)
    res["batched_decoding"] = {tree or "AR": batch_throughput(ck, "onnxruntime fp32", target, draft, ids_list,
                                                              args.new_tokens, tree, invariant=True)
                               for tree in (None, trees[0])}
    return res


class OneAtATime:
    """An engine whose forward_many runs each segment alone (the reference for a batched forward)."""

    def __init__(self, engine):
        self.engine, self.config = engine, engine.config

    def new_caches(self, slots: int, capacity: int, max_window: int):
        return self.engine.new_caches(slots, capacity, max_window)

    def forward(self, *segment):
        return self.engine.forward(*segment)

    def forward_many(self, segments, logit_rows=None):
        from spectrt.runtime.engines.kernels import last_rows

        return last_rows([self.engine.forward(*segment) for segment in segments], logit_rows)


# --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    p.add_argument("--device", default="cuda")
    p.add_argument("--target", type=Path,  # the checkout's artifacts/ (this script runs from a checkout)
                   default=Path(os.environ.get("SPECTRT_ARTIFACTS", REPO / "artifacts")) / "smollm2-135m-instruct")
    p.add_argument("--draft", type=Path, default=None, help="default: <target>-draft if present, else a 4-layer slice")
    p.add_argument("--engines", type=Path, default=None,
                   help="an engines dir (manifest.json) to load plans from / run onnxruntime on (--device cpu), "
                        "else a work dir to build FP32+FP16 plans in (default: a temp dir)")
    p.add_argument("--random-weights", action="store_true", help="ignore the checkpoint; random real-shaped weights")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new parts after this")
    p.add_argument("--trees", default=";".join(TREES), help="semicolon-separated trees, e.g. '2,1;3,2,1'")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="T values for the verify cost, e.g. 1,8,32")
    p.add_argument("--no-bf16", action="store_true", help="skip the torch bf16 measurements")
    p.add_argument("--quick", action="store_true", help="small smoke run (few T, few tokens)")
    args = p.parse_args(argv)

    ck = Check(args.budget_s)
    r = ck.results
    r["started"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    r["machine"] = {"python": platform.python_version(), "torch": torch.__version__,
                    "cuda_available": torch.cuda.is_available()}
    device = torch.device(args.device)
    status = 1
    try:
        if device.type == "cuda":
            if not torch.cuda.is_available():
                r["status"] = "no_gpu"
                r["reason"] = "torch.cuda.is_available() is False: run this on a machine with an NVIDIA GPU"
                ck.log(r["reason"])
                return 2
            torch.backends.cuda.matmul.allow_tf32 = False  # exact fp32 for the equality checks
            torch.backends.cudnn.allow_tf32 = False
            r["machine"] |= {"gpu": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability(),
                             "torch_cuda": torch.version.cuda}
        tokens = [1, 4, 16] if args.quick else [int(t) for t in args.tokens.split(",")]
        trees = ["2,1"] if args.quick else [t for t in args.trees.split(";") if t]
        target_dir = None if args.random_weights or not (args.target / "config.json").is_file() else args.target
        draft_dir = args.draft
        if target_dir is not None and draft_dir is None:
            distilled = target_dir.with_name(target_dir.name + "-draft")
            draft_dir = distilled if (distilled / "config.json").is_file() else None
        r["weights"] = (f"real checkpoint {target_dir}" if target_dir is not None else
                        "random weights with SmolLM2-135M's real shapes (the checkpoint is not on this machine): "
                        "speed numbers are real, acceptance rates are not")
        r["draft"] = str(draft_dir) if draft_dir else "the target's first 4 layers (untrained slice)"
        from spectrt.runtime.engines.eagle3 import is_eagle3

        # the torch-on-CUDA pair is LLaMA-shaped: with an EAGLE-3 head (the embedded target's default draft) it drafts
        # with the target's first 4 layers, and the head goes to the TensorRT section (its own plan, `head_check`)
        torch_draft = None if draft_dir is not None and is_eagle3(draft_dir) else draft_dir
        if torch_draft != draft_dir:
            r["draft"] += " (TensorRT plans; the torch section drafts with the target's first 4 layers)"
        ids_list = prompts(target_dir, args.prompts)
        ck.log(f"device {device}; {r['weights']}")

        target, draft, weights = load_pair(device, torch.float32, target_dir, torch_draft)
        res, reference = bench_engine(ck, "torch fp32", target, draft, device, ids_list, args.new_tokens, exact=True,
                                      trees=trees, tokens=tokens)
        if ck.left() > 120:
            res["batched_decoding"] = {tree or "AR": batch_throughput(ck, "torch fp32", target, draft, ids_list,
                                                                      args.new_tokens, tree, invariant=True)
                                       for tree in (None, trees[0])}
        else:
            r["skipped"].append("torch fp32 batched decoding (time)")
        r["torch"] = {"fp32": res}
        del target, draft
        if args.no_bf16:
            pass
        elif ck.left() > 60:
            t16, d16, _ = load_pair(device, torch.bfloat16, target_dir, torch_draft, weights)
            r["torch"]["bf16"], _ = bench_engine(ck, "torch bf16", t16, d16, device, ids_list, args.new_tokens,
                                                 exact=False, reference=reference, trees=trees[:1], tokens=tokens)
            del t16, d16
        else:
            r["skipped"].append("torch bf16 (time)")
        if args.engines is not None and device.type == "cpu":
            r["onnxruntime"] = ort_section(ck, args, device, ids_list, reference, trees, tokens)
        if device.type == "cuda":
            r["tensorrt"] = trt_section(ck, args, device, weights, target_dir, draft_dir, ids_list, reference,
                                        trees, tokens)
        status = 1 if ck.failed else 0
    except Exception as e:
        r["error"] = f"{type(e).__name__}: {e}"
        r["traceback"] = traceback.format_exc()
        ck.log(r["traceback"])
        status = 1
    finally:
        r.setdefault("status", "pass" if status == 0 else "fail")
        r["seconds"] = round(time.perf_counter() - ck.start, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(r, indent=2, default=str) + "\n")
        ck.log(f"status {r['status']}; results in {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
