"""`spectrt compare`: every target precision the engines run, each alone and with the default speculation, in one
interleaved run over both bench prompt sets.

Precisions: fp32 and bf16 (the FP target), the INT8 W8A8 recipe (`--qformat`, default quant/recipes.py's) and INT8
weight-only, from `spectrt quantize`. Per prompt every (precision, mode) runs back to back, so machine noise hits
all alike; "spec" is what `spectrt generate` runs (the precision's tuned policy, else the untuned default) and "AR"
the same engine alone. Measured, greedy, decode time only:
- per prompt set: tok/s, ratio to fp32 AR and to bf16 AR, τ and τ relative to fp32's, greedy token match with fp32's
  AR output, equality with the precision's own AR output (exact modes must be equal);
- per precision: weight bytes one forward streams, the verify cost curve T = 1..16 (context 128), held-out top-1
  agreement with fp32 (quant/accuracy.py, the same positions for all; the INT8 gate);
- batched: throughput of N requests through one `Decoder.run` at 1 and N concurrent requests, AR and the
  policy's dynamic trees (what Triton serves for `tree: auto`), and whether the batched outputs equal the
  one-at-a-time ones.
quant/report.py turns the result into compare.md and compare.png; compare.json holds it all.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from spectrt.quant.accuracy import GATE_TOP1, engine_agreement, heldout_records
from spectrt.quant.recipes import get_recipe
from spectrt.runtime.decoding.decoder import Decoder, Job
from spectrt.runtime.decoding.pipeline import AUTO, Pipeline
from spectrt.runtime.decoding.policy import load_policy, policy_path
from spectrt.runtime.decoding.profile import _cpu_name, forward_ms, prefilled_cache
from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS
from spectrt.runtime.engines.int8 import quant_spec
from tqdm import tqdm

MODES = ("AR", "spec")
VERIFY_T = tuple(range(1, 17))
VERIFY_GATE = 1.5  # an INT8 W8A8 verify step must stay >= 1.5x faster than fp32's
GPU_RESULTS = "gpu.json"  # {"machine": str, "plans": {"fp16" | "int8": {"plan_bytes", "ar_tokens_per_second",
#                        "spec_tokens_per_second", "tau", "verify_ms": {T: ms}}}}: the TensorRT half (quant/report.py)
# issue #23's measurement on its author's machine (not re-measured here), where our bf16 AR at 8 concurrent ran 333
PEER = {"name": "OpenVINO GenAI 2026.4, INT8 weights (lossy), 8 concurrent requests", "tokens_per_second": 418.0,
        "bf16_ar_8_concurrent_there": 333.0}


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    passes: int = 0
    emitted: int = 0
    match: float = 0.0  # summed per-prompt token match with fp32 AR
    identical: int = 0  # outputs identical to fp32 AR
    own_ar: int = 0  # outputs identical to this precision's AR
    prompts: int = 0
    per_prompt: list[float] = field(default_factory=list)


def token_match_rate(reference: list[int], candidate: list[int]) -> float:
    """Fraction of the reference's positions where the candidate has the same token."""
    if not reference:
        return 1.0 if not candidate else 0.0
    return sum(a == b for a, b in zip(reference, candidate, strict=False)) / len(reference)


def tuned_policy_file(target: Path, draft: Path | None, dtype: str, artifacts: Path) -> str | None:
    """Where `spectrt generate` finds this target's tuned policy (runtime/decoding/pipeline.py `default_policy`);
    None: untuned."""
    for where in (Path(artifacts), Path(target).parent):
        path = policy_path(where, Path(target).name, Path(draft).name if draft else None, dtype)
        if load_policy(path) is not None:
            return str(path)
    return None


def streamed_weight_bytes(engine) -> int:
    """Bytes of the weights one forward reads: every projection and the LM head as the engine holds them (packed
    on the native forward); embedding rows and norms are negligible."""
    if engine.native is not None:
        return sum(t.nbytes for proj in engine.native.projections for t in proj) + engine.native.head.nbytes
    projections = [w for layer in engine.layers for k, w in layer.items() if k in ("wqkv", "wo", "w13", "w2")]
    return sum(w.nbytes for w in projections) + engine.head.nbytes


def claims_exact(engine) -> bool:
    """Whether tree decoding must equal the engine's own greedy AR output: verify rows computed exactly as single-token
    steps (the native forward; the INT8 torch path's per-row mode) or the fp32 reference."""
    return engine.native is not None or engine.row_invariant or engine.dtype == torch.float32


def batched_run(pipe: Pipeline, prompts: list[list[int]], max_new_tokens: int, concurrency: int, spec: bool,
                max_seq_len: int) -> tuple[float, list[list[int]]]:
    """(generated tokens per second of wall time, prefill included; outputs) of all `prompts` through one decoder
    admitting `concurrency` at a time: the target alone, or (`spec`) the pipeline's policy with dynamic trees, which
    is what Triton serves for `tree: auto`."""
    d = pipe.decoder
    decoder = Decoder(d.target, d.draft, d.eos_ids, max_seq_len=max_seq_len, max_active=concurrency,
                      policy=pipe.policy)
    jobs = [Job(list(ids), max_new_tokens, tree=AUTO if spec else None) for ids in prompts]
    start = time.perf_counter()
    decoder.run(jobs)
    seconds = time.perf_counter() - start
    return sum(len(j.out) for j in jobs) / seconds, [j.out for j in jobs]


def run_compare(target: Path, draft: Path | None, models: dict[str, tuple[Path, str]],
                prompt_sets: dict[str, list[str]], max_new_tokens: int, out: Path, batch: int = 8,
                max_seq_len: int = 1024, progress: bool = True, log: Callable[[str], None] = print,
                records: list[dict] | None = None, artifacts: Path = DEFAULT_ARTIFACTS) -> dict:
    """Measure every (precision, mode) of `models` ({label: (checkpoint, dtype)}, "fp32" first: the reference) and
    write compare.{json,md,png} into `out`; held-out agreement on `records` (default: quant/accuracy.py's); tuned
    policies found in `artifacts` (or next to each target) as `spectrt generate` finds them."""
    from spectrt.quant import report

    if next(iter(models)) != "fp32":
        raise ValueError("the first model compared must be the fp32 target (the reference)")
    pipes = {label: Pipeline(path, draft, dtype=dtype, max_seq_len=max_seq_len, artifacts=artifacts)
             for label, (path, dtype) in models.items()}
    first = next(iter(prompt_sets.values()))[0]
    for pipe in pipes.values():  # warm-up: allocator, caches, first-call costs
        for tree in (None, AUTO):
            pipe.generate(first, 8, tree)
    chat = next(iter(prompt_sets.values()))
    batch_prompts = [pipes["fp32"].encode(chat[i % len(chat)]) for i in range(batch)]
    units = sum(len(p) for p in prompt_sets.values()) * len(pipes) * len(MODES) + len(pipes) * len(MODES) * 2
    bar = tqdm(total=units, desc="compare", unit="run", disable=not progress)

    totals = {(s, label, mode): Totals() for s in prompt_sets for label in pipes for mode in MODES}
    for set_name, prompts in prompt_sets.items():
        for prompt in prompts:
            outputs = {}
            for label, pipe in pipes.items():
                for mode in MODES:
                    gen = pipe.generate(prompt, max_new_tokens, None if mode == "AR" else AUTO)
                    t = totals[set_name, label, mode]
                    t.tokens += gen.stats.new_tokens
                    t.seconds += gen.stats.decode_seconds
                    t.passes += gen.stats.target_passes
                    t.emitted += gen.stats.emitted_tokens
                    t.per_prompt.append(gen.stats.tokens_per_second)
                    outputs[label, mode] = gen.token_ids
                    bar.update()
            reference = outputs["fp32", "AR"]
            for (label, mode), ids in outputs.items():
                t = totals[set_name, label, mode]
                t.prompts += 1
                t.match += token_match_rate(reference, ids)
                t.identical += ids == reference
                t.own_ar += ids == outputs[label, "AR"]

    batched = []
    for label, pipe in pipes.items():
        for mode in MODES:
            runs = {}
            for concurrency in (1, batch):
                runs[concurrency] = batched_run(pipe, batch_prompts, max_new_tokens, concurrency, mode == "spec",
                                                max_seq_len)
                bar.update()
            batched.append({"precision": label, "mode": mode, "tree": AUTO if mode == "spec" else None,
                            "requests": batch, "tokens_per_second": {str(c): tps for c, (tps, _) in runs.items()},
                            "batched_equal_to_one_at_a_time":
                                f"{sum(a == b for a, b in zip(runs[1][1], runs[batch][1], strict=True))}/{batch}"})
    bar.close()

    verify = {label: {} for label in pipes}
    caches = {label: prefilled_cache(pipe.decoder.target, 128, max(VERIFY_T)) for label, pipe in pipes.items()}
    for t in tqdm(VERIFY_T, desc="verify cost", unit="T", disable=not progress):
        for label, pipe in pipes.items():  # interleaved: each T measured for all precisions back to back
            verify[label][str(t)] = round(forward_ms(pipe.decoder.target, t, caches[label], repeats=15), 3)
    del caches

    records = records if records is not None else heldout_records(target, progress)
    reference = pipes["fp32"].decoder.target
    precisions = {}
    for label, (path, dtype) in models.items():
        engine = pipes[label].decoder.target
        spec = quant_spec(path)
        entry = {"checkpoint": str(path), "dtype": dtype, "recipe": spec.get("qformat"),
                 "weights_only": bool(spec.get("weights_only", spec.get("qformat") == "int8_wo")),
                 "summary": get_recipe(spec["qformat"]).summary if spec.get("qformat") else f"{dtype} weights",
                 "policy": pipes[label].policy.to_json(),
                 "policy_file": tuned_policy_file(path, draft, dtype, artifacts),
                 "weight_bytes": streamed_weight_bytes(engine), "exact": claims_exact(engine),
                 "verify_ms": verify[label],
                 "verify_speedup_vs_fp32": {t: verify["fp32"][t] / ms for t, ms in verify[label].items()}}
        if label != "fp32":
            entry["accuracy"] = engine_agreement(reference, engine, records, GATE_TOP1, progress)
        precisions[label] = entry

    rows = []
    for (set_name, label, mode), t in totals.items():
        fp32_ar, bf16_ar = (totals[set_name, name, "AR"] for name in ("fp32", "bf16" if "bf16" in pipes else "fp32"))
        ar = totals[set_name, label, "AR"]
        tps = t.tokens / t.seconds
        tau = t.emitted / max(t.passes, 1)
        fp32_spec = totals[set_name, "fp32", mode]
        rows.append({
            "set": set_name, "precision": label, "mode": mode, "tokens_per_second": tps,
            "vs_fp32_ar": tps / (fp32_ar.tokens / fp32_ar.seconds),
            "vs_bf16_ar": tps / (bf16_ar.tokens / bf16_ar.seconds),
            "worst_prompt_vs_own_ar": min((s / a for s, a in zip(t.per_prompt, ar.per_prompt, strict=True) if a > 0),
                                          default=1.0),
            "tau": tau, "tau_vs_fp32": tau / (fp32_spec.emitted / max(fp32_spec.passes, 1)),
            "token_match_vs_fp32": t.match / t.prompts, "identical_to_fp32": f"{t.identical}/{t.prompts}",
            "equal_to_own_ar": f"{t.own_ar}/{t.prompts}",
        })

    result = {
        "command": "spectrt compare", "target": str(target), "draft": str(draft) if draft else None,
        "prompt_sets": {name: len(p) for name, p in prompt_sets.items()}, "max_new_tokens": max_new_tokens,
        "machine": f"{platform.machine()} {_cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "precisions": precisions, "results": rows, "batched": batched, "peer": PEER,
    }
    result["gates"] = gates(result)
    if (out / GPU_RESULTS).is_file():  # written by scripts/gpu_check.sh on a machine with a GPU
        result["gpu"] = json.loads((out / GPU_RESULTS).read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=2))
    table = report.markdown(result)
    (out / "compare.md").write_text(table)
    report.plot(result, out / "compare.png")
    log(table)
    return result


def gates(result: dict) -> dict:
    """Per INT8 W8A8 precision: held-out top-1 agreement >= the gate, verify step >= 1.5x fp32 at every T measured,
    tree decoding equal to its own AR on every prompt; per precision claiming exactness: equal to its own AR."""
    out = {}
    for label, p in result["precisions"].items():
        rows = [r for r in result["results"] if r["precision"] == label]
        entry = {"equal_to_own_ar": all(r["equal_to_own_ar"].split("/")[0] == r["equal_to_own_ar"].split("/")[1]
                                        for r in rows)}
        if p["recipe"] and not p["weights_only"]:
            entry["top1_agreement"] = p["accuracy"]["top1_agreement"] >= GATE_TOP1
            entry["verify_speedup"] = min(p["verify_speedup_vs_fp32"].values()) >= VERIFY_GATE
        out[label] = entry
    return out
