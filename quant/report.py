"""The `spectrt compare` report: markdown tables and a PNG (speed vs accuracy per precision) from its result."""

from __future__ import annotations

from pathlib import Path

GPU_SECTION = """\
**GPU: TensorRT FP16 and INT8 plans — unverified until a GPU runs it.** `make engines PRECISION=fp16` and
`make engines PRECISION=int8` build the plans (TensorRT-RTX builds them on the CPU here; executing them needs an
NVIDIA GPU with TensorRT). `scripts/gpu_check.sh` on such a machine measures them the same way: decode tok/s AR and
with the default speculation, the verify cost curve T = 1..16 and the plan sizes, and writes
`bench/results/compare/gpu.json`, which this report then shows. The INT8 plan cannot run the CPU recipe: a Q/DQ
scale is a build-time constant in TensorRT (its dynamic quantization is FP8/FP4 only), so per-token and per-group
activation scales have no INT8 Q/DQ form. The Q/DQ graph carries the same calibration's *static* per-tensor
activation scales with the down-projection in fp16, i.e. the `int8_sq_static` numerics, which miss the 0.97
agreement gate on the CPU (0.956, bench/results/compare/recipes.md): the INT8 plan is expected to miss it too
until a GPU measures otherwise; `--qformat int8_wo` (0.972, passed) is the INT8 plan that keeps the gate.
"""


def markdown(r: dict) -> str:
    sets = ", ".join(f"{name} {n}" for name, n in r["prompt_sets"].items())
    lines = [f"### spectrt compare — prompts: {sets} × {r['max_new_tokens']} new tokens, greedy ({r['machine']}, "
             f"{r['time']})", "",
             f"Target `{Path(r['target']).name}`, draft `{Path(r['draft']).name if r['draft'] else 'none'}`; every "
             "configuration interleaved prompt by prompt in one process; decode time only. *spec* = what `spectrt "
             "generate` runs (the precision's tuned policy, else the untuned default): " + ", ".join(
                 f"{label} {'tuned' if p.get('policy_file') else 'untuned'} (budget {p['policy']['budget']}, depth "
                 f"{p['policy']['depth']}, width {p['policy']['width']})" for label, p in r["precisions"].items())
             + ".", "",
             "| precision | weights | weights streamed / forward | verify T=1 | T=8 | T=16 | vs fp32 (T=1 / 8 / 16) "
             "| held-out top-1 vs fp32 | mean KL | exact (tree = AR) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for label, p in r["precisions"].items():
        ms, sp = p["verify_ms"], p["verify_speedup_vs_fp32"]
        acc = p.get("accuracy")
        top1 = "reference" if acc is None else f"{acc['top1_agreement']:.4f}" + (
            (" (gate: passed)" if acc["gate_passed"] else " (**gate: FAILED**)") if p["recipe"] else "")
        kl = "–" if acc is None else f"{acc['mean_kl']:.5f}"
        exact = "yes" if r["gates"][label]["equal_to_own_ar"] else "**no**"
        lines.append(f"| {label} | {p['summary']} | {p['weight_bytes'] / 2**20:.0f} MB | {ms['1']:.2f} ms | "
                     f"{ms['8']:.2f} | {ms['16']:.2f} | {sp['1']:.2f}× / {sp['8']:.2f}× / {sp['16']:.2f}× | {top1} | "
                     f"{kl} | {exact} |")
    acc = next((p["accuracy"] for p in r["precisions"].values() if "accuracy" in p), None)
    if acc:
        lines += ["", f"Held-out agreement: {acc['positions']} positions of {acc['heldout_answers']} fp32 greedy "
                  f"answers to build/prompts/heldout.txt (fingerprint {acc['heldout_fingerprint']}, the same for every "
                  "row)."]
    lines += ["", "| set | precision | mode | tok/s | vs fp32 AR | vs bf16 AR | worst prompt vs own AR | τ | τ vs fp32 "
              "| token match vs fp32 | identical to fp32 | = own AR |", "|" + "---|" * 12]
    for x in r["results"]:
        lines.append(f"| {x['set']} | {x['precision']} | {x['mode']} | {x['tokens_per_second']:.1f} | "
                     f"{x['vs_fp32_ar']:.2f}× | {x['vs_bf16_ar']:.2f}× | {x['worst_prompt_vs_own_ar']:.2f}× | "
                     f"{x['tau']:.2f} | {x['tau_vs_fp32']:.3f} | {x['token_match_vs_fp32']:.3f} | "
                     f"{x['identical_to_fp32']} | {x['equal_to_own_ar']} |")
    b0 = r["batched"][0] if r["batched"] else None
    if b0:
        n = b0["requests"]
        bf16 = next((b for b in r["batched"] if b["precision"] == "bf16" and b["mode"] == "AR"), None)
        lines += ["", f"Batched: {n} chat prompts × {r['max_new_tokens']} tokens through one `Decoder.run`, "
                  "generated tokens per second of wall time (prefill included); *spec* = the policy's dynamic trees "
                  "with one speculation budget across the batch (what Triton serves for `tree: auto`).", "",
                  f"| precision | mode | 1 at a time | {n} concurrent | {n} vs 1 | vs bf16 AR at {n} "
                  "| batched = one at a time |", "|---|---|---|---|---|---|---|"]
        for b in r["batched"]:
            one, many = b["tokens_per_second"]["1"], b["tokens_per_second"][str(n)]
            vs = f"{many / bf16['tokens_per_second'][str(n)]:.2f}×" if bf16 else "–"
            lines.append(f"| {b['precision']} | {b['mode']} | {one:.1f} | {many:.1f} | "
                         f"{many / one:.2f}× | {vs} | {b['batched_equal_to_one_at_a_time']} |")
        peer = r["peer"]
        ours = peer["bf16_ar_8_concurrent_there"]
        lines += ["", f"Peer (issue #23, same model, measured on the issue author's machine, not here): "
                  f"{peer['name']}: {peer['tokens_per_second']:.0f} tok/s, where our bf16 AR at 8 concurrent ran "
                  f"{ours:.0f} ({peer['tokens_per_second'] / ours:.2f}× it)."]
    ts = list(next(iter(r["precisions"].values()))["verify_ms"])
    lines += ["", "Verify cost curve: ms per target forward of a T-node tree (binary tree mask), context 128, median "
              "of 15, precisions interleaved per T.", "",
              "| precision | " + " | ".join(f"T={t}" for t in ts) + " |", "|---|" + "---|" * len(ts)]
    for label, p in r["precisions"].items():
        lines.append(f"| {label} | " + " | ".join(f"{p['verify_ms'][t]:.1f}" for t in ts) + " |")
    lines += ["", "Gates: " + "; ".join(
        f"{label}: " + ", ".join(f"{name.replace('_', ' ')} {'passed' if ok else 'FAILED'}" for name, ok in g.items())
        for label, g in r["gates"].items())]
    lines += ["", GPU_SECTION.replace("\n", " ").strip()]
    gpu = r.get("gpu") or {}
    if gpu.get("plans"):
        where = f"{gpu.get('machine', 'a GPU')} (`scripts/gpu_check.sh`, {gpu.get('time', '')})"
        lines += ["", f"TensorRT plans on {where}:", "",
                  "| plan | bytes | AR tok/s | spec tok/s | τ | verify T=1 ms | T=16 ms |", "|" + "---|" * 7]
        for name, p in gpu["plans"].items():
            ms = p.get("verify_ms", {})
            lines.append(f"| {name} | {p.get('plan_bytes', 0) / 2**20:.0f} MB | "
                         f"{p.get('ar_tokens_per_second', 0):.1f} | {p.get('spec_tokens_per_second', 0):.1f} | "
                         f"{p.get('tau', 0):.2f} | {ms.get('1', 0):.2f} | {ms.get('16', 0):.2f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict, path: Path) -> None:
    """Speed vs held-out agreement per precision: single stream (each prompt set) and batched, AR and spec; and the
    verify cost curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(r["precisions"])
    colors = dict(zip(labels, ["#2f5f98", "#7a9cc6", "#b5651d", "#e3a25f", "#5a9e5a", "#999999"], strict=False))
    agree = {lab: p["accuracy"]["top1_agreement"] if "accuracy" in p else 1.0 for lab, p in r["precisions"].items()}
    markers = {"AR": "o", "spec": "^"}
    sets = list(r["prompt_sets"])
    fig, axes = plt.subplots(1, len(sets) + 2, figsize=(5 * (len(sets) + 2), 4.4))
    for ax, set_name in zip(axes, sets, strict=False):
        for x in (x for x in r["results"] if x["set"] == set_name):
            ax.scatter(agree[x["precision"]], x["tokens_per_second"], marker=markers[x["mode"]], s=70,
                       color=colors[x["precision"]], edgecolor="black", linewidth=0.5, zorder=3)
            ax.annotate(f"{x['precision']} {x['mode']}", (agree[x["precision"]], x["tokens_per_second"]),
                        textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.set_title(f"single stream, {set_name} prompts", fontsize=9)
        ax.set_ylabel("decode tokens / s")
    ax = axes[len(sets)]
    n = r["batched"][0]["requests"] if r["batched"] else 1
    for b in r["batched"]:
        for c, fill in (("1", "none"), (str(n), colors[b["precision"]])):
            ax.scatter(agree[b["precision"]], b["tokens_per_second"][c], marker=markers[b["mode"]], s=70,
                       facecolor=fill, edgecolor=colors[b["precision"]], linewidth=1.2, zorder=3)
        ax.annotate(f"{b['precision']} {b['mode']}", (agree[b["precision"]], b["tokens_per_second"][str(n)]),
                    textcoords="offset points", xytext=(5, 4), fontsize=7)
    ax.axhline(r["peer"]["tokens_per_second"], color="grey", ls="--", lw=0.8)
    ax.text(ax.get_xlim()[0], r["peer"]["tokens_per_second"], " OpenVINO INT8 weights, 8 concurrent (lossy)",
            fontsize=7, va="bottom", color="grey")
    ax.set_title(f"batched: {n} requests, filled = {n} concurrent, hollow = one at a time", fontsize=9)
    ax.set_ylabel("generated tokens / s (wall)")
    for ax in axes[:len(sets) + 1]:
        ax.set_xlabel("held-out top-1 agreement with fp32")
        ax.grid(alpha=0.3)
        ax.margins(x=0.25, y=0.15)
    ax = axes[-1]
    for label, p in r["precisions"].items():
        ts = [int(t) for t in p["verify_ms"]]
        ax.plot(ts, list(p["verify_ms"].values()), marker=".", color=colors[label], label=label)
    ax.set_xlabel("T (tree nodes verified per forward)")
    ax.set_ylabel("ms per target forward (context 128)")
    ax.set_title("verify cost", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"spectrt compare: {r['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
