"""The Triton deployment end to end: the real tritonserver (nvidia-pytriton wheel) serving triton_repo/spectrt.

One server for the module (2 instances, the 4-layer slice as draft, a short context and max_tokens limit);
every request has a timeout, and the fixture's finalizer stops the server by PID and checks that no process
and no shared-memory region is left behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from spectrt.runtime.client import GrpcSession, RequestFailed, grpc_inputs, http_generate, request_fields
from spectrt.runtime.serve import SHM_DIR, ServeError, TritonServer, write_config

TREE = "2,1"
MAX_SEQ_LEN = 256
LIMIT = 48
TIMEOUT = 180.0
PROMPTS = [
    "Write a short poem about the sea.",
    "List five animals that live in the ocean.",
    "What is 12 times 15? Explain briefly.",
    "Give three tips for learning a new language.",
    "What is the capital of France?",
    "Write a SQL query that counts rows in a table named users.",
    "Explain what photosynthesis is to a child.",
    "Name three colors.",
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _assert_cleaned(server: TritonServer, pid: int, run_dir: Path) -> None:
    assert not _alive(pid), f"tritonserver {pid} is still running"
    assert not list(SHM_DIR.glob(server.shm_prefix + "*")), "shared-memory regions left in /dev/shm"
    assert not run_dir.exists(), f"{run_dir} was not removed"


@contextlib.contextmanager
def _threads(n: int):
    """Run in-process references with the server instances' thread count (same GEMM reduction order)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _params(target_dir, draft_dir, **extra) -> dict:
    # measure_kernels=false: the engine's GEMM formulation is fixed instead of timed at load, so the served
    # instances and the in-process reference run bitwise the same arithmetic (timing could pick differently)
    return {"target_dir": target_dir, "draft_dir": draft_dir, "tree": TREE, "max_seq_len": MAX_SEQ_LEN,
            "max_tokens_limit": LIMIT, "threads": 1, "measure_kernels": "false", **extra}


@pytest.fixture(scope="module")
def server(target_dir, draft_dir):
    srv = TritonServer(_params(target_dir, draft_dir), instances=1, ready_timeout=300)
    srv.start()
    pid, run_dir = srv.pid, srv.run_dir
    yield srv
    srv.stop()
    _assert_cleaned(srv, pid, run_dir)


@pytest.fixture(scope="module")
def pipe(target_dir, draft_dir):
    from spectrt.runtime.pipeline import Pipeline

    pipe = Pipeline(target_dir, draft_dir, max_seq_len=MAX_SEQ_LEN)
    for engine in (pipe.decoder.target, pipe.decoder.draft):
        engine.linear.measure = False  # as the served instances (measure_kernels=false)
    return pipe


@pytest.fixture(scope="module")
def session(server):
    with GrpcSession(server.grpc_url) as s:
        yield s


def reference(pipe, prompt: str, max_tokens: int):
    deltas: list[str] = []
    with _threads(1):
        gen = pipe.generate(prompt, max_tokens, TREE, on_text=deltas.append)
    return gen, deltas


def test_streamed_chunks_equal_inprocess_generate(server, session, pipe):
    gen, deltas = reference(pipe, PROMPTS[0], 24)
    r = session.generate(PROMPTS[0], 24, stream=True, timeout=TIMEOUT, tree=TREE)
    assert r.final, "the last response must carry Triton's final flag"
    assert len(r.chunks) > 1, "a streamed request must arrive in several chunks"
    assert "".join(r.chunks) == gen.text
    assert r.chunks == deltas  # the same deltas the in-process stream produced
    assert r.perf["output_tokens"] == len(gen.token_ids)
    assert r.perf["target_passes"] == gen.stats.target_passes
    assert r.perf["total_draft_tokens"] == gen.stats.target_passes * 4  # tree 2,1: 4 draft nodes per pass
    assert r.perf["total_accepted_draft_tokens"] == sum(gen.stats.accepted)
    assert r.ttft is not None and r.ttft <= r.latency


def test_non_streaming_grpc_and_http_return_the_same_text(server, session, pipe):
    gen, _ = reference(pipe, PROMPTS[1], 16)
    unary = session.generate(PROMPTS[1], 16, stream=False, timeout=TIMEOUT)
    assert unary.final and len(unary.chunks) == 1 and unary.text == gen.text
    http = http_generate(server.http_url, PROMPTS[1], 16, stream=False, timeout=TIMEOUT)
    assert http.text == gen.text and http.perf["output_tokens"] == len(gen.token_ids)
    sse = http_generate(server.http_url, PROMPTS[1], 16, stream=True, timeout=TIMEOUT)
    assert sse.text == gen.text and len(sse.chunks) > 1


def test_batched_request_rows(server, session, pipe):
    """A request with two rows (max_batch_size > 1): each row decoded on its own, one final response."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    expected = [reference(pipe, p, 6)[0].text for p in PROMPTS[2:4]]
    inputs = []
    for name, data, dtype in (("text_input", np.array([[p.encode()] for p in PROMPTS[2:4]], dtype=object), "BYTES"),
                              ("max_tokens", np.array([[6], [6]], dtype=np.int32), "INT32")):
        tensor = grpcclient.InferInput(name, list(data.shape), dtype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    import queue

    responses: queue.Queue = queue.Queue()
    session.client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        session.client.async_stream_infer(session.model, inputs)
        result, error = responses.get(timeout=TIMEOUT)
    finally:
        session.client.stop_stream()
    assert error is None, error
    assert [t.decode() for t in result.as_numpy("text_output").reshape(-1)] == expected


def test_concurrent_streams_get_their_own_tokens(server, pipe):
    """8 streams x 2 requests in flight on 2 instances: each output equals its sequential in-process output."""
    refs = {p: reference(pipe, p, 16)[0].token_ids for p in PROMPTS}
    jobs = {(s, k): (PROMPTS[(s + 3 * k) % 8], 8 + 4 * ((s + k) % 3)) for s in range(8) for k in range(2)}
    expected = {key: pipe.tokenizer.decode(refs[p][:m], skip_special_tokens=True) for key, (p, m) in jobs.items()}
    results, errors = {}, []
    barrier = threading.Barrier(8)

    def stream(s: int) -> None:
        try:
            with GrpcSession(server.grpc_url) as sess:
                barrier.wait(timeout=60)
                for k in range(2):
                    prompt, m = jobs[(s, k)]
                    results[(s, k)] = sess.generate(prompt, m, stream=True, timeout=TIMEOUT)
        except Exception as e:  # reported below
            errors.append(f"stream {s}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=stream, args=(s,), daemon=True) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(2 * TIMEOUT + 60)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert not errors, errors
    for key, r in sorted(results.items()):
        assert r.final, key
        assert r.text == expected[key], f"stream {key[0]} request {key[1]} got another output"
    assert len(results) == 16


def _good(session) -> None:
    r = session.generate("Say hi.", 2, stream=True, timeout=TIMEOUT)
    assert r.final and r.text


BAD = [
    ("missing text_input", lambda f: grpc_inputs({k: v for k, v in f.items() if k != "text_input"}), "text_input"),
    ("wrong dtype", lambda f: grpc_inputs(f, {"max_tokens": "FP32"}), r"max_tokens.*FP32.*INT32"),
    ("max_tokens 0", lambda f: grpc_inputs({**f, "max_tokens": 0}), r"max_tokens must be in \[1, 48\]"),
    ("max_tokens over the limit", lambda f: grpc_inputs({**f, "max_tokens": LIMIT + 1}), r"max_tokens.*got 49"),
    ("prompt longer than the context", lambda f: grpc_inputs({**f, "text_input": "word " * 300}), "max_seq_len=256"),
    ("negative temperature", lambda f: grpc_inputs({**f, "temperature": -1.0}), "temperature"),
    ("top_p above 1", lambda f: grpc_inputs({**f, "top_p": 1.5}), "top_p"),
    ("negative top_k", lambda f: grpc_inputs({**f, "top_k": -2}), "top_k"),
    ("invalid UTF-8", lambda f: grpc_inputs({**f, "text_input": b"caf\xc3("}), "UTF-8"),
    ("malformed tree", lambda f: grpc_inputs({**f, "tree": "2,x"}), "tree"),
    ("huge tree", lambda f: grpc_inputs({**f, "tree": "1000,1000,1000"}), "max_tree_tokens"),
]


@pytest.mark.parametrize("name, make, message", BAD, ids=[b[0] for b in BAD])
def test_bad_request_gets_an_error_and_the_server_keeps_serving(server, session, name, make, message):
    with pytest.raises(RequestFailed, match=message):
        session.infer(make(request_fields("Name three colors.", 4, True)), timeout=TIMEOUT)
    _good(session)


def test_bad_http_request_gets_an_error(server, session):
    with pytest.raises(RequestFailed, match="max_tokens"):
        http_generate(server.http_url, "Name three colors.", 0, timeout=TIMEOUT)
    with pytest.raises(RequestFailed, match="text_input"):
        http_generate(server.http_url, "", 4, body={"max_tokens": 4}, timeout=TIMEOUT)
    _good(session)


def _scrape(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(spectrt_[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m and "_bucket" not in m.group(1):
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(2))
    return values


def test_metrics_count_speculative_work(server, session):
    before = _scrape(server)
    r = session.generate(PROMPTS[3], 12, stream=True, timeout=TIMEOUT)
    after = _scrape(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["spectrt_tokens_generated_total"] == r.perf["output_tokens"] > 0
    assert delta["spectrt_target_passes_total"] == r.perf["target_passes"] > 0
    assert delta["spectrt_draft_tokens_proposed_total"] == r.perf["total_draft_tokens"] > 0
    assert delta["spectrt_draft_tokens_accepted_total"] == r.perf["total_accepted_draft_tokens"]
    assert delta["spectrt_tau_count"] == r.perf["target_passes"]
    assert delta["spectrt_requests_total"] == 1
    assert delta["spectrt_time_to_first_token_seconds_count"] == 1


def _released(server) -> float:
    """Requests Triton has released for the model (success + failure), from /metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r"^nv_inference_request_(?:success|failure)\{[^}]*\} ([0-9.e+-]+)$", text, re.M))


def test_cancelled_stream_stops_decoding(server, session):
    """A client that closes its stream mid-generation frees its instance within a decoder step or two."""
    import queue
    import time

    before, released = _scrape(server), _released(server)
    responses: queue.Queue = queue.Queue()
    session.client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        session.client.async_stream_infer(session.model, grpc_inputs(request_fields(PROMPTS[6], LIMIT, True)))
        result, error = responses.get(timeout=TIMEOUT)
        assert error is None and result.as_numpy("text_output") is not None
    finally:
        session.client.stop_stream(cancel_requests=True)
    cancelled_at = time.monotonic()
    while _released(server) <= released and time.monotonic() - cancelled_at < TIMEOUT:
        time.sleep(0.05)
    stopped_after = time.monotonic() - cancelled_at
    # 48 tokens take several seconds at this size; a cancelled request ends at the next check (0.25 s) + a step
    assert stopped_after < 2.0, f"the cancelled request ran on for {stopped_after:.1f}s"
    assert _scrape(server)["spectrt_requests_total"] == before["spectrt_requests_total"], "it completed"
    _good(session)


def test_readiness_timeout_stops_the_server_and_cleans_up(target_dir, draft_dir):
    srv = TritonServer(_params(target_dir, draft_dir), instances=1, ready_timeout=1.0)
    with pytest.raises(TimeoutError, match="not ready"):
        srv.start()
    _assert_cleaned(srv, srv.pid, srv.run_dir)


def test_model_that_cannot_load_fails_fast_with_its_reason(target_dir, tmp_path):
    srv = TritonServer(_params(target_dir, tmp_path / "missing-draft", warmup="false"), instances=1,
                       ready_timeout=300)
    with pytest.raises(ServeError, match="draft_dir"):
        srv.start()
    _assert_cleaned(srv, srv.pid, srv.run_dir)


def test_config_overrides_are_written():
    from spectrt.runtime.serve import DEFAULT_REPOSITORY

    text = (DEFAULT_REPOSITORY / "spectrt" / "config.pbtxt").read_text()
    out = write_config(text, {"target_dir": '/a "b"', "tree": "3,1", "new_key": "x"}, instances=5)
    assert re.search(r'key: "target_dir"\s+value: \{ string_value: "/a \\"b\\"" \}', out)
    assert re.search(r'key: "tree"\s+value: \{ string_value: "3,1" \}', out)
    assert 'key: "new_key" value: { string_value: "x" }' in out
    assert re.search(r"instance_group \[ \{ count: 5 kind: KIND_CPU \} \]", out)
