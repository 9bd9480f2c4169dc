"""`spectrt serve | client`: the real tritonserver with the spectrt model (and the OpenAI API), and its client."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
import urllib.error
from dataclasses import asdict
from pathlib import Path

from spectrt.cli.common import add_dtype_arg
from spectrt.runtime.serving.client import (
    DEFAULT_MODEL,
    DEFAULT_PROMPTS,
    RequestFailed,
    Result,
    grpc_generate,
    http_generate,
    load_run,
)
from spectrt.runtime.serving.serve import (
    ADMIN_HEADER,
    GRPC_ADMIN_HEADER,
    RESTRICTED_APIS,
    STREAM_INTERVAL,
    ServeError,
    TritonServer,
    host_warning,
    model_params,
)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of `spectrt serve`."""
    p.add_argument("--target", help="HF checkpoint dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="draft checkpoint dir, or 'none' for the target alone "
                                   "(default: the target's distilled draft in --artifacts)")
    p.add_argument("--engines", type=Path, default=None,
                   help="engines/<name> dir from `spectrt engines` (replaces --target/--draft; see --backend)")
    p.add_argument("--artifacts", type=Path, default=None, help="where converted models live (default: artifacts)")
    add_dtype_arg(p)
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"],
                   help="onnxruntime/tensorrt run the graphs/plans of --engines; torch runs checkpoints")
    p.add_argument("--tree", default=None, help="default tree of the served model, e.g. 2,1 (requests may override)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context per KV slot (prompt + output)")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask for")
    p.add_argument("--stream-interval", type=int, default=STREAM_INTERVAL,
                   help="a stream's responses after its first carry at least this many tokens (1: every token; "
                        "fewer sends take less CPU from the forward on a small machine; the first text is never "
                        "held)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="prefill every prompt in full (default: reuse the KV of cached prompt prefixes, exact)")
    p.add_argument("--instances", type=int, default=1,
                   help="model instances, each a full model copy batching up to max_active requests (config.pbtxt)")
    p.add_argument("--threads", type=int, default=0,
                   help="threads per instance (0: the CPUs this process may use, its affinity mask and cgroup CPU "
                        "quota, split between the instances)")
    p.add_argument("--model-name", default=DEFAULT_MODEL, help="name the model is served under")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (with --api-key and --openai-port: the OpenAI endpoint's, and Triton's "
                        "unauthenticated ports stay on 127.0.0.1 unless --triton-host says otherwise)")
    p.add_argument("--triton-host", default=None,
                   help="address of Triton's HTTP/gRPC/metrics ports (default: --host; 127.0.0.1 when an API key "
                        "guards the OpenAI endpoint)")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--openai-port", type=int, default=None,
                   help="also serve the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models) on this port "
                        "(0: a free one), a frontend over Triton's gRPC stream run with the server")
    p.add_argument("--openai-host", default=None, help="address of the OpenAI endpoint (default: --host)")
    p.add_argument("--openai-timeout", type=float, default=600.0,
                   help="deadline of one OpenAI request, seconds (then 504 and the request is cancelled)")
    p.add_argument("--api-key", default=os.environ.get("SPECTRT_API_KEY"),
                   help="the OpenAI endpoint requires `Authorization: Bearer KEY` on every route but /health "
                        "(default: $SPECTRT_API_KEY, which keeps it out of the process list)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated web origins (e.g. http://localhost:3000, or *) whose pages may call the "
                        "OpenAI endpoint from a browser (CORS); default none")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="tritonserver restarts after a python stub died (segfault, OOM kill) allowed in 10 minutes; "
                        "past them the deployment stops (0: stop at the first)")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="keep the deployed repository and server.log in a new spectrt-triton-* subdirectory of this "
                        "directory (nothing else in it is touched; default: a temporary directory, removed at stop)")
    p.add_argument("--admin-key", default=os.environ.get("SPECTRT_ADMIN_KEY"),
                   help=f"value of the '{ADMIN_HEADER}' header/metadata that Triton's {', '.join(RESTRICTED_APIS)} "
                        "APIs require (default: $SPECTRT_ADMIN_KEY, else random, in <run dir>/admin-key)")
    p.add_argument("--log", action="store_true", help="server log to the terminal instead of <run dir>/server.log")
    p.add_argument("--log-verbose", type=int, default=0, help="Triton verbose level (1: one line per request)")


def model_params_of(args: argparse.Namespace) -> dict[str, object]:
    return model_params(backend=args.backend, dtype=args.dtype, max_seq_len=args.max_seq_len,
                        max_tokens_limit=args.max_tokens_limit, threads=args.threads, prefix_cache=args.prefix_cache,
                        stream_interval=args.stream_interval, tree=args.tree, engines=args.engines,
                        target=args.target, draft=args.draft, artifacts=args.artifacts)


def bind_hosts(args: argparse.Namespace) -> tuple[str, str]:
    """(Triton's address, the OpenAI endpoint's). Triton's inference ports take no key, so where an API key guards
    the OpenAI endpoint they stay on loopback unless --triton-host names another address: `--host 0.0.0.0 --api-key
    K` used to publish them next to the guarded endpoint."""
    openai_host = args.openai_host or args.host
    guarded = bool(args.api_key) and args.openai_port is not None
    return args.triton_host or ("127.0.0.1" if guarded else args.host), openai_host


def cmd_serve(args: argparse.Namespace) -> int:
    """`spectrt serve`: start the real tritonserver, wait for readiness, print the endpoints, stop on Ctrl-C.

    SIGINT, SIGTERM and SIGHUP (a closed terminal) stop it; signals during the stop are ignored, so the cleanup
    always finishes, and if this process is killed outright its supervisor stops the server and cleans up.
    """
    triton_host, openai_host = bind_hosts(args)
    try:
        server = TritonServer(model_params_of(args), instances=args.instances, served_name=args.model_name,
                              host=triton_host, http_port=args.http_port, grpc_port=args.grpc_port,
                              metrics_port=args.metrics_port, ready_timeout=args.ready_timeout, run_dir=args.run_dir,
                              console=args.log, log_verbose=args.log_verbose, admin_key=args.admin_key,
                              openai_port=args.openai_port, openai_host=openai_host,
                              openai_timeout=args.openai_timeout, api_key=args.api_key,
                              allowed_origins=args.allowed_origins, max_restarts=args.max_restarts)
    except ServeError as e:
        print(f"spectrt serve: error: {e}", file=sys.stderr)
        return 2
    from spectrt.runtime.engines.engine import fallback_notice

    if notice := fallback_notice(args.backend):  # the instances load in this environment (SPECTRT_NATIVE included)
        print(notice, file=sys.stderr)
    hosts = {triton_host} | ({server.openai_host} if args.openai_port is not None else set())
    for host in sorted(hosts):
        if warning := host_warning(host):
            print(f"spectrt serve: warning: {warning}", file=sys.stderr)

    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGINT too: a background job of a non-interactive
    # shell starts with SIGINT ignored

    def _stopping(*_):
        _say("spectrt serve: already stopping (the cleanup finishes first)")

    def _terminate(*_):
        for sig in signals:  # from the first signal on, later ones cannot interrupt the stop
            signal.signal(sig, _stopping)
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _terminate) for sig in signals}
    try:
        from spectrt.runtime.engines.cpus import default_threads, usable_cpus

        threads = (f"{args.threads} thread(s) each (--threads)" if args.threads > 0 else
                   f"{default_threads(args.instances)} thread(s) each of {usable_cpus()} usable CPU(s)")
        _say(f"starting tritonserver (model {args.model_name}, {args.instances} instance(s), {threads}) ...",
             sys.stdout)
        try:
            server.start()
        except (ServeError, TimeoutError) as e:
            _say(f"spectrt serve: error: {e}")
            return 2
        ends = server.endpoints()
        _say(json.dumps({**ends, "pid": server.pid, "supervisor_pid": server.supervisor.pid,
                         **({"openai_pid": server.openai_pid} if server.openai_pid else {}),
                         "run_dir": str(server.run_dir), "shm_prefix": server.shm_prefix,
                         "admin_header": {"http": ADMIN_HEADER, "grpc": GRPC_ADMIN_HEADER},
                         "admin_key_file": str(server.run_dir / "admin-key")},
                        indent=2), sys.stdout)
        openai = f" | OpenAI {ends['openai']}" if "openai" in ends else ""
        _say(f"ready: gRPC {ends['grpc']} | HTTP {ends['http']} | metrics {ends['metrics']}{openai}  (Ctrl-C stops)",
             sys.stdout)
        while server.poll() is None:
            time.sleep(0.5)
        _say(f"tritonserver exited with code {server.poll()}\n{server.log_tail()}")
        return 1
    except KeyboardInterrupt:
        _say("\nstopping tritonserver ...")
        return 0
    finally:
        for sig in signals:
            signal.signal(sig, _stopping)
        code = server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if code is not None:
            _say(f"tritonserver stopped (exit code {code})")


def _say(message: str, stream=None) -> None:
    """Print, unless the terminal is gone (SIGHUP): stopping must not fail on a closed stdout/stderr."""
    with contextlib.suppress(OSError, ValueError):
        print(message, file=stream or sys.stderr, flush=True)


def add_client_args(p: argparse.ArgumentParser) -> None:
    """Flags of `spectrt client`."""
    p.add_argument("--prompt", default="Write a Python function that returns the squares of a list of numbers.")
    p.add_argument("--prompts", type=Path, default=None,
                   help="one prompt per line for --concurrency runs (default: bench/prompts.txt)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--no-stream", action="store_true", help="one response with the whole text")
    p.add_argument("--http", action="store_true", help="HTTP generate endpoint (generate_stream when streaming)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--model", default=DEFAULT_MODEL, help="served model name")
    p.add_argument("--concurrency", type=int, default=0, help="load run with N concurrent streams")
    p.add_argument("--requests", type=int, default=None, help="requests in a load run (default 2 x concurrency)")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--tree", default=None, help="per-request tree, e.g. 2,1 ('none' = target alone)")
    p.add_argument("--children", default=None, choices=["sample", "topk"])
    p.add_argument("--timeout", type=float, default=600.0,
                   help="deadline of one request, seconds (the whole request, however slowly its stream arrives)")
    p.add_argument("--run-timeout", type=float, default=3600.0,
                   help="deadline of a --concurrency load run, seconds (requests not started by then are errors)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _options(args: argparse.Namespace) -> dict:
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
            "tree": args.tree, "children": args.children}


def _stats_line(r: Result, how: str) -> str:
    p = r.perf
    ttft = f"{1000 * r.ttft:.0f} ms" if r.ttft is not None else "-"
    tau = r.tokens / p["target_passes"] if p.get("target_passes") else 0.0
    return (f"[{how}] {r.tokens} tokens in {r.latency:.2f}s = {r.tokens_per_second:.1f} tok/s | TTFT {ttft} | "
            f"tau {tau:.2f} | acceptance {p.get('acceptance_rate', 0.0):.2f} "
            f"({p.get('total_accepted_draft_tokens', 0)}/{p.get('total_draft_tokens', 0)} draft tokens) | "
            f"target passes {p.get('target_passes', 0)} | final {r.final}")


def cmd_client(args: argparse.Namespace) -> int:
    """`spectrt client`: one request (streamed by default) or a --concurrency load run against a served model."""
    stream = not args.no_stream
    url = f"http://{args.host}:{args.http_port}" if args.http else f"{args.host}:{args.grpc_port}"
    options = _options(args)
    try:
        if args.concurrency:
            path = args.prompts or DEFAULT_PROMPTS
            prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
            summary, _ = load_run(prompts, args.concurrency, args.requests, args.max_tokens, stream, args.http, url,
                                  args.model, args.timeout, args.run_timeout, **options)
            summary["protocol"] = ("http " if args.http else "grpc ") + ("stream" if stream else "unary")
            if args.json:
                print(json.dumps(summary))
            else:
                t, lat = summary["ttft_ms"], summary["latency_ms"]
                print(f"{summary['protocol']} | concurrency {args.concurrency} | {summary['requests']} requests, "
                      f"{summary['errors']} errors in {summary['wall_seconds']:.1f}s\n"
                      f"throughput {summary['tokens_per_second']:.1f} tok/s ({summary['output_tokens']} tokens), "
                      f"{summary['per_request_tokens_per_second']:.1f} tok/s per request\n"
                      f"TTFT mean {t['mean']:.0f} ms, p50 {t['p50']:.0f}, p95 {t['p95']:.0f} | "
                      f"latency mean {lat['mean']:.0f} ms, p50 {lat['p50']:.0f}, p95 {lat['p95']:.0f} | "
                      f"tau {summary['tau']:.2f}, acceptance {summary['acceptance_rate']:.2f}")
                for e in summary["first_errors"]:
                    print(f"error: {e}", file=sys.stderr)
            return 1 if summary["errors"] else 0
        on_text = None if args.json else (lambda s: print(s, end="", flush=True))
        if args.http:
            r = http_generate(url, args.prompt, args.max_tokens, stream, args.model, on_text, args.timeout, **options)
        else:
            r = grpc_generate(url, args.prompt, args.max_tokens, stream, args.model, on_text, args.timeout, **options)
        if args.json:
            print(json.dumps({k: v for k, v in asdict(r).items() if k != "chunks"} | {"chunks": len(r.chunks)}))
        else:
            how = ("HTTP " if args.http else "gRPC ") + ("stream" if stream else "no-stream")
            print(f"\n\n{_stats_line(r, how)}", file=sys.stderr)
        return 0
    except RequestFailed as e:
        print(f"spectrt client: the server refused the request: {e}", file=sys.stderr)
        return 1
    except TimeoutError as e:  # a deadline (the request's or the run's), not an unreachable server
        print(f"spectrt client: {e}", file=sys.stderr)
        return 2
    except (ConnectionError, urllib.error.URLError, OSError) as e:
        print(f"spectrt client: cannot reach the server at {url}: {e} (is `spectrt serve` running?)", file=sys.stderr)
        return 2
    except Exception as e:  # tritonclient raises InferenceServerException for an unreachable server
        if type(e).__name__ == "InferenceServerException":
            print(f"spectrt client: {url}: {e} (is `spectrt serve` running?)", file=sys.stderr)
            return 2
        raise




def add_parsers(sub) -> None:
    s = sub.add_parser("serve", help="the real tritonserver (nvidia-pytriton) serving triton_repo/ on 127.0.0.1 "
                                      "(--openai-port P: and the OpenAI API)")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    c = sub.add_parser("client", help="tritonclient gRPC streaming, --http generate, --concurrency load run")
    add_client_args(c)
    c.set_defaults(func=cmd_client)
