"""What the OpenAI frontend adds per streamed token: run it under the lock (`flock /tmp/spectrt.lock ...`).

    stacks   the HTTP stacks considered for the frontend, each serving the same server-sent-event stream from an
             in-process token source (one OpenAI chat chunk per token, a token every --interval ms, the pace of a
             decode step). The token's creation time (CLOCK_MONOTONIC, shared by processes) rides in the chunk;
             a client in another process records when it arrives. Per stack: latency from token to client
             (p50/p90/p99), server CPU per event, and a burst (--interval 0) for events/s.
    served   the real deployment: one `spectrt serve --openai-port` (started here), the same greedy requests over
             Triton's gRPC stream and over the frontend's SSE stream, alternating prompt by prompt; added latency
             per token = (frontend end-to-end - gRPC end-to-end) / tokens, and the same for the first token.

    .venv/bin/python scripts/openai_overhead.py stacks [--events 300] [--interval 10] [--out bench/results/openai]
    .venv/bin/python scripts/openai_overhead.py served [--requests 16] [--max-tokens 64] [--out ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from spectrt.runtime.serving.client import DEFAULT_PROMPTS

STACKS = ("asyncio-streams", "aiohttp", "starlette-uvicorn-h11", "starlette-uvicorn-httptools-uvloop")
EVENT = re.compile(rb"data: (\{[^\n]*\})\n\n")


def chunk(i: int) -> bytes:
    """One chat.completion.chunk as the frontend writes it, stamped with its creation time (ns)."""
    body = {"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1767225600,
            "model": "spectrt", "choices": [{"index": 0, "delta": {"content": " token"}, "logprobs": None,
                                             "finish_reason": None}], "t": time.monotonic_ns(), "i": i}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def tokens(n: int, interval: float):
    for i in range(n):
        await asyncio.sleep(interval)
        yield chunk(i)
    yield b"data: [DONE]\n\n"


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --------------------------------------------------------------------------- candidate servers (one per process)


def serve_asyncio(port: int) -> None:
    """Plain asyncio streams: a minimal HTTP/1.1 responder (request head, chunked SSE body)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:  # the readiness probe connects and closes
            writer.close()
            return
        n, interval = _query(head.split(b" ", 2)[1].decode())
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        async for data in tokens(n, interval):
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def serve_aiohttp(port: int) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        n, interval = int(request.query["n"]), float(request.query["interval"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        async for data in tokens(n, interval):
            await resp.write(data)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/stream", stream)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, handle_signals=True)


def serve_starlette(port: int, fast: bool) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def stream(request):
        n, interval = int(request.query_params["n"]), float(request.query_params["interval"])
        return StreamingResponse(tokens(n, interval), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    app = Starlette(routes=[Route("/stream", stream)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                http="httptools" if fast else "h11", loop="uvloop" if fast else "asyncio")


def _query(path: str) -> tuple[int, float]:
    params = dict(p.split("=") for p in path.split("?", 1)[1].split("&"))
    return int(params["n"]), float(params["interval"])


def serve(stack: str, port: int) -> None:
    # report this process's CPU time when told to stop (SIGUSR1 -> stdout), so the parent divides it by events
    signal.signal(signal.SIGUSR1, lambda *_: print(f"cpu {_cpu():.6f}", flush=True))
    if stack == "asyncio-streams":
        serve_asyncio(port)
    elif stack == "aiohttp":
        serve_aiohttp(port)
    else:
        serve_starlette(port, fast=stack.endswith("uvloop"))


# --------------------------------------------------------------------------- client


def read_stream(port: int, n: int, interval: float, timeout: float = 120.0) -> list[float]:
    """GET one stream with a raw socket; per event: microseconds from its creation to its arrival here."""
    latencies: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(f"GET /stream?n={n}&interval={interval} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  "Accept: text/event-stream\r\n\r\n".encode())
        buf = b""
        while len(latencies) < n:
            data = s.recv(65536)
            now = time.monotonic_ns()
            if not data:
                raise ConnectionError(f"the stream ended after {len(latencies)} of {n} events")
            buf += data
            end = 0
            for m in EVENT.finditer(buf):
                latencies.append((now - json.loads(m.group(1))["t"]) / 1000)
                end = m.end()
            buf = buf[end:]
    return latencies


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens on {port} after {timeout:g}s")


def _server_cpu(proc: subprocess.Popen) -> float:
    proc.send_signal(signal.SIGUSR1)
    line = proc.stdout.readline().strip()
    return float(line.split()[1])


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_stack(stack: str, events: int, interval_ms: float, burst: int) -> dict:
    from spectrt.runtime.serving.serve import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "_serve", stack, str(port)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _wait_port(port, proc)
        read_stream(port, 20, 0.001)  # warm-up: imports, first-request paths
        cpu0 = _server_cpu(proc)
        paced = read_stream(port, events, interval_ms / 1000)
        cpu1 = _server_cpu(proc)
        start = time.perf_counter()
        read_stream(port, burst, 0.0)
        wall = time.perf_counter() - start
        cpu2 = _server_cpu(proc)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"stack": stack, "events": events, "interval_ms": interval_ms,
            "latency_us": {"p50": round(_pct(paced, 0.5), 1), "p90": round(_pct(paced, 0.9), 1),
                           "p99": round(_pct(paced, 0.99), 1), "mean": round(statistics.mean(paced), 1)},
            "server_cpu_us_per_event": round(1e6 * (cpu1 - cpu0) / events, 1),
            "burst_events_per_s": round(burst / wall), "burst_server_cpu_us_per_event":
                round(1e6 * (cpu2 - cpu1) / burst, 1)}


def cmd_stacks(args: argparse.Namespace) -> dict:
    rows = [bench_stack(s, args.events, args.interval, args.burst) for s in STACKS for _ in range(1)]
    lines = [f"Token -> client latency through each HTTP stack: {args.events} SSE events, one every "
             f"{args.interval:g} ms; burst: {args.burst} events back to back (server CPU per event, events/s).", "",
             "| stack | p50 µs | p90 µs | p99 µs | server CPU µs/event | burst events/s | burst CPU µs/event |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lat = r["latency_us"]
        lines.append(f"| {r['stack']} | {lat['p50']} | {lat['p90']} | {lat['p99']} | {r['server_cpu_us_per_event']} "
                     f"| {r['burst_events_per_s']} | {r['burst_server_cpu_us_per_event']} |")
    return {"stacks": rows, "table": "\n".join(lines)}


# --------------------------------------------------------------------------- the real deployment


def cmd_served(args: argparse.Namespace) -> dict:
    """Greedy chat requests over Triton's gRPC stream and over the frontend's SSE stream, interleaved."""
    import http.client

    from spectrt.cli.serving import add_serve_args, model_params_of
    from spectrt.runtime.serving.client import GrpcSession
    from spectrt.runtime.serving.serve import TritonServer

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    serve_args = parser.parse_args(args.serve_args)
    prompts = [p.strip() for p in Path(args.prompts).read_text(encoding="utf-8").splitlines() if p.strip()]
    with TritonServer(model_params_of(serve_args), instances=1, openai_port=0, ready_timeout=600,
                      served_name=serve_args.model_name) as server:
        host, port = server.openai_host, server.openai_port

        def frontend(prompt: str) -> tuple[float, float, int]:
            body = json.dumps({"model": server.served_name, "messages": [{"role": "user", "content": prompt}],
                               "max_tokens": args.max_tokens, "stream": True,
                               "stream_options": {"include_usage": True}})
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            start = time.perf_counter()
            conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
            response, first, tokens = conn.getresponse(), None, 0
            for raw in response:
                line = raw.strip()
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    if event["choices"] and event["choices"][0]["delta"].get("content") and first is None:
                        first = time.perf_counter() - start
                    if event.get("usage"):
                        tokens = event["usage"]["completion_tokens"]
            conn.close()
            return first, time.perf_counter() - start, tokens

        with GrpcSession(server.grpc_url, server.served_name) as session:
            for prompt in prompts[:2]:  # warm-up both paths
                session.generate(prompt, 8, True)
                frontend(prompt)
            rows = []
            for k in range(args.requests):
                prompt = prompts[k % len(prompts)]
                order = ("grpc", "openai") if k % 2 == 0 else ("openai", "grpc")
                row = {"prompt": k % len(prompts)}
                for how in order:
                    if how == "grpc":
                        r = session.generate(prompt, args.max_tokens, True)
                        row["grpc"] = (r.ttft, r.latency, r.tokens)
                    else:
                        row["openai"] = frontend(prompt)
                rows.append(row)
    same = all(r["grpc"][2] == r["openai"][2] for r in rows)
    tokens = sum(r["grpc"][2] for r in rows)
    grpc_s, openai_s = sum(r["grpc"][1] for r in rows), sum(r["openai"][1] for r in rows)
    ttft = statistics.mean(r["openai"][0] - r["grpc"][0] for r in rows)
    per_token = 1e3 * (openai_s - grpc_s) / tokens
    table = (f"{args.requests} greedy chat requests of {args.max_tokens} tokens, interleaved: gRPC stream "
             f"{grpc_s:.2f} s, OpenAI SSE {openai_s:.2f} s for {tokens} tokens each (same token counts: {same}); "
             f"added per token {per_token:+.3f} ms, added to the first token {1e3 * ttft:+.2f} ms")
    return {"requests": args.requests, "max_tokens": args.max_tokens, "tokens": tokens, "same_tokens": same,
            "grpc_seconds": round(grpc_s, 3), "openai_seconds": round(openai_s, 3),
            "added_ms_per_token": round(per_token, 3), "added_ttft_ms": round(1e3 * ttft, 2), "table": table}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_serve":
        serve(argv[1], int(argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stacks")
    s.add_argument("--events", type=int, default=300)
    s.add_argument("--interval", type=float, default=10.0, help="ms between tokens (a decode step)")
    s.add_argument("--burst", type=int, default=5000)
    s = sub.add_parser("served")
    s.add_argument("--requests", type=int, default=16)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    s.add_argument("serve_args", nargs="*", help="flags of `spectrt serve` after --, e.g. -- --draft none")
    for s in sub.choices.values():
        s.add_argument("--out", type=Path, default=Path("bench/results/openai"))
    args = p.parse_args(argv)
    report = cmd_stacks(args) if args.cmd == "stacks" else cmd_served(args)
    report["machine"] = {"cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join(argv)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.cmd}.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (args.out / f"{args.cmd}.md").write_text(report["table"] + "\n", encoding="utf-8")
    print(report["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
