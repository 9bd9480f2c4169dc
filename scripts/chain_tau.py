"""Chain τ of drafts through `Decoder` on the bench prompts (issue 30's "chain 1,1,1 τ ≥ 2.1, 1,1,1,1,1 τ ≥ 2.3").

Under the CPU lock (τ is a count, so the machine's speed does not enter it, but the run takes minutes):

    flock /tmp/spectrt.lock .venv/bin/python scripts/chain_tau.py [DRAFT_DIR ...] [--limit N] [--dtype bf16]
        [--sets chat,repetitive] [--tokens 128] [--chains "1,1,1;1,1,1,1,1"]

Every prompt of each set is decoded greedily (the chat template, `--tokens` new tokens, the requests batched as the
loop batches them) with static chains of each draft (default: the installed draft), suffix candidates off, so τ
(emitted tokens over target passes) measures the draft alone. Prints per set, draft and chain its τ and how many
outputs equal AR's (greedy: all must). The bench prompts are never trained or tuned on.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from spectrt.runtime.decoding.bench import read_prompt_sets
    from spectrt.runtime.decoding.decoder import Job
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.tree import Tree
    from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS, resolve_models

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("drafts", nargs="*", type=Path, help="draft dirs (default: the installed draft)")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--limit", type=int, help="the first N prompts of each set")
    p.add_argument("--sets", default="chat,repetitive")
    p.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--chains", default="1,1,1;1,1,1,1,1", help="static trees, ';'-separated")
    args = p.parse_args(argv)
    target, installed = resolve_models(None, None, DEFAULT_ARTIFACTS)
    drafts = args.drafts or [installed]
    chains = [Tree.parse(spec) for spec in args.chains.split(";")]
    pipes = [Pipeline(target, d, dtype=args.dtype, max_seq_len=1024, max_active=8, prefix_cache=False)
             for d in drafts]
    for name, prompts in read_prompt_sets(None, args.limit, tuple(args.sets.split(","))).items():
        ids = [pipes[0].encode(prompt) for prompt in prompts]
        ar = [job.out for job in pipes[0].decoder.run([Job(list(x), args.tokens, None) for x in ids])]
        for draft, pipe in zip(drafts, pipes, strict=True):
            for spec, chain in zip(args.chains.split(";"), chains, strict=True):
                jobs = pipe.decoder.run([Job(list(x), args.tokens, chain, suffix=False) for x in ids])
                tau = sum(j.stats.emitted_tokens for j in jobs) / sum(j.stats.target_passes for j in jobs)
                same = sum(j.out == want for j, want in zip(jobs, ar, strict=True))
                print(f"{name:10s} {str(draft):45s} chain {spec:10s} τ {tau:.3f}   = AR {same}/{len(jobs)}",
                      flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
