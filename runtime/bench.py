"""`spectrt bench`: autoregressive vs chain vs tree on one prompt set, ratios measured in one run.

Configurations are interleaved prompt by prompt so machine noise hits all of them alike; the
baseline is the same engine's own autoregressive loop (its fastest kernels included).
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch
from spectrt.runtime.pipeline import DEFAULT_TREE, Pipeline
from spectrt.runtime.sampling import SamplingParams
from spectrt.runtime.tree import Tree
from tqdm import tqdm

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "bench" / "prompts.txt"
DEFAULT_CHAIN = "1,1,1"


def read_prompts(path: Path | None) -> list[str]:
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist: pass --prompts FILE (one prompt per line)")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts: write one prompt per line")
    return prompts


def run_bench(target: Path, draft: Path | None, args) -> dict:
    prompts = read_prompts(args.prompts)[: args.limit]
    specs = args.trees.split(";") if args.trees else [DEFAULT_CHAIN, DEFAULT_TREE]
    configs: dict[str, Tree | None] = {"autoregressive": None}
    for spec in specs:
        tree = Tree.parse(spec)
        is_chain = all(len(kids) <= 1 for kids in tree.children)
        configs[f"{'chain' if is_chain else 'tree'} {spec}"] = tree
    temperatures = [float(t) for t in str(args.temperatures).split(",")]
    pipe = Pipeline(target, draft, args.backend, args.dtype, args.max_seq_len)
    pipe.generate(prompts[0], 8, DEFAULT_TREE)  # warm-up: kernel choice, allocator, caches

    rows = []
    for temperature in temperatures:
        rows += _bench_temperature(pipe, prompts, configs, temperature, args)
    report = {
        "target": str(target), "draft": str(draft), "dtype": args.dtype, "backend": args.backend,
        "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "results": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{args.backend}_{args.dtype}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    table = markdown_table(report)
    (out / f"{stem}.md").write_text(table)
    print(table)
    return report


def _bench_temperature(pipe: Pipeline, prompts: list[str], configs: dict[str, Tree | None], temperature: float,
                       args) -> list[dict]:
    totals = {name: {"tokens": 0, "emitted": 0, "seconds": 0.0, "passes": 0, "draft_passes": 0, "accepted": [],
                     "same_as_ar": 0} for name in configs}
    for i, prompt in enumerate(tqdm(prompts, desc=f"bench {args.dtype} T={temperature}", unit="prompt")):
        reference = None
        for name, tree in configs.items():
            params = SamplingParams(temperature=temperature, seed=i)
            gen = pipe.generate(prompt, args.max_new_tokens, tree, params=params)
            t = totals[name]
            t["tokens"] += gen.stats.new_tokens
            t["seconds"] += gen.stats.seconds
            t["passes"] += gen.stats.target_passes
            t["emitted"] += gen.stats.emitted_tokens
            t["draft_passes"] += gen.stats.draft_passes
            t["accepted"] += gen.stats.accepted
            reference = gen.token_ids if reference is None else reference
            t["same_as_ar"] += gen.token_ids == reference

    base = totals["autoregressive"]["tokens"] / totals["autoregressive"]["seconds"]
    rows = []
    for name, tree in configs.items():
        t = totals[name]
        depth = tree.max_depth if tree is not None else 0
        passes = max(len(t["accepted"]), 1)
        rows.append({
            "config": name,
            "temperature": temperature,
            "tree_nodes": len(tree) if tree is not None else 1,
            "tokens_per_second": t["tokens"] / t["seconds"],
            "speedup_vs_ar": t["tokens"] / t["seconds"] / base,
            "tau": t["emitted"] / max(t["passes"], 1),
            "draft_passes_per_target_pass": t["draft_passes"] / max(t["passes"], 1),
            "acceptance_per_depth": [sum(a >= d for a in t["accepted"]) / passes for d in range(1, depth + 1)],
            # greedy outputs must equal AR's; sampled outputs legitimately differ (same distribution)
            "outputs_equal_to_ar": f"{t['same_as_ar']}/{len(prompts)}" if temperature == 0 else "n/a",
        })
    return rows


def markdown_table(report: dict) -> str:
    lines = [
        f"### {report['backend']} {report['dtype']} — {report['prompts']} prompts × {report['max_new_tokens']} "
        f"new tokens ({report['machine']})",
        "",
        "| config | temperature | nodes | tok/s | speedup vs AR | τ | acceptance per depth | output = AR |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_depth"]) or "—"
        lines.append(f"| {r['config']} | {r['temperature']} | {r['tree_nodes']} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup_vs_ar']:.2f}× | {r['tau']:.2f} | {acc} | {r['outputs_equal_to_ar']} |")
    return "\n".join(lines) + "\n"


def step_cost_ms(engine, tokens: int = 1, context: int = 128, repeats: int = 20) -> float:
    """Median milliseconds of one forward of `tokens` new tokens after `context` cached ones."""
    cache = engine.new_cache(context + 64, 64)
    ids = torch.arange(context) % engine.config.vocab_size
    engine.forward(ids[:64], torch.arange(64), torch.ones(64, 64, dtype=torch.bool).tril(), cache)
    cache.commit(64)
    engine.forward(ids[64:], torch.arange(64, context), torch.ones(context - 64, context - 64, dtype=torch.bool).tril(),
                   cache)
    cache.commit(context - 64)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    times = []
    for _ in range(repeats + 3):
        start = time.perf_counter()
        engine.forward(ids[:tokens], torch.arange(context, context + tokens), mask, cache)
        times.append(time.perf_counter() - start)
    return sorted(times[3:])[repeats // 2] * 1000


def draft_runtime_report(target: Path, draft: Path, prompts: list[str], tree: str = DEFAULT_TREE,
                         max_new_tokens: int = 96) -> dict:
    """What a draft buys at run time: τ with the default tree, tok/s vs AR, draft/target step cost."""
    pipe = Pipeline(target, draft)
    pipe.generate(prompts[0], 8, tree)
    totals = {"ar": [0, 0.0], "tree": [0, 0.0]}
    passes = emitted = 0
    for prompt in tqdm(prompts, desc="draft report", unit="prompt"):
        ar = pipe.generate(prompt, max_new_tokens, None)
        spec = pipe.generate(prompt, max_new_tokens, tree)
        totals["ar"][0] += ar.stats.new_tokens
        totals["ar"][1] += ar.stats.seconds
        totals["tree"][0] += spec.stats.new_tokens
        totals["tree"][1] += spec.stats.seconds
        passes += spec.stats.target_passes
        emitted += spec.stats.emitted_tokens
    target_ms = step_cost_ms(pipe.decoder.target)
    draft_ms = step_cost_ms(pipe.decoder.draft)
    ar_tps, tree_tps = (n / s for n, s in totals.values())
    return {
        "tree": tree, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "tau": emitted / max(passes, 1),
        "ar_tokens_per_second": ar_tps, "tree_tokens_per_second": tree_tps, "speedup_vs_ar": tree_tps / ar_tps,
        "target_step_ms": target_ms, "draft_step_ms": draft_ms, "draft_to_target_step_cost": draft_ms / target_ms,
    }
