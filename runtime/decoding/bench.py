"""`spectrt bench`: autoregressive vs static trees vs suffix-only vs the default policy, per prompt set; with
`--multi-turn`, chat conversations with and without the prefix cache (time to first token by turn, throughput at
a concurrency).

Two prompt sets by default: chat (bench/prompts.txt) and repetitive tasks (bench/prompts_repetitive.txt:
edits, conversions, corrections, extraction, where answers repeat the prompt). Ratios measured in one run.

Configurations are interleaved prompt by prompt so machine noise hits all of them alike; the
baseline is the same engine's own autoregressive loop (its fastest kernels included).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from spectrt.runtime.decoding.decoder import Decoder, Job
from spectrt.runtime.decoding.pipeline import Pipeline
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.sampling import SamplingParams
from spectrt.runtime.decoding.tree import AUTO, DEFAULT_TREE, Tree
from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS
from spectrt.runtime.resources import package_path
from tqdm import tqdm

BENCH_DIR = package_path("bench")
DEFAULT_PROMPTS = BENCH_DIR / "prompts.txt"
# long: 1.0-1.8k-token passages of the project's own docs, each with a question, where attention and the draft's
# KV reads weigh (the set that showed the EAGLE-3 head's subnormal slowdown, cpu_kernels.cpp `vexp`)
PROMPT_SETS = {"chat": DEFAULT_PROMPTS, "repetitive": BENCH_DIR / "prompts_repetitive.txt",
               "long": BENCH_DIR / "prompts_long.txt"}
MULTI_TURN_PROMPTS = BENCH_DIR / "prompts_multiturn.txt"
DEFAULT_CHAIN = "1,1,1"


@dataclass(frozen=True)
class BenchSettings:
    """What one `spectrt bench` run measures, as plain values (the CLI reads the flags into one)."""

    prompts: Path | None = None  # one prompt file (a conversation file with multi_turn); None: the default sets
    limit: int | None = None  # the first N prompts (conversations) of each set
    trees: tuple[str, ...] | None = None  # static tree specs compared (None: DEFAULT_CHAIN and DEFAULT_TREE)
    temperatures: tuple[float, ...] = (0.0,)
    max_new_tokens: int = 128
    backend: str = "torch"
    dtype: str = "auto"
    max_seq_len: int = 2048
    out: Path = Path("bench/results")
    artifacts: Path = DEFAULT_ARTIFACTS
    concurrency: int = 8  # multi_turn: conversations decoded together
    rounds: int = 2  # runs of each prompt per configuration, the order reversed each round (`_bench_temperature`)


def read_prompts(path: Path | None) -> list[str]:
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist: pass --prompts FILE (one prompt per line)")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts: write one prompt per line")
    return prompts


def read_prompt_sets(prompts: Path | None, limit: int | None, names: tuple[str, ...] = tuple(PROMPT_SETS)
                     ) -> dict[str, list[str]]:
    """`--prompts FILE` as one set named by its stem, else the named default sets; the first `limit` of each."""
    sets = {Path(prompts).stem: Path(prompts)} if prompts else {name: PROMPT_SETS[name] for name in names}
    return {name: read_prompts(path)[:limit] for name, path in sets.items()}


def bench_configs(pipe: Pipeline, trees: tuple[str, ...] | None, has_draft: bool) -> dict[str, Tree | Policy | None]:
    """AR, the static trees asked for (default: a chain and the 2,1 tree), draft-less suffix speculation and
    the default policy (what `generate` runs)."""
    configs: dict[str, Tree | Policy | None] = {"autoregressive": None}
    if has_draft:
        for spec in trees or (DEFAULT_CHAIN, DEFAULT_TREE):
            tree = Tree.parse(spec)
            configs[f"{'chain' if all(len(k) <= 1 for k in tree.children) else 'tree'} {spec}"] = tree
    suffix_only = replace(pipe.policy, draft=False, depth=0)
    configs["suffix only (no draft)"] = suffix_only
    if pipe.policy != suffix_only and has_draft:
        configs["policy (default)"] = pipe.policy
    return configs


def machine_record() -> dict:
    """Where and when a result was measured, and the command that measured it (scripts/bench_tables.py groups
    results by CPU class: speeds are comparable only within one)."""
    from spectrt.runtime.engines.kernels import cpu_class, native_isa

    return {"machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
            "cpu": {"class": cpu_class(), "cores": os.cpu_count(), "native_isa": native_isa()},
            "command": shlex.join(["spectrt", *sys.argv[1:]]),
            "time": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


def results_dir(out: Path) -> Path:
    """OUT/<cpu class>/: one current result per configuration and CPU class (older ones in git history)."""
    from spectrt.runtime.engines.kernels import cpu_class

    path = Path(out) / re.sub(r"[^a-z0-9]+", "-", cpu_class().lower()).strip("-")
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_bench(target: Path, draft: Path | None, args: BenchSettings) -> dict:
    prompt_sets = read_prompt_sets(args.prompts, args.limit)
    # no prefix cache: the configurations run each prompt one after another, and with the cache every later one
    # would start from the earlier one's KV and draft rows (they would not be compared on equal terms)
    pipe = Pipeline(target, draft, args.backend, args.dtype, args.max_seq_len,
                    artifacts=args.artifacts, prefix_cache=False)
    configs = bench_configs(pipe, args.trees, draft is not None)
    first = next(iter(prompt_sets.values()))[0]
    for tree in configs.values():  # warm-up: kernel choice for every shape, allocator, caches
        pipe.generate(first, 8, tree)

    rows = []
    for set_name, prompts in prompt_sets.items():
        for temperature in args.temperatures:
            rows += _bench_temperature(pipe, set_name, prompts, configs, temperature, args)
    report = {
        "target": str(target), "draft": str(draft), "dtype": args.dtype, "backend": args.backend,
        "prompt_sets": {name: len(p) for name, p in prompt_sets.items()}, "max_new_tokens": args.max_new_tokens,
        "policy": pipe.policy.to_json(),
        **machine_record(), "results": rows,
    }
    out = results_dir(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"bench_{args.backend}_{args.dtype}{_partial_tag(args)}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    table = markdown_table(report)
    (out / f"{stem}.md").write_text(table)
    plot(report, out / f"{stem}.png")
    print(table)
    return report


def _bench_temperature(pipe: Pipeline, set_name: str, prompts: list[str], configs: dict, temperature: float,
                       args: BenchSettings) -> list[dict]:
    totals = {name: {"tokens": 0, "emitted": 0, "seconds": 0.0, "passes": 0, "draft_passes": 0, "accepted": [],
                     "verified": [], "same_as_ar": 0, "per_prompt": []} for name in configs}
    for i, prompt in enumerate(tqdm(prompts, desc=f"bench {set_name} {args.dtype} T={temperature}", unit="prompt")):
        # Each prompt runs every configuration `rounds` times, the order reversed each round, and its speedup is
        # tokens over summed seconds. Why: this machine's speed moved in steps (AR on one prompt 115 then 160
        # tokens/s, tens of seconds apart: a neighbour's load), and one run per configuration put such a step
        # between a prompt's AR and policy runs: one prompt read 0.95x in one round, 1.31x in the next.
        summed = {name: [0, 0.0] for name in configs}  # this prompt's tokens and decode seconds over the rounds
        same = {name: True for name in configs}
        for r in range(args.rounds):
            outputs = {}
            for name in (list(configs) if r % 2 == 0 else list(reversed(configs))):
                params = SamplingParams(temperature=temperature, seed=i)
                gen = pipe.generate(prompt, args.max_new_tokens, configs[name], params=params)
                outputs[name] = gen.token_ids
                summed[name][0] += gen.stats.new_tokens
                summed[name][1] += gen.stats.decode_seconds
                if r == 0:  # counters from one round (the rounds decode alike)
                    t = totals[name]
                    t["tokens"] += gen.stats.new_tokens
                    t["passes"] += gen.stats.target_passes
                    t["emitted"] += gen.stats.emitted_tokens
                    t["draft_passes"] += gen.stats.draft_passes
                    t["accepted"] += gen.stats.accepted
                    t["verified"] += gen.stats.verified
            for name in configs:
                same[name] = same[name] and outputs[name] == outputs["autoregressive"]
        for name, (tokens, seconds) in summed.items():
            t = totals[name]
            t["seconds"] += seconds / args.rounds
            t["per_prompt"].append(tokens / seconds if seconds > 0 else 0.0)
            t["same_as_ar"] += same[name]

    ar = totals["autoregressive"]
    base = ar["tokens"] / ar["seconds"]
    rows = []
    for name, tree in configs.items():
        t = totals[name]
        depth = max(len(t["accepted"]) and max(t["accepted"]), tree.max_depth if isinstance(tree, Tree) else 0)
        passes = max(len(t["accepted"]), 1)
        per_prompt = [s / a for s, a in zip(t["per_prompt"], ar["per_prompt"], strict=True) if a > 0]
        rows.append({
            "set": set_name,
            "config": name,
            "temperature": temperature,
            "tree_nodes": sum(t["verified"]) / max(len(t["verified"]), 1),
            "tokens_per_second": t["tokens"] / t["seconds"],
            "speedup_vs_ar": t["tokens"] / t["seconds"] / base,
            "min_prompt_speedup": min(per_prompt, default=1.0),
            "tau": t["emitted"] / max(t["passes"], 1),
            "draft_passes_per_target_pass": t["draft_passes"] / max(t["passes"], 1),
            "acceptance_per_depth": [sum(a >= d for a in t["accepted"]) / passes for d in range(1, depth + 1)],
            # greedy outputs must equal AR's; sampled outputs legitimately differ (same distribution)
            "outputs_equal_to_ar": f"{t['same_as_ar']}/{len(prompts)}" if temperature == 0 else "n/a",
        })
    return rows


def read_conversations(path: Path | None) -> list[list[str]]:
    """Conversations of user turns: one turn per line, a blank line between conversations."""
    path = Path(path) if path else MULTI_TURN_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"conversation file {path} does not exist: pass --prompts FILE (one user turn per "
                                "line, a blank line between conversations)")
    blocks = [[t.strip() for t in block.splitlines() if t.strip()]
              for block in path.read_text(encoding="utf-8").split("\n\n")]
    conversations = [b for b in blocks if b]
    if not conversations:
        raise ValueError(f"{path} has no conversations")
    return conversations


class _Conversation:
    """One chat's state: its user turns, the history so far, the job of the turn in flight."""

    def __init__(self, turns: list[str]):
        self.turns, self.messages, self.job = turns, [], None
        self.ttft: list[float] = []
        self.cached: list[int] = []

    def next_job(self, pipe: Pipeline, max_new_tokens: int) -> Job | None:
        if self.job is not None:
            text = pipe.tokenizer.decode(self.job.out, skip_special_tokens=True)
            self.messages.append({"role": "assistant", "content": text})
        if len(self.messages) // 2 == len(self.turns):
            return None
        self.messages.append({"role": "user", "content": self.turns[len(self.messages) // 2]})
        ids = pipe.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True, tokenize=True)
        self.job = Job(list(ids["input_ids"] if hasattr(ids, "keys") else ids), max_new_tokens, AUTO)
        return self.job


def _serve_conversations(pipe: Pipeline, decoder: Decoder, turns: list[list[str]], max_new_tokens: int) -> dict:
    """All conversations through `decoder`, each turn sent as soon as its previous one finished (a client with no
    think time; up to `decoder.max_active` at once): wall seconds, output tokens, per conversation TTFT and cached
    tokens by turn, and the answers."""
    chats = [_Conversation(t) for t in turns]
    waiting, admitted, tokens = list(chats), {}, 0
    start = time.perf_counter()
    while waiting or decoder.active:
        while waiting and decoder.free:
            chat = waiting.pop(0)
            job = chat.next_job(pipe, max_new_tokens)
            if job is None:
                continue
            decoder.add(job)
            admitted[id(job)] = (chat, time.perf_counter())
            chat.cached.append(job.stats.cached_tokens)
        if not decoder.active:
            continue
        info = decoder.step()
        now = time.perf_counter()
        for job, new in info.emitted:
            chat, added = admitted[id(job)]
            if len(chat.ttft) < len(chat.cached):
                chat.ttft.append(now - added)
            tokens += len(new)
        for job in info.finished:
            chat, added = admitted.pop(id(job))
            if len(chat.ttft) < len(chat.cached):  # ended without a token
                chat.ttft.append(now - added)
            waiting.append(chat)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "ttft": [c.ttft for c in chats], "cached": [c.cached for c in chats],
            "answers": [[m["content"] for m in c.messages if m["role"] == "assistant"] for c in chats]}


def run_multi_turn(target: Path, draft: Path | None, args: BenchSettings) -> dict:
    """Time to first token by turn of one conversation (a decoder of one slot), then throughput of all
    conversations at `args.concurrency`, each with and without the prefix cache, on the same engines; greedy, the
    default policy. The single-slot runs take the cache on first, the batched ones the cache off first, so a
    later-run advantage (warmer caches and allocator) falls on each setting once."""
    conversations = read_conversations(args.prompts)[: args.limit]
    pipe = Pipeline(target, draft, args.backend, args.dtype, args.max_seq_len, artifacts=args.artifacts)
    engines = (pipe.decoder.target, pipe.decoder.draft, pipe.decoder.eos_ids)

    def decoder(cache: bool, slots: int) -> Decoder:
        return Decoder(*engines, max_seq_len=args.max_seq_len, max_active=slots, policy=pipe.policy,
                       prefix_cache=cache)

    _serve_conversations(pipe, decoder(False, 1), [conversations[0][:1]], 8)  # warm-up
    single = {c: _serve_conversations(pipe, decoder(c, 1), conversations[:1], args.max_new_tokens)
              for c in (True, False)}
    batched = {c: _serve_conversations(pipe, decoder(c, args.concurrency), conversations, args.max_new_tokens)
               for c in (False, True)}
    ttft = {c: single[c]["ttft"][0] for c in single}
    report = {
        "target": str(target), "draft": str(draft), "dtype": pipe.dtype, "backend": args.backend,
        "conversations": len(conversations), "turns": [len(c) for c in conversations],
        "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency, "policy": pipe.policy.to_json(),
        **machine_record(),
        "ttft_by_turn": {"cached": ttft[True], "uncached": ttft[False],
                         "ratio": [a / b for a, b in zip(ttft[True], ttft[False], strict=True)],
                         "cached_tokens": single[True]["cached"][0]},
        "concurrent": {("cached" if c else "uncached"): {"seconds": r["seconds"], "tokens": r["tokens"],
                                                           "tokens_per_second": r["tokens"] / r["seconds"],
                                                           "cached_tokens": sum(map(sum, r["cached"]))}
                       for c, r in batched.items()},
        "answers_equal": single[True]["answers"] == single[False]["answers"]
        and batched[True]["answers"] == batched[False]["answers"],
    }
    out = results_dir(args.out)
    stem = f"multiturn_{args.backend}_{pipe.dtype}"
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2))
    table = multi_turn_table(report)
    (out / f"{stem}.md").write_text(table)
    print(table)
    return report


def multi_turn_table(report: dict) -> str:
    t, c = report["ttft_by_turn"], report["concurrent"]
    lines = [f"### multi-turn {report['backend']} {report['dtype']}, draft {Path(report['draft']).name}: "
             f"{report['conversations']} conversations, {report['max_new_tokens']} new tokens a turn "
             f"({report['machine']})", "",
             "| turn | cached tokens | TTFT cached (ms) | TTFT uncached (ms) | ratio |", "|---|---|---|---|---|"]
    for i, (n, a, b, r) in enumerate(zip(t["cached_tokens"], t["cached"], t["uncached"], t["ratio"], strict=True)):
        lines.append(f"| {i + 1} | {n} | {1000 * a:.1f} | {1000 * b:.1f} | {r:.2f} |")
    speed = c["cached"]["tokens_per_second"] / c["uncached"]["tokens_per_second"]
    lines += ["", f"Concurrency {report['concurrency']}: {c['cached']['tokens_per_second']:.1f} tok/s with the cache, "
              f"{c['uncached']['tokens_per_second']:.1f} without ({speed:.2f}x); answers equal: "
              f"{report['answers_equal']}"]
    return "\n".join(lines) + "\n"


def markdown_table(report: dict) -> str:
    sets = ", ".join(f"{n} {k}" for n, k in report["prompt_sets"].items())
    lines = [
        f"### {report['backend']} {report['dtype']} — prompts: {sets} × {report['max_new_tokens']} "
        f"new tokens ({report['machine']})",
        "",
        "| set | config | temperature | mean nodes | tok/s | speedup vs AR | worst prompt | τ | acceptance per depth "
        "| output = AR |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_depth"][:6]) or "—"
        lines.append(f"| {r['set']} | {r['config']} | {r['temperature']} | {r['tree_nodes']:.1f} | "
                     f"{r['tokens_per_second']:.1f} | {r['speedup_vs_ar']:.2f}× | {r['min_prompt_speedup']:.2f}× | "
                     f"{r['tau']:.2f} | {acc} | {r['outputs_equal_to_ar']} |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Speedup vs AR per configuration, one group of bars per prompt set (worst prompt as a marker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report["results"] if r["temperature"] == report["results"][0]["temperature"]]
    sets = list(dict.fromkeys(r["set"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(2 + 2.2 * len(sets) + 0.4 * len(configs), 4))
    for i, config in enumerate(configs):
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(sets))]
        vals = [next(r for r in rows if r["set"] == s and r["config"] == config) for s in sets]
        bars = ax.bar(xs, [v["speedup_vs_ar"] for v in vals], width, label=config)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
        ax.scatter(xs, [v["min_prompt_speedup"] for v in vals], marker="_", color="black", s=60, zorder=3)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(sets)), sets)
    ax.set_ylabel("tokens/s vs autoregressive (— worst prompt)")
    ax.set_title(f"{report['backend']} {report['dtype']}, T={rows[0]['temperature']} ({report['machine']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def step_cost_ms(engine, tokens: int = 1, context: int = 128, repeats: int = 20) -> float:
    """Median milliseconds of one forward of a `tokens`-node tree after `context` cached ones (profile.py)."""
    from spectrt.runtime.decoding.profile import forward_ms, prefilled_cache

    return forward_ms(engine, tokens, prefilled_cache(engine, context), repeats)


def _partial_tag(args: BenchSettings) -> str:
    """A results file name's tag for a run that is not the full greedy bench (another prompt file, a limit, sampled
    temperatures): such a run gets its own file, which `scripts/bench_tables.py` does not render. Why: every run
    wrote `bench_<backend>_<dtype>.json`, so a sampled or a 2-prompt run replaced the class's published result."""
    parts = ([Path(args.prompts).stem] if args.prompts else []) + ([f"limit{args.limit}"] if args.limit else [])
    if tuple(args.temperatures) != (0.0,):
        parts.append("t" + "-".join(f"{t:g}" for t in args.temperatures))
    return "".join(f"_{part}" for part in parts)


def draft_runtime_report(target: Path, draft: Path, prompts: list[str], tree: str = DEFAULT_TREE,
                         max_new_tokens: int = 96) -> dict:
    """What a draft buys at run time: τ with the default tree, tok/s vs AR, draft/target step cost; AR and the tree
    alternate which runs first, on a decoder without the prefix cache (with it the tree's run reused the AR run's
    prompt and its draft read the prompt inside the timed decode), and the outputs are checked equal."""
    pipe = Pipeline(target, draft, prefix_cache=False)
    pipe.generate(prompts[0], 8, tree)
    totals = {"ar": [0, 0.0], "tree": [0, 0.0]}
    passes = emitted = exact = 0
    for i, prompt in enumerate(tqdm(prompts, desc="draft report", unit="prompt")):
        if i % 2:
            spec, ar = pipe.generate(prompt, max_new_tokens, tree), pipe.generate(prompt, max_new_tokens, None)
        else:
            ar, spec = pipe.generate(prompt, max_new_tokens, None), pipe.generate(prompt, max_new_tokens, tree)
        exact += spec.token_ids == ar.token_ids
        totals["ar"][0] += ar.stats.new_tokens
        totals["ar"][1] += ar.stats.decode_seconds
        totals["tree"][0] += spec.stats.new_tokens
        totals["tree"][1] += spec.stats.decode_seconds
        passes += spec.stats.target_passes
        emitted += spec.stats.emitted_tokens
    target_ms = step_cost_ms(pipe.decoder.target)
    draft_ms = step_cost_ms(pipe.decoder.draft)
    ar_tps, tree_tps = (n / s for n, s in totals.values())
    return {
        "tree": tree, "prompts": len(prompts), "max_new_tokens": max_new_tokens,
        "tau": emitted / max(passes, 1), "outputs_equal_to_ar": f"{exact}/{len(prompts)}",
        "ar_tokens_per_second": ar_tps, "tree_tokens_per_second": tree_tps, "speedup_vs_ar": tree_tps / ar_tps,
        "target_step_ms": target_ms, "draft_step_ms": draft_ms, "draft_to_target_step_cost": draft_ms / target_ms,
    }
