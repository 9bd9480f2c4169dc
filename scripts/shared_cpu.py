"""Served throughput on a shared CPU (issue 65): quiet rounds and rounds beside busy processes, alternating.

One OpenAI-compatible server (started here with `spectrt serve --openai-port`, or any running one given by --url, such
as llama-server), rounds of --requests greedy chat completions (--max-tokens each, bench/prompts.txt) at --concurrency;
each round is quiet or has --busy pure-Python spin loops running on the box (the contention a benchmark client, a log
shipper or a neighbour makes), the two kinds alternating, each first in every other pair. Prints every round's
completion tokens/s and the busy/quiet ratio of the summed rates. Under the CPU lock, nothing else running:

    flock /tmp/spectrt.lock .venv/bin/python scripts/shared_cpu.py [--rounds 2] [--busy 1] [--concurrency 4]
        [--serve-arg=--threads=2 ...] [--taskset 0]       # spectrt serve, started and stopped here
    flock /tmp/spectrt.lock .venv/bin/python scripts/shared_cpu.py --url http://127.0.0.1:8080 --model M \
        --label "llama-server BF16"                                                        # a running server

--taskset CPUS pins the started server (every process of it) to those CPUs (with --busy 0: a quiet run on fewer
cores). The result goes to bench/results/<cpu class>/shared_cpu_<label>.json, rendered into docs/benchmarks.md by
scripts/bench_tables.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def chat(url: str, model: str, prompt: str, max_tokens: int) -> int:
    """One greedy chat completion; returns its completion tokens."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return int(json.loads(r.read())["usage"]["completion_tokens"])


def run_round(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Every prompt once, `concurrency` at a time: (completion tokens, seconds)."""
    queue, tokens, lock = list(prompts), [0], threading.Lock()

    def worker():
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            n = chat(url, model, prompt, max_tokens)
            with lock:
                tokens[0] += n

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0], time.perf_counter() - start


def start_busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, str]:
    """`spectrt serve --openai-port` (pinned with taskset if asked), returned with its OpenAI URL once ready."""
    port = args.port
    cmd = [sys.executable, "-m", "spectrt", "serve", "--openai-port", str(port), "--http-port", str(port + 1),
           "--grpc-port", str(port + 2), "--metrics-port", str(port + 3), *args.serve_arg]
    if args.taskset:
        cmd = ["taskset", "-c", args.taskset, *cmd]
    out = log.open("w")
    server = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 300
    while "ready:" not in log.read_text(errors="replace"):
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"spectrt serve did not get ready:\n{log.read_text(errors='replace')}")
        time.sleep(0.5)
    return server, f"http://127.0.0.1:{port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running OpenAI-compatible server (default: start spectrt serve here)")
    p.add_argument("--model", default="spectrt", help="the model name requests carry")
    p.add_argument("--serve-arg", action="append", default=[], help="an extra `spectrt serve` flag (repeatable)")
    p.add_argument("--taskset", help="CPU list the started server is pinned to (taskset -c)")
    p.add_argument("--port", type=int, default=9300, help="the started server's OpenAI port (+1..3: Triton's)")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2,
                   help="pairs of rounds (one quiet, one busy; with --busy 0 quiet only)")
    p.add_argument("--busy", type=int, default=1, help="busy processes in a busy round")
    p.add_argument("--label", default="spectrt serve (defaults)",
                   help="the server's name in the result (bench/results/<cpu class>/shared_cpu_<label>.json)")
    p.add_argument("--no-save", action="store_true", help="print only; write no result file")
    args = p.parse_args()
    prompts = [line.strip() for line in (ROOT / "bench/prompts.txt").read_text().splitlines() if line.strip()]
    prompts = (prompts * (args.requests // len(prompts) + 1))[:args.requests]
    server, url = (None, args.url) if args.url else start_server(args, Path("/tmp/shared_cpu_serve.log"))
    rounds = []
    try:
        run_round(url, args.model, prompts[:2], 2, 16)  # warm-up: first-use page faults, lazy builds
        for r in range(args.rounds):
            kinds = ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet")
            for kind in kinds if args.busy else ("quiet",):
                busy = start_busy(args.busy if kind == "busy" else 0)
                time.sleep(0.5 if busy else 0)  # the spinners running before the first request
                try:
                    tokens, seconds = run_round(url, args.model, prompts, args.concurrency, args.max_tokens)
                finally:
                    stop(busy)
                rounds.append({"kind": kind, "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds})
                print(f"round {r} {kind:5s}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tok/s",
                      flush=True)
    finally:
        if server is not None:
            os.killpg(server.pid, signal.SIGINT)
            server.wait(timeout=60)
    rate = {k: sum(x["tokens"] for x in rounds if x["kind"] == k) / sum(x["seconds"] for x in rounds
                                                                        if x["kind"] == k)
            for k in ("quiet", "busy") if any(x["kind"] == k for x in rounds)}
    print(f"quiet {rate['quiet']:.1f} tok/s" + (f", {args.busy} busy process(es) {rate['busy']:.1f} tok/s: kept "
                                               f"{rate['busy'] / rate['quiet']:.3f}x" if "busy" in rate else ""))
    if not args.no_save:
        save(args, rounds, rate)


def save(args: argparse.Namespace, rounds: list[dict], rate: dict[str, float]) -> None:
    """bench/results/<cpu class>/shared_cpu_<label>.json: what scripts/bench_tables.py renders in docs/benchmarks.md."""
    from spectrt.runtime.decoding.bench import results_dir
    from spectrt.runtime.engines.kernels import cpu_class, native_isa

    slug = re.sub(r"[^a-z0-9]+", "-", args.label.lower()).strip("-")
    path = results_dir(ROOT / "bench" / "results") / f"shared_cpu_{slug}.json"
    command = " ".join(["scripts/shared_cpu.py", *sys.argv[1:]])
    path.write_text(json.dumps({
        "cpu": {"class": cpu_class(), "cores": os.cpu_count(), "native_isa": native_isa()}, "label": args.label,
        "command": command, "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {k: getattr(args, k) for k in ("requests", "concurrency", "max_tokens", "rounds", "busy",
                                                   "taskset", "serve_arg")},
        "rate": rate, "rounds": rounds}, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")

if __name__ == "__main__":
    main()
