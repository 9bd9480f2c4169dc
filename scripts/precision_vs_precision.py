"""Two precisions' AR and default policy in one warm process (issue 30's "against the fastest exact AR" comparison).

Under the CPU lock, with nothing else running:

    flock /tmp/spectrt.lock .venv/bin/python scripts/precision_vs_precision.py [--dtypes bf16,bf16dot] [--limit N]
        [--sets chat,repetitive] [--tokens 128]

Loads one Pipeline per precision (the shipped draft, each precision's tuned policy from artifacts/) and runs every
prompt through each precision's AR and default policy twice, the order reversed the second time; decode seconds
only. Prints per set each configuration's tokens/s, its speedup over its own AR and over the faster AR, its worst
prompt against its own AR, τ, and how many outputs equal its own AR's (greedy: all must).
"""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> int:
    from spectrt.runtime.decoding.bench import read_prompt_sets
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS, resolve_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtypes", default="bf16,bf16dot")
    p.add_argument("--limit", type=int, help="the first N prompts of each set")
    p.add_argument("--sets", default="chat,repetitive")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    args = p.parse_args(argv)
    target, draft = resolve_models(None, None, DEFAULT_ARTIFACTS)
    pipes = {dt: Pipeline(target, draft, "torch", dt, 2048, prefix_cache=False) for dt in args.dtypes.split(",")}
    configs = [(dt, mode) for dt in pipes for mode in ("ar", "policy")]

    def run(config: tuple[str, str], prompt: str, tokens: int):
        pipe = pipes[config[0]]
        return pipe.generate(prompt, tokens, None if config[1] == "ar" else pipe.policy)

    prompt_sets = read_prompt_sets(None, args.limit, tuple(args.sets.split(",")))
    for config in configs:  # warm-up: kernel choice, allocator, caches
        run(config, next(iter(prompt_sets.values()))[0], 8)
    for set_name, prompts in prompt_sets.items():
        tokens, seconds, passes, emitted = ({c: 0.0 for c in configs} for _ in range(4))
        per_prompt, same = {c: [] for c in configs}, {c: 0 for c in configs}
        for prompt in prompts:
            summed, outputs = {c: [0, 0.0] for c in configs}, {c: [] for c in configs}
            for rnd in range(2):
                for c in configs if rnd == 0 else configs[::-1]:
                    result = run(c, prompt, args.tokens)
                    outputs[c].append(result.token_ids)  # both rounds' outputs are checked, not the last one's
                    summed[c][0] += result.stats.new_tokens
                    summed[c][1] += result.stats.decode_seconds
                    if rnd == 0:
                        passes[c] += result.stats.target_passes
                        emitted[c] += result.stats.emitted_tokens
            for c in configs:
                tokens[c] += summed[c][0] / 2
                seconds[c] += summed[c][1] / 2
                per_prompt[c].append(summed[c][0] / summed[c][1])
                same[c] += outputs[c] == outputs[(c[0], "ar")]
        rate = {c: tokens[c] / seconds[c] for c in configs}
        fastest_ar = max(rate[(dt, "ar")] for dt in pipes)
        print(f"\n## {set_name} ({len(prompts)} prompts, {args.tokens} new tokens)\n")
        print("| config | tok/s | vs own AR | vs faster AR | worst prompt vs own AR | τ | outputs = own AR |")
        print("|---|---|---|---|---|---|---|")
        for c in configs:
            own = (c[0], "ar")
            worst = min(a / b for a, b in zip(per_prompt[c], per_prompt[own], strict=True))
            print(f"| {c[0]} {c[1]} | {rate[c]:.1f} | {rate[c] / rate[own]:.2f} | {rate[c] / fastest_ar:.2f} | "
                  f"{worst:.2f} | {emitted[c] / max(passes[c], 1):.2f} | {same[c]}/{len(prompts)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
