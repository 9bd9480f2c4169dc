"""Speculation against plain batched decoding in one process, at one batch size (issue 31's in-process bar).

Under the CPU lock, with nothing else running:

    flock /tmp/spectrt.lock .venv/bin/python scripts/batch_vs_plain.py [--batch 8] [--prompts 16] [--tokens 64]
        [--min-length] [--draft DIR|none] [--rounds 2] [--continuous] [--alt-policy FILE]

Decodes the bench prompts `--batch` at a time (greedy), the default (dynamic trees under the tuned policy) and the
target alone, interleaved round by round, and prints each mode's tokens/s, tokens and verified decode rows a step and
the decoder's per-step breakdown (`Decoder.clock`: forwards and host work), then default over plain and how many
outputs equal plain's (greedy: all must). Both modes are warmed up at the full batch first. Closed batches
(the default) end in a ragged tail where speculation's requests finish at different steps; `--continuous` submits
every prompt at once through `--batch` slots, a finished request's slot taken by the next one, as a server under
steady load runs. `--alt-policy` adds a third mode, dynamic trees under another saved policy (a `spectrt tune` file),
to compare two policies against the same plain runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from spectrt.runtime.decoding.bench import DEFAULT_PROMPTS, read_prompts
    from spectrt.runtime.decoding.decoder import Job, StepClock
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.tree import AUTO
    from spectrt.runtime.engines.checkpoint import resolve_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompts", type=int, default=16, help="the first N bench prompts")
    p.add_argument("--prompt-file", type=Path, help="prompts from this file (default: bench/prompts.txt)")
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    p.add_argument("--min-length", action="store_true", help="every request decodes all --tokens (min_length)")
    p.add_argument("--draft", default=None, help="draft dir ('none': suffix candidates only; default: the shipped)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--continuous", action="store_true",
                   help="all prompts in one run through --batch slots (continuous admission) instead of closed batches")
    p.add_argument("--artifacts", type=Path, default=Path("artifacts"))
    p.add_argument("--alt-policy", type=Path, help="a policy file: a third mode, AUTO under that policy")
    args = p.parse_args(argv)
    target, draft = resolve_models(None, args.draft, args.artifacts)
    # no prefix cache: the two modes decode the same prompts one after the other, and a later one would start from
    # the earlier one's KV (its prefill skipped, and prefill steps count in a step's average)
    pipe = Pipeline(target, draft, dtype=args.dtype, max_seq_len=1024, artifacts=args.artifacts,
                    max_active=args.batch, prefix_cache=False)
    decoder = pipe.decoder
    ids = [pipe.encode(text) for text in read_prompts(args.prompt_file or DEFAULT_PROMPTS)[:args.prompts]]
    for tree in (None, AUTO):  # warm up both modes at the full batch: the first run to touch every slot's KV and
        # scratch paid for it, and round 0 ran plain first (a bias for speculation)
        decoder.run([Job(list(x), 8, tree) for x in ids[:args.batch]])
    tuned = decoder.controller.policy
    policies = {"plain": tuned, "default": tuned}
    if args.alt_policy:
        from spectrt.runtime.decoding.policy import load_policy

        policies["alt"] = load_policy(args.alt_policy)
        if policies["alt"] is None:
            p.error(f"--alt-policy {args.alt_policy}: no such file")
    totals = {name: [0, 0.0, 0] for name in policies}
    outputs: dict[str, list[list[int]]] = {}  # each mode's greedy outputs in its first round: all must be plain's
    rates: dict[str, list[float]] = {name: [] for name in policies}  # tok/s per round: the paired ratios' spread
    for rnd in range(args.rounds):
        modes = tuple((name, None if name == "plain" else AUTO) for name in policies)
        for name, tree in modes if rnd % 2 == 0 else modes[::-1]:  # each mode first in every other round
            decoder.controller.policy = policies[name]
            decoder.clock = StepClock()
            tokens = rows = 0
            group = len(ids) if args.continuous else args.batch
            for start in range(0, len(ids), group):
                jobs = [Job(list(x), args.tokens, tree, min_length=args.tokens if args.min_length else 0)
                        for x in ids[start:start + group]]
                done = decoder.run(jobs)
                if rnd == 0:
                    outputs.setdefault(name, []).extend(j.out for j in done)
                tokens += sum(len(j.out) for j in done)
                rows += sum(sum(j.stats.verified) for j in done)  # decode rows the target verified (roots included)
            clock = decoder.clock
            t = totals[name]
            t[0], t[1], t[2] = t[0] + tokens, t[1] + clock.total, t[2] + clock.steps
            rates[name].append(tokens / clock.total)
            print(f"round {rnd} {name:7s} {tokens / clock.total:6.1f} tok/s, {tokens / clock.steps:.2f} tokens a step, "
                  f"{rows / clock.steps:.2f} decode rows a step, ms a step {clock.per_step_ms()}", flush=True)
    pt, ps, pn = totals["plain"]
    mode = f"batch {args.batch}{' continuous' if args.continuous else ''}"
    for name in policies:
        if name != "plain":
            dt, ds, dn = totals[name]
            same = sum(a == b for a, b in zip(outputs[name], outputs["plain"], strict=True))
            print(f"{mode}, min_length {args.min_length}: {name} / plain {dt / ds / (pt / ps):.3f} "
                  f"({dt / dn:.2f} against {pt / pn:.2f} tokens a step); rounds "
                  f"{', '.join(f'{d / q:.3f}' for d, q in zip(rates[name], rates['plain'], strict=True))}; "
                  f"outputs = plain {same}/{len(outputs['plain'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
