"""`spectrt compare`: FP vs INT8 target, each alone (AR) and with tree speculation, in one interleaved run.

Per prompt the four configurations run back to back (FP AR, FP tree, INT8 AR, INT8 tree), so machine noise
hits all alike. Reported: tokens/s and the ratio to the FP target's own AR loop (the strongest baseline),
τ, the verify step's latency (median forward of 1 and of tree-size tokens), greedy output agreement with
the FP target, weight memory, and the accuracy gates (quant/accuracy.py) plus τ(INT8)/τ(FP). Writes
compare.md, compare.json and compare.png.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
from spectrt.quant.accuracy import GATE_TOP1, accuracy_report, gate_message
from spectrt.runtime.bench import read_prompts, step_cost_ms
from spectrt.runtime.int8 import quant_format
from spectrt.runtime.pipeline import Pipeline
from spectrt.runtime.tree import Tree
from tqdm import tqdm

TAU_TOLERANCE = 0.05  # INT8 τ within 5% of the FP target's


def token_match_rate(reference: list[int], candidate: list[int]) -> float:
    """Fraction of the reference's positions where the candidate has the same token."""
    if not reference:
        return 1.0 if not candidate else 0.0
    return sum(a == b for a, b in zip(reference, candidate, strict=False)) / len(reference)


def run_compare(target: Path, int8: Path, draft: Path, prompts_path: Path | None, limit: int | None,
                max_new_tokens: int, tree: str, out: Path, progress: bool = True) -> dict:
    if quant_format(int8) is None:
        raise ValueError(f"{int8} is not an INT8 checkpoint: make one with `spectrt quantize` (make quantize)")
    prompts = read_prompts(prompts_path)[:limit]
    spec = Tree.parse(tree)
    pipes = {"fp32": Pipeline(target, draft), quant_format(int8): Pipeline(int8, draft)}
    for pipe in pipes.values():
        pipe.generate(prompts[0], 8, spec)  # warm-up: kernel choice, allocator
    configs = [(name, mode) for name in pipes for mode in ("AR", f"tree {tree}")]
    totals = {c: {"tokens": 0, "seconds": 0.0, "passes": 0, "emitted": 0, "match": 0.0, "identical": 0,
                  "equal_to_own_ar": 0} for c in configs}
    for prompt in tqdm(prompts, desc="compare", unit="prompt", disable=not progress):
        outputs = {}
        for name, mode in configs:
            gen = pipes[name].generate(prompt, max_new_tokens, None if mode == "AR" else spec)
            outputs[name, mode] = gen.token_ids
            t = totals[name, mode]
            t["tokens"] += gen.stats.new_tokens
            t["seconds"] += gen.stats.decode_seconds
            t["passes"] += gen.stats.target_passes
            t["emitted"] += gen.stats.emitted_tokens
        reference = outputs["fp32", "AR"]
        for (name, mode), ids in outputs.items():
            t = totals[name, mode]
            t["match"] += token_match_rate(reference, ids)
            t["identical"] += ids == reference
            t["equal_to_own_ar"] += ids == outputs[name, "AR"]

    base = totals["fp32", "AR"]["tokens"] / totals["fp32", "AR"]["seconds"]
    n = len(prompts)
    rows = []
    for name, mode in configs:
        t = totals[name, mode]
        engine = pipes[name].decoder.target
        rows.append({
            "target": name, "mode": mode,
            "tokens_per_second": t["tokens"] / t["seconds"], "speedup_vs_fp32_ar": t["tokens"] / t["seconds"] / base,
            "tau": t["emitted"] / max(t["passes"], 1),
            "token_match_vs_fp32": t["match"] / n, "identical_to_fp32": f"{t['identical']}/{n}",
            "equal_to_own_ar": f"{t['equal_to_own_ar']}/{n}",
            "weight_mb": engine.weight_bytes() / 2**20,
        })
    verify = {name: {"1": step_cost_ms(p.decoder.target, 1), str(len(spec)): step_cost_ms(p.decoder.target, len(spec))}
              for name, p in pipes.items()}
    qname = quant_format(int8)
    report_path = Path(int8) / "quant_report.json"
    accuracy = json.loads(report_path.read_text()) if report_path.is_file() else accuracy_report(target, int8)
    tau = {r["target"]: r["tau"] for r in rows if r["mode"] != "AR"}
    result = {
        "target": str(target), "int8": str(int8), "qformat": qname, "draft": str(draft), "tree": tree,
        "prompts": n, "max_new_tokens": max_new_tokens,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "results": rows,
        "verify_step_ms": verify,
        "verify_speedup": {k: verify["fp32"][k] / verify[qname][k] for k in verify["fp32"]},
        "accuracy": accuracy,
        "tau_ratio": tau[qname] / tau["fp32"],
        "gates": {"top1_agreement": accuracy["top1_agreement"] >= GATE_TOP1,
                  "tau_within_5pct": abs(tau[qname] / tau["fp32"] - 1) <= TAU_TOLERANCE},
    }
    out.mkdir(parents=True, exist_ok=True)
    stem = f"compare_{qname}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / f"{stem}.md").write_text(table)
    plot(result, out / f"{stem}.png")
    print(table)
    return result


def markdown(r: dict) -> str:
    q = r["qformat"]
    lines = [f"### FP32 vs {q} target — {r['prompts']} prompts × {r['max_new_tokens']} new tokens, greedy, "
             f"tree {r['tree']} ({r['machine']})", "",
             "| target | mode | tok/s | vs FP32 AR | τ | token match vs FP32 | identical to FP32 | = own AR "
             "| weights MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for x in r["results"]:
        lines.append(f"| {x['target']} | {x['mode']} | {x['tokens_per_second']:.1f} | {x['speedup_vs_fp32_ar']:.2f}× | "
                     f"{x['tau']:.2f} | {x['token_match_vs_fp32']:.3f} | {x['identical_to_fp32']} | "
                     f"{x['equal_to_own_ar']} | {x['weight_mb']:.0f} |")
    sizes = list(r["verify_step_ms"]["fp32"])
    lines += ["", "| verify step (median ms, context 128) | " + " | ".join(f"T={k}" for k in sizes) + " |",
              "|---|" + "---|" * len(sizes)]
    for name, ms in r["verify_step_ms"].items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in ms.values()) + " |")
    lines.append(f"| FP32 / {q} | " + " | ".join(f"{v:.2f}×" for v in r["verify_speedup"].values()) + " |")
    a = r["accuracy"]
    lines += ["", gate_message(a).replace("\n", "  \n"),
              f"τ({q}) / τ(FP32) = {r['tau_ratio']:.3f} (gate: within {TAU_TOLERANCE:.0%}: "
              f"{'passed' if r['gates']['tau_within_5pct'] else 'MISSED'})"]
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{x['target']}\n{x['mode']}" for x in r["results"]]
    values = [x["tokens_per_second"] for x in r["results"]]
    bars = left.bar(labels, values, color=["#7a9cc6", "#2f5f98", "#e3a25f", "#b5651d"][:len(values)])
    left.bar_label(bars, labels=[f"{v:.1f}\nτ {x['tau']:.2f}" for v, x in zip(values, r["results"], strict=True)])
    left.set_ylabel("tokens / s")
    left.set_title("decoding throughput (greedy)")
    left.margins(y=0.25)
    sizes = list(r["verify_step_ms"]["fp32"])
    width = 0.38
    for i, (name, ms) in enumerate(r["verify_step_ms"].items()):
        xs = [j + (i - 0.5) * width for j in range(len(sizes))]
        b = right.bar(xs, [ms[s] for s in sizes], width, label=name)
        right.bar_label(b, fmt="%.1f")
    right.set_xticks(range(len(sizes)), [f"T={s}" for s in sizes])
    right.set_ylabel("ms per target forward")
    right.set_title("verify step latency")
    right.margins(y=0.15)
    right.legend()
    fig.suptitle(f"FP32 vs {r['qformat']} target ({r['prompts']} prompts, {r['machine']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
