"""Clients of the served spectrt model: tritonclient gRPC streaming, HTTP generate, and a concurrency load run.

- `grpc_generate`: one request over a gRPC bidirectional stream (`start_stream` + `async_stream_infer`).
  With `stream=True` every accepted chunk arrives as its own response; with `stream=False` the model
  sends one response holding the whole text (a decoupled model is always called over the stream API).
- `http_generate`: Triton's generate extension, `/v2/models/<m>/generate` (one JSON object) or, streaming,
  `/v2/models/<m>/generate_stream` (server-sent events).
- `load_run`: N concurrent workers (one connection each) share a list of requests; the summary has
  throughput (output tokens/s over the wall time), time to first token and latency percentiles.

Every wait has a timeout, so a stuck server turns into an error here, never a hang.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import queue
import socket
import statistics
import threading
import time
import urllib.error
import urllib.parse
from dataclasses import dataclass, field

from spectrt.runtime.resources import package_path

DEFAULT_MODEL = "spectrt"
HEALTH_PARAMETER = "spectrt_health"  # a request parameter: the model answers it as a health probe, never decoded
PERF_OUTPUTS = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens", "target_passes",
                "output_tokens", "generation_seconds")
DEFAULT_PROMPTS = package_path("bench/prompts.txt")


class RequestFailed(RuntimeError):
    """The server answered the request with an error (the message is Triton's)."""


@dataclass
class Result:
    text: str
    chunks: list[str] = field(default_factory=list)
    ttft: float | None = None  # seconds from sending to the first non-empty text chunk
    latency: float = 0.0  # seconds from sending to the final response
    final: bool = False  # the last response carried Triton's final flag
    perf: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.perf.get("output_tokens", 0))

    def add_text(self, delta: str, start: float, on_text) -> None:
        """One streamed text chunk: the first non-empty one sets the time to first token."""
        if delta:
            if self.ttft is None:
                self.ttft = time.perf_counter() - start
            self.chunks.append(delta)
            if on_text is not None:
                on_text(delta)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.latency if self.latency else 0.0


def request_fields(prompt: str, max_tokens: int, stream: bool, temperature: float | None = None,
                   top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                   tree: str | None = None, children: str | None = None, end_id: int | None = None,
                   perf: bool = True, chat: bool | None = None, structured_output: str | None = None) -> dict:
    """The request as {input name: value}; None values are left out (the model's defaults apply)."""
    fields = {"text_input": prompt, "max_tokens": max_tokens, "stream": stream, "temperature": temperature,
              "top_k": top_k, "top_p": top_p, "seed": seed, "tree": tree, "children": children, "end_id": end_id,
              "return_perf_metrics": perf, "apply_chat_template": chat, "structured_output": structured_output}
    return {k: v for k, v in fields.items() if v is not None}


_GRPC_TYPES = {"text_input": "BYTES", "tree": "BYTES", "children": "BYTES", "max_tokens": "INT32", "top_k": "INT32",
               "end_id": "INT32", "min_length": "INT32", "temperature": "FP32", "top_p": "FP32", "seed": "UINT64",
               "timeout_seconds": "FP32", "stream": "BOOL", "return_perf_metrics": "BOOL",
               "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL", "exclude_input_in_output": "BOOL",
               "apply_chat_template": "BOOL", "presence_penalty": "FP32", "frequency_penalty": "FP32",
               "repetition_penalty": "FP32", "logprobs": "INT32", "prompt_logprobs": "BOOL"}


def grpc_inputs(fields: dict | list[dict], types: dict[str, str] | None = None) -> list:
    """tritonclient InferInputs of shape [1, 1] (batch of one; a list value, e.g. stop_words, is [1, n]), or one row per
    dict of a list of them (the same names in each: the OpenAI frontend's `n` choices), the dtypes the model declares
    unless `types` says."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import triton_to_np_dtype

    rows = fields if isinstance(fields, list) else [fields]
    inputs = []
    for name in rows[0]:
        dtype = (types or {}).get(name) or _GRPC_TYPES.get(name, "BYTES")
        values = [list(row[name]) if isinstance(row[name], list | tuple) else [row[name]] for row in rows]
        if dtype == "BYTES":
            data = np.array([[v if isinstance(v, bytes) else str(v).encode("utf-8") for v in row] for row in values],
                            dtype=np.object_)
        else:
            data = np.array(values, dtype=triton_to_np_dtype(dtype))
        tensor = grpcclient.InferInput(name, list(data.shape), dtype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def _perf_from(result) -> dict:
    perf = {}
    for name in PERF_OUTPUTS:
        value = result.as_numpy(name)
        if value is not None and value.size:
            perf[name] = value.reshape(-1)[0].item()
    return perf


class GrpcSession:
    """One gRPC connection; requests go over a fresh bidirectional stream each (one at a time per session)."""

    def __init__(self, url: str = "127.0.0.1:8001", model: str = DEFAULT_MODEL):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self._count = 0

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> GrpcSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def infer(self, inputs: list, on_text=None, timeout: float = 600.0) -> Result:
        """Send one request; return when its final response arrives (RequestFailed / TimeoutError otherwise)."""
        responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        self._count += 1
        start = time.perf_counter()
        out = Result(text="")
        try:
            try:
                self.client.async_stream_infer(self.model, inputs, request_id=str(self._count),
                                               enable_empty_final_response=True)
            except Exception as e:  # the stream broke before the request went out: report the stream's own error
                with contextlib.suppress(queue.Empty):
                    _, error = responses.get(timeout=2)
                    if error is not None:
                        raise ConnectionError(error.message() if hasattr(error, "message") else str(error)) from e
                raise
            deadline = start + timeout
            while True:
                try:
                    result, error = responses.get(timeout=max(deadline - time.perf_counter(), 0.001))
                except queue.Empty:
                    raise TimeoutError(f"the request's deadline passed: no final response within {timeout:g}s "
                                       f"({len(out.chunks)} chunks arrived; raise --timeout for longer generations)"
                                       ) from None
                if error is not None:
                    raise RequestFailed(error.message() if hasattr(error, "message") else str(error))
                text = result.as_numpy("text_output")
                if text is not None and text.size:
                    out.add_text(b"".join(text.reshape(-1).tolist()).decode("utf-8"), start, on_text)
                out.perf.update(_perf_from(result))
                params = result.get_response().parameters
                if "triton_final_response" in params and params["triton_final_response"].bool_param:
                    out.final = True
                    break
        finally:
            self.client.stop_stream(cancel_requests=not out.final)
        out.latency = time.perf_counter() - start
        out.text = "".join(out.chunks)
        return out

    def generate(self, prompt: str, max_tokens: int = 128, stream: bool = True, on_text=None, timeout: float = 600.0,
                 **options) -> Result:
        return self.infer(grpc_inputs(request_fields(prompt, max_tokens, stream, **options)), on_text, timeout)


def grpc_generate(url: str, prompt: str, max_tokens: int = 128, stream: bool = True, model: str = DEFAULT_MODEL,
                  on_text=None, timeout: float = 600.0, **options) -> Result:
    with GrpcSession(url, model) as session:
        return session.generate(prompt, max_tokens, stream, on_text, timeout, **options)


def http_generate(url: str, prompt: str, max_tokens: int = 128, stream: bool = False, model: str = DEFAULT_MODEL,
                  on_text=None, timeout: float = 600.0, body: dict | None = None, **options) -> Result:
    """POST to /generate (stream=False) or /generate_stream (server-sent events); `body` replaces the JSON.

    `timeout` is one deadline for the whole request: a socket timeout only bounds each read, so a stream that
    trickles (a byte now and then) would never time out; at the deadline a timer shuts the socket down instead.
    """
    endpoint = "generate_stream" if stream else "generate"
    payload = body if body is not None else request_fields(prompt, max_tokens, stream, **options)
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout)
    expired = threading.Event()
    sockets: list[socket.socket] = []  # the connection drops its own reference once a response will close

    def _expire() -> None:
        expired.set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked read: it sees the end of the stream

    timer = threading.Timer(timeout, _expire)
    timer.daemon = True
    start = time.perf_counter()
    out = Result(text="")
    timer.start()
    try:
        conn.connect()
        sockets.append(conn.sock)
        if expired.is_set():  # the deadline passed while connecting
            _expire()
        conn.request("POST", f"{parts.path.rstrip('/')}/v2/models/{model}/{endpoint}", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RequestFailed(_error_detail(response.read()))
        if stream:
            events = (json.loads(line[5:]) for raw in response
                      if (line := raw.decode("utf-8").strip()).startswith("data:"))
        else:
            events = [json.loads(response.read())]
        for event in events:
            if "error" in event:
                raise RequestFailed(event["error"])
            out.add_text(event.get("text_output", ""), start, on_text)
            out.perf.update({k: event[k] for k in PERF_OUTPUTS if k in event})
    except (OSError, http.client.HTTPException, ValueError, RequestFailed):
        if not expired.is_set():
            raise
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():  # a cut-off body may also parse: whatever arrived after the deadline does not count
        raise TimeoutError(f"the request's deadline passed: no complete response within {timeout:g}s "
                           f"({len(out.chunks)} chunks arrived; raise --timeout for longer generations)")
    out.final = True  # the HTTP response ended: Triton closes it after the final response
    out.latency = time.perf_counter() - start
    out.text = "".join(out.chunks)
    return out


def _error_detail(raw: bytes) -> str:
    """Triton's error message from an error response body (generate_stream answers with one `data:` event)."""
    detail = raw.decode("utf-8", "replace").strip()
    body = detail[5:] if detail.startswith("data:") else detail
    try:
        return json.loads(body).get("error", detail)
    except (ValueError, AttributeError):
        return detail


# --------------------------------------------------------------------------- load run


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(results: list[Result], errors: list[str], wall: float, concurrency: int) -> dict:
    ttfts = [r.ttft for r in results if r.ttft is not None]
    latencies = [r.latency for r in results]
    tokens = sum(r.tokens for r in results)
    proposed = sum(r.perf.get("total_draft_tokens", 0) for r in results)
    accepted = sum(r.perf.get("total_accepted_draft_tokens", 0) for r in results)
    passes = sum(r.perf.get("target_passes", 0) for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(errors), "wall_seconds": round(wall, 3),
        "output_tokens": tokens, "tokens_per_second": round(tokens / wall, 2) if wall else 0.0,
        "requests_per_second": round(len(results) / wall, 3) if wall else 0.0,
        "per_request_tokens_per_second": round(statistics.mean(r.tokens_per_second for r in results), 2)
        if results else 0.0,
        "ttft_ms": {"mean": round(1000 * statistics.mean(ttfts), 1) if ttfts else 0.0,
                    "p50": round(1000 * _pct(ttfts, 0.5), 1), "p95": round(1000 * _pct(ttfts, 0.95), 1)},
        "latency_ms": {"mean": round(1000 * statistics.mean(latencies), 1) if latencies else 0.0,
                       "p50": round(1000 * _pct(latencies, 0.5), 1), "p95": round(1000 * _pct(latencies, 0.95), 1)},
        "tau": round(tokens / passes, 3) if passes else 0.0,
        "acceptance_rate": round(accepted / proposed, 4) if proposed else 0.0,
        "first_errors": errors[:3],
    }


def load_run(prompts: list[str], concurrency: int, requests: int | None = None, max_tokens: int = 64,
             stream: bool = True, http: bool = False, url: str = "127.0.0.1:8001", model: str = DEFAULT_MODEL,
             timeout: float = 600.0, run_timeout: float = 3600.0, **options) -> tuple[dict, list[Result | None]]:
    """`requests` requests (default 2 per worker) from `concurrency` workers; returns (summary, results in order).

    Two deadlines: `timeout` per request, `run_timeout` for the whole run. Each request's deadline is cut to the
    run's, requests not started by then are counted as errors, so the run returns by its deadline (plus the
    moment a cut-off stream takes to close) whatever the server does.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not prompts:
        raise ValueError("no prompts")
    total = requests or 2 * concurrency
    jobs: queue.Queue = queue.Queue()
    for i in range(total):
        jobs.put(i)
    results: list[Result | None] = [None] * total
    errors: list[str] = []
    lock = threading.Lock()
    start = time.perf_counter()
    run_deadline = start + run_timeout

    def worker() -> None:
        session = None if http else GrpcSession(url, model)
        try:
            while True:
                try:
                    i = jobs.get_nowait()
                except queue.Empty:
                    return
                left = run_deadline - time.perf_counter()
                if left <= 0:
                    with lock:
                        errors.append(f"request {i}: not started: the run's deadline ({run_timeout:g}s) passed")
                    continue
                prompt = prompts[i % len(prompts)]
                try:
                    if http:
                        r = http_generate(url, prompt, max_tokens, stream, model, timeout=min(timeout, left),
                                          **options)
                    else:
                        r = session.generate(prompt, max_tokens, stream, timeout=min(timeout, left), **options)
                    results[i] = r
                except Exception as e:  # counted and reported, the run goes on
                    with lock:
                        errors.append(f"request {i}: {type(e).__name__}: {e}")
        finally:
            if session is not None:
                session.close()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:  # one deadline for all: a request ends by the run's deadline, its stream closes soon after
        t.join(max(run_deadline + 30 - time.perf_counter(), 0))
    wall = time.perf_counter() - start
    stuck = sum(t.is_alive() for t in threads)
    with lock:
        if stuck:
            errors.append(f"{stuck} worker(s) still waiting 30s after the run's deadline (abandoned)")
        done = [r for r in results if r is not None]
        return summarize(done, list(errors), wall, concurrency), list(results)
