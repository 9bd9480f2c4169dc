"""Streaming overhead at concurrency 1: a served gRPC stream against the same configuration in process.

Start a server first (`spectrt serve --tree T --draft D --threads N`), then, under the CPU lock:

    flock /tmp/spectrt.lock .venv/bin/python scripts/served_vs_inprocess.py [--requests 8] [--max-tokens 96]
        [--tree T] [--draft D] [--threads N] [--json]

Prints served tokens/s over in-process tokens/s (issue 31's bar: >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from pathlib import Path

from spectrt.runtime.serving.client import DEFAULT_MODEL, DEFAULT_PROMPTS, GrpcSession, Result


def _step_metrics(url: str) -> dict[str, float]:
    """The server's step counters (Prometheus text, summed over labels): steps, step and target forward seconds."""
    names = ("spectrt_batch_steps_total", "spectrt_step_seconds_total", "spectrt_target_forward_seconds_total")
    values = dict.fromkeys(names, 0.0)
    for line in urllib.request.urlopen(url, timeout=30).read().decode().splitlines():
        name, value = line.partition("{")[0].partition(" ")[0], line.rsplit(" ", 1)[-1]
        if name in values:
            values[name] += float(value)
    return values


def compare_inprocess(prompts: list[str], max_tokens: int, url: str = "127.0.0.1:8001", model: str = DEFAULT_MODEL,
                      target: str | None = None, draft: str | None = None, tree: str | None = None,
                      max_seq_len: int = 2048, threads: int = 0, timeout: float = 600.0,
                      metrics_url: str = "http://127.0.0.1:8002/metrics", **options) -> dict:
    """Streaming overhead at concurrency 1: each prompt served (gRPC stream), then `Pipeline.generate` in-process.

    The two alternate prompt by prompt so that a change in machine load hits both alike. Give the in-process
    side the served instance's model, max_seq_len and thread count; `tree` is sent with each served request too (it
    was not: `--tree none` compared the server's own tree with in-process AR). The ratio is served tokens/s over
    in-process tokens/s (both: output tokens / time from request to the last token; in-process streams its
    text through the same callback).
    """
    import torch
    from spectrt.runtime.decoding.decoder import StepClock
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.sampling import SamplingParams
    from spectrt.runtime.decoding.tree import DEFAULT_TREE
    from spectrt.runtime.engines.checkpoint import resolve_models

    if threads > 0:
        torch.set_num_threads(threads)
    target_dir, draft_dir = resolve_models(target, draft)
    pipe = Pipeline(target_dir, draft_dir, max_seq_len=max_seq_len)
    params = SamplingParams(options.get("temperature") or 0.0, options.get("top_k") or 0, options.get("top_p") or 1.0,
                            options.get("seed"))
    spec = None if (tree or "").lower() == "none" else (tree or DEFAULT_TREE)
    pipe.generate("Hi", 4, spec)  # warm up (kernel choice), as the served model does at load
    served: list[Result] = []
    local = {"tokens": 0, "seconds": 0.0, "ttft": []}
    if tree:
        options = {**options, "tree": tree}
    with GrpcSession(url, model) as session:
        session.generate("Hi", 4, True, timeout=timeout, **options)
        before, pipe.decoder.clock = _step_metrics(metrics_url), StepClock()
        for prompt in prompts:
            served.append(session.generate(prompt, max_tokens, True, timeout=timeout, **options))
            first: list[float] = []
            start = time.perf_counter()
            gen = pipe.generate(prompt, max_tokens, spec, params=params,
                                on_text=lambda _d, f=first, s=start: f or f.append(time.perf_counter() - s))
            local["seconds"] += time.perf_counter() - start
            local["tokens"] += gen.stats.new_tokens
            local["ttft"].extend(first)
    after, clock = _step_metrics(metrics_url), pipe.decoder.clock
    steps = after["spectrt_batch_steps_total"] - before["spectrt_batch_steps_total"]
    served_steps = {k: round(1000 * (after[f"spectrt_{k}_seconds_total"] - before[f"spectrt_{k}_seconds_total"])
                             / max(steps, 1), 3) for k in ("step", "target_forward")}
    local_steps = {"step": round(1000 * clock.total / max(clock.steps, 1), 3),
                   "target_forward": round(1000 * clock.target / max(clock.steps, 1), 3)}
    served_tokens = sum(r.tokens for r in served)
    served_seconds = sum(r.latency for r in served)
    served_tps = served_tokens / served_seconds if served_seconds else 0.0
    server_side = sum(r.perf.get("generation_seconds", 0.0) for r in served)
    local_tps = local["tokens"] / local["seconds"] if local["seconds"] else 0.0
    return {
        "requests": len(prompts),
        "served": {"output_tokens": served_tokens, "seconds": round(served_seconds, 3),
                   "tokens_per_second": round(served_tps, 2), "server_generation_seconds": round(server_side, 3),
                   "transport_seconds": round(served_seconds - server_side, 3),
                   "ttft_ms_mean": round(1000 * statistics.mean(r.ttft for r in served if r.ttft is not None), 1),
                   "steps": int(steps), "ms_per_step": served_steps},
        "inprocess": {"output_tokens": local["tokens"], "seconds": round(local["seconds"], 3),
                      "tokens_per_second": round(local_tps, 2),
                      "ttft_ms_mean": round(1000 * statistics.mean(local["ttft"]), 1) if local["ttft"] else 0.0,
                      "steps": clock.steps, "ms_per_step": local_steps},
        "same_tokens": served_tokens == local["tokens"],
        "served_over_inprocess": round(served_tps / local_tps, 3) if local_tps else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS, help="one prompt per line")
    p.add_argument("--requests", type=int, default=4, help="the first N prompts")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--url", default="127.0.0.1:8001", help="the server's gRPC endpoint")
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    p.add_argument("--target", default=None, help="the served target")
    p.add_argument("--draft", default=None, help="the served draft ('none' for none)")
    p.add_argument("--tree", default=None, help="the server's --tree ('none': the target alone; default: auto)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="the served max_seq_len")
    p.add_argument("--threads", type=int, default=0, help="torch threads in process (the served instance's)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--metrics-url", default="http://127.0.0.1:8002/metrics", help="the server's Prometheus endpoint")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    prompts = [line.strip() for line in args.prompts.read_text(encoding="utf-8").splitlines() if line.strip()]
    report = compare_inprocess(prompts[:args.requests], args.max_tokens, args.url, args.model, args.target,
                               args.draft, args.tree, args.max_seq_len, args.threads, args.timeout, args.metrics_url)
    if args.json:
        print(json.dumps(report))
        return 0
    sv, ip = report["served"], report["inprocess"]
    print(f"{report['requests']} prompts at concurrency 1 | served (gRPC stream) {sv['tokens_per_second']:.1f} tok/s, "
          f"TTFT {sv['ttft_ms_mean']:.0f} ms | in-process {ip['tokens_per_second']:.1f} tok/s, TTFT "
          f"{ip['ttft_ms_mean']:.0f} ms | served/in-process {report['served_over_inprocess']:.3f} | same token "
          f"counts {report['same_tokens']}\nms per step (step, target forward): served {sv['ms_per_step']}, in process "
          f"{ip['ms_per_step']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
