"""Served from an engines directory on ONNX Runtime (the real tritonserver, one batching instance): concurrent greedy
requests, batched into one graph run per step, each equal their sequential output.

The engines are what `make engines` builds (conftest's `head_engines`: the embedded target and the shipped EAGLE-3
head, its own graph), decoding under the default policy.
"""

from __future__ import annotations

import threading

import pytest
from conftest import SERVING_PROMPTS
from spectrt.runtime.serving.client import GrpcSession
from spectrt.runtime.serving.serve import SHM_DIR, TritonServer

TIMEOUT = 300.0
PROMPTS = SERVING_PROMPTS


@pytest.fixture(scope="module")
def server(head_engines):
    params = {"engine_dir": head_engines[0], "backend": "onnxruntime", "target_dir": "", "draft_dir": "",
              "max_seq_len": 256, "max_tokens_limit": 48, "max_active": 8}
    srv = TritonServer(params, instances=1, ready_timeout=300)
    srv.start()
    pid = srv.pid
    yield srv
    srv.stop()
    assert not list(SHM_DIR.glob(srv.shm_prefix + "*")), "shared-memory regions left in /dev/shm"
    assert pid is not None


def test_concurrent_greedy_streams_equal_their_sequential_outputs(server):
    with GrpcSession(server.grpc_url) as session:
        sequential = [session.generate(p, 24, stream=True, timeout=TIMEOUT) for p in PROMPTS]
    assert all(r.final and r.text for r in sequential)
    results, errors = {}, []
    barrier = threading.Barrier(len(PROMPTS))

    def stream(i: int) -> None:
        try:
            with GrpcSession(server.grpc_url) as s:
                barrier.wait(timeout=60)
                results[i] = s.generate(PROMPTS[i], 24, stream=True, timeout=TIMEOUT)
        except Exception as e:  # reported below
            errors.append(f"stream {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT + 60)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert not errors, errors
    for i, want in enumerate(sequential):
        got = results[i]
        assert got.final and got.text == want.text, f"stream {i} got another output"
        assert got.perf["output_tokens"] == want.perf["output_tokens"]
