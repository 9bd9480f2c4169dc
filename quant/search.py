"""`spectrt quantize --search`: every recipe of quant/recipes.py calibrated on the same samples and judged on the same
held-out positions, with its verify cost; the table says which pass the accuracy gate and which one
`choose_recipe` makes the default (the fastest W8A8 recipe that passes). Writes recipes.{json,md}.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from spectrt.quant.accuracy import GATE_TOP1, engine_agreement, heldout_records, records_fingerprint
from spectrt.quant.recipes import DEFAULT_QFORMAT, GATE_MARGIN, RECIPES, choose_recipe
from spectrt.runtime.decoding.profile import _cpu_name, forward_ms, prefilled_cache
from spectrt.runtime.engines.engine import load_engine

SEARCH_T = (1, 4, 8, 16)


def verify_curve(engine, repeats: int = 15) -> dict[str, float]:
    cache = prefilled_cache(engine, 128, max(SEARCH_T))
    return {str(t): round(forward_ms(engine, t, cache, repeats), 3) for t in SEARCH_T}


def search_recipes(target: Path, names: list[str] | None = None, out: Path = Path("bench/results/compare"),
                   gate: float = GATE_TOP1, records: list[dict] | None = None, progress: bool = True,
                   log: Callable[[str], None] = print, **quantize_args) -> dict:
    """Quantize `target` with each recipe (default: all; checkpoints reused when up to date), measure each on the same
    records, and write the table. `quantize_args` go to quantize_target (calibration prompts and samples)."""
    from spectrt.quant.quantize import REPORT_FILE, default_output, quantize_target

    names = names or list(RECIPES)
    records = records if records is not None else heldout_records(target, progress)
    fp = load_engine(Path(target), dtype="fp32")  # the reference; INT8 checkpoints run fp32 around their GEMMs
    fp_ms = verify_curve(fp)
    rows = []
    for name in names:
        recipe = RECIPES[name]
        checkpoint = quantize_target(target, default_output(target, name), name, progress=progress, log=log,
                                     records=records, **quantize_args)
        engine = load_engine(checkpoint, dtype="fp32")
        report = checkpoint / REPORT_FILE  # quantize's gates, unless computed on other positions
        accuracy = json.loads(report.read_text()) if report.is_file() else {}
        if accuracy.get("heldout_fingerprint") != records_fingerprint(records) or accuracy.get("gate_top1") != gate:
            accuracy = engine_agreement(fp, engine, records, gate, progress)
        accuracy = {k: accuracy[k] for k in ("heldout_answers", "heldout_fingerprint", "positions", "top1_agreement",
                                             "mean_kl", "perplexity_fp", "perplexity_int8", "perplexity_delta_pct",
                                             "gate_top1", "gate_passed")}
        ms = verify_curve(engine)
        rows.append({"name": name, "summary": recipe.summary, "weights_only": recipe.weights_only, **accuracy,
                     "verify_ms": ms, "verify_speedup_vs_fp32": {t: round(fp_ms[t] / v, 3) for t, v in ms.items()},
                     "checkpoint": str(checkpoint)})
        log(f"{name}: top-1 {accuracy['top1_agreement']:.4f} ({'passed' if accuracy['gate_passed'] else 'FAILED'}), "
            f"verify T=1 {ms['1']:.2f} ms ({fp_ms['1'] / ms['1']:.2f}x fp32)")
        del engine
    w8a8 = [r for r in rows if not r["weights_only"]]
    result = {"target": str(target), "gate_top1": gate, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
              "machine": f"{platform.machine()} {_cpu_name()}, {torch.get_num_threads()} threads",
              "fp32_verify_ms": fp_ms, "rows": rows, "chosen": choose_recipe(w8a8, gate), "default": DEFAULT_QFORMAT}
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipes.json").write_text(json.dumps(result, indent=2))
    table = markdown(result)
    (out / "recipes.md").write_text(table)
    log(table)
    return result


def markdown(r: dict) -> str:
    ts = list(r["fp32_verify_ms"])
    lines = [f"### INT8 recipes for `{Path(r['target']).name}` — gate: held-out top-1 agreement >= {r['gate_top1']} "
             f"({r['machine']}, {r['time']})", "",
             "| recipe | what | top-1 agreement | gate | mean KL | perplexity Δ | verify ms " +
             " / ".join(f"T={t}" for t in ts) + " | vs fp32 |", "|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| `{x['name']}`{' (chosen)' if x['name'] == r['chosen'] else ''} | {x['summary']} | "
                     f"{x['top1_agreement']:.4f} | {'passed' if x['gate_passed'] else '**FAILED**'} | "
                     f"{x['mean_kl']:.5f} | {x['perplexity_delta_pct']:+.2f}% | "
                     + " / ".join(f"{x['verify_ms'][t]:.2f}" for t in ts) + " | "
                     + " / ".join(f"{x['verify_speedup_vs_fp32'][t]:.2f}×" for t in ts) + " |")
    if r["rows"]:
        first = r["rows"][0]
        lines += ["", "fp32 verify ms: " + " / ".join(f"{r['fp32_verify_ms'][t]:.2f}" for t in ts) + f"; every row "
                  f"on the same {first['positions']} held-out positions (fingerprint {first['heldout_fingerprint']}). "
                  "Verify ms: median of 15 forwards of a T-node tree at context 128, one recipe after another (not "
                  "interleaved: `spectrt compare` interleaves).", ""]
    chosen = r["chosen"]
    lines.append(f"Chosen (the fastest W8A8 recipe at T=1 whose top-1 clears the gate by {GATE_MARGIN}): `{chosen}`"
                 if chosen else "**No W8A8 recipe clears the gate**: none is made the default.")
    if chosen != r["default"]:
        lines.append(f"**The shipped default `{r['default']}` is not the recipe chosen here.**")
    return "\n".join(lines) + "\n"
