"""A precision nobody tuned here (`--dtype fp32` after `make demo`): what each fallback policy decodes against that
precision's own AR, in one warm process, interleaved prompt by prompt (order reversed per prompt), decode time only.

    flock /tmp/spectrt.lock .venv/bin/python scripts/untuned_precision.py [--dtype fp32] [--tokens 96]

Compares the untuned default `Policy()` with the policy `default_policy` picks now (the one tuned for another
precision on this machine), on bench/prompts.txt (chat) and bench/prompts_repetitive.txt; prints per set the speedup
over AR (tokens over summed seconds) and the worst prompt's.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--tokens", type=int, default=96)
    args = p.parse_args()
    from spectrt.runtime.decoding.bench import machine_record
    from spectrt.runtime.decoding.pipeline import Pipeline, default_policy
    from spectrt.runtime.decoding.policy import Policy
    from spectrt.runtime.engines.checkpoint import default_draft, resolve_target

    target = resolve_target()
    draft = default_draft(target)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        picked = default_policy(target, draft, args.dtype)
    pipe = Pipeline(target, draft, dtype=args.dtype, max_seq_len=1024, prefix_cache=False, policy=Policy())
    configs = {"AR": None, "untuned Policy()": Policy(), "default_policy": picked}
    pipe.generate("Hi", 8, Policy())  # warm-up
    print(machine_record()["cpu"], args.dtype, "|", *(str(w.message) for w in said))
    for name in ("prompts.txt", "prompts_repetitive.txt"):
        prompts = [line for line in (ROOT / "bench" / name).read_text().splitlines() if line.strip()]
        totals = {c: [0, 0.0] for c in configs}
        worst = {c: float("inf") for c in configs}
        for i, prompt in enumerate(prompts):
            runs = {}
            for c in (list(configs) if i % 2 == 0 else list(configs)[::-1]):
                g = pipe.generate(prompt, args.tokens, configs[c])
                runs[c] = (g.stats.new_tokens, g.stats.decode_seconds)
                totals[c][0] += g.stats.new_tokens
                totals[c][1] += g.stats.decode_seconds
            ar = runs["AR"][0] / runs["AR"][1]
            for c in configs:
                worst[c] = min(worst[c], runs[c][0] / runs[c][1] / ar)
        ar = totals["AR"][0] / totals["AR"][1]
        print(f"{name} ({len(prompts)} prompts, {args.tokens} tokens): AR {ar:.1f} tok/s; " + "; ".join(
            f"{c} {t / s / ar:.2f}x (worst {worst[c]:.2f}x)" for c, (t, s) in totals.items() if c != "AR"))


if __name__ == "__main__":
    main()
