"""Served speculation against the same server's target alone (issue 31's served bars), rounds alternating.

Starts one server (`spectrt serve --dtype D --no-prefix-cache [--draft DIR]`), waits for it to be ready, then at each
concurrency runs one short unmeasured round of each mode (the KV pools fault in on first use: the first measured
round read 0.90-0.91x for whichever mode went first) and `--rounds` rounds of the default (`tree: auto`) and of
the target alone (`tree: none`), each mode first in every other round; prints every round's ratio and the summed
tokens/s ratio, and stops the server. Under the CPU lock, with nothing else running:

    flock /tmp/spectrt.lock .venv/bin/python scripts/served_vs_plain.py [--rounds 6] [--concurrency 8,1]
        [--max-tokens 96] [--dtype bf16] [--draft DIR] [--prefix-cache] [--grpc-port 8101]

Why the prefix cache is off unless asked for: the client sends the same prompts every round, and a request that
drafts reuses only a prefix whose target features the head holds, while a plain one reuses any; with the cache on,
the comparison measured prefill reuse across the two modes, not speculation (2026-12-06, Zen 4: c1 1.18x with the
cache, 1.37x without; before a fix that let plain requests reuse at all, the bias ran the other way: 1.42x).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REQUESTS_PER_WORKER = 4  # c8: 32 requests a round, c1: 4


def start_server(args: argparse.Namespace, log: Path) -> subprocess.Popen:
    """`spectrt serve` in a child process, returned once it printed that it is ready (else its log is the error)."""
    cmd = [sys.executable, "-m", "spectrt", "serve", "--dtype", args.dtype, "--grpc-port", str(args.grpc_port),
           "--http-port", str(args.grpc_port - 1), "--metrics-port", str(args.grpc_port + 1)]
    cmd += ["--draft", args.draft] if args.draft else []
    cmd += [] if args.prefix_cache else ["--no-prefix-cache"]
    out = log.open("w")
    server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if "ready" in text:
            return server
        if server.poll() is not None:
            break
        time.sleep(1)
    server.kill()
    raise SystemExit(f"the server did not become ready; its log ({log}):\n{log.read_text(errors='replace')[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    from spectrt.runtime.serving.client import DEFAULT_PROMPTS, load_run

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--concurrency", default="8,1", help="comma-separated concurrencies, each its own set of rounds")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--draft", help="draft dir for the server (default: the shipped one)")
    p.add_argument("--prefix-cache", action="store_true", help="leave the server's prefix cache on (see above)")
    p.add_argument("--grpc-port", type=int, default=8101, help="gRPC port (HTTP one below, metrics one above)")
    p.add_argument("--log", type=Path, default=Path("artifacts/served_vs_plain.log"), help="the server's output")
    args = p.parse_args(argv)
    prompts = [line.strip() for line in DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    args.log.parent.mkdir(parents=True, exist_ok=True)
    server = start_server(args, args.log)
    try:
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for tree in ("auto", "none"):  # unmeasured: the first requests fault in the KV pools, whichever mode ran
                load_run(prompts, concurrency, concurrency, 16, url=f"127.0.0.1:{args.grpc_port}", tree=tree)
            rates: dict[str, list[float]] = {"auto": [], "none": []}
            for r in range(args.rounds):
                for tree in ("auto", "none") if r % 2 == 0 else ("none", "auto"):
                    summary, _ = load_run(prompts, concurrency, REQUESTS_PER_WORKER * concurrency, args.max_tokens,
                                          url=f"127.0.0.1:{args.grpc_port}", tree=tree)
                    if summary["errors"]:
                        raise SystemExit(f"c{concurrency} {tree} round {r}: errors {summary['first_errors']}")
                    rates[tree].append(summary["tokens_per_second"])
                print(f"c{concurrency} round {r}: default {rates['auto'][-1]:.1f} / target alone "
                      f"{rates['none'][-1]:.1f} tokens/s = {rates['auto'][-1] / rates['none'][-1]:.3f}", flush=True)
            print(f"c{concurrency}: default / target alone {sum(rates['auto']) / sum(rates['none']):.3f} over "
                  f"{args.rounds} rounds (mean {sum(rates['auto']) / args.rounds:.1f} against "
                  f"{sum(rates['none']) / args.rounds:.1f} tokens/s)", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
