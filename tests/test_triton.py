"""The Triton deployment end to end: the real tritonserver (nvidia-pytriton wheel) serving triton_repo/spectrt.

One server for the module (1 instance batching up to 4 requests, the 4-layer slice as draft, a short context and
max_tokens limit);
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
from conftest import SERVING_PROMPTS, scrape_metrics
from spectrt.runtime.serving.client import GrpcSession, RequestFailed, grpc_inputs, http_generate, request_fields
from spectrt.runtime.serving.serve import SHM_DIR, ServeError, TritonServer, write_config

TREE = "2,1"
MAX_SEQ_LEN = 512
LIMIT = 48  # what most requests ask for
MAX_TOKENS_LIMIT = 400  # the server's cap: room for requests that stay busy until cancelled
TIMEOUT = 180.0
WAIT = 60.0  # hang guard for state the server reaches on its own (asserted through counters, never a clock)
MAX_ACTIVE = 4
MAX_COST = 1000
MAX_QUEUE = 16
PROMPTS = SERVING_PROMPTS


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
            "max_tokens_limit": MAX_TOKENS_LIMIT, "threads": 1, "measure_kernels": "false", "max_active": MAX_ACTIVE,
            "max_request_cost": MAX_COST, "max_queue_size": MAX_QUEUE,
            "stream_interval": 1, **extra}  # every token its response: streamed chunks == in-process deltas


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
    from spectrt.runtime.decoding.pipeline import Pipeline

    return Pipeline(target_dir, draft_dir, max_seq_len=MAX_SEQ_LEN, measure_kernels=False)  # as served


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
    # tree 2,1: 4 draft nodes a pass, fewer on a last step with fewer tokens left (trees stop at the output's end)
    assert r.perf["total_draft_tokens"] == gen.stats.proposed <= gen.stats.target_passes * 4
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
    """8 streams x 2 requests in flight on one batching instance: each output equals its sequential run."""
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
    ("max_tokens 0", lambda f: grpc_inputs({**f, "max_tokens": 0}),
     rf"max_tokens must be in \[1, {MAX_TOKENS_LIMIT}\]"),
    ("max_tokens over the limit", lambda f: grpc_inputs({**f, "max_tokens": MAX_TOKENS_LIMIT + 1}),
     rf"max_tokens.*got {MAX_TOKENS_LIMIT + 1}"),
    ("prompt longer than the context", lambda f: grpc_inputs({**f, "text_input": "word " * (MAX_SEQ_LEN + 50)}),
     f"max_seq_len={MAX_SEQ_LEN}"),
    ("negative temperature", lambda f: grpc_inputs({**f, "temperature": -1.0}), "temperature"),
    ("top_p above 1", lambda f: grpc_inputs({**f, "top_p": 1.5}), "top_p"),
    ("negative top_k", lambda f: grpc_inputs({**f, "top_k": -2}), "top_k"),
    ("invalid UTF-8", lambda f: grpc_inputs({**f, "text_input": b"caf\xc3("}), "UTF-8"),
    ("malformed tree", lambda f: grpc_inputs({**f, "tree": "2,x"}), "tree"),
    ("huge tree", lambda f: grpc_inputs({**f, "tree": "1000,1000,1000"}), "max_tree_tokens"),
    ("deep tree", lambda f: grpc_inputs({**f, "tree": ",".join(["1"] * 20)}), "max_tree_depth=16"),
    ("request cost", lambda f: grpc_inputs({**f, "tree": "4,4,2", "max_tokens": LIMIT}), "max_request_cost=1000"),
    ("negative min_length", lambda f: grpc_inputs({**f, "min_length": -1}, {"min_length": "INT32"}), "min_length"),
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


def test_metrics_count_speculative_work(server, session):
    before = scrape_metrics(server)
    r = session.generate(PROMPTS[3], 12, stream=True, timeout=TIMEOUT)
    after = scrape_metrics(server)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["spectrt_tokens_generated_total"] == r.perf["output_tokens"] > 0
    assert delta["spectrt_target_passes_total"] == r.perf["target_passes"] > 0
    assert delta["spectrt_draft_tokens_proposed_total"] == r.perf["total_draft_tokens"] > 0
    assert delta["spectrt_draft_tokens_accepted_total"] == r.perf["total_accepted_draft_tokens"]
    assert delta["spectrt_tau_count"] == 1  # one observation per request (N8): its own tau
    assert delta["spectrt_tau_sum"] == pytest.approx(r.perf["output_tokens"] / r.perf["target_passes"], rel=1e-6)
    assert delta["spectrt_requests_total"] == 1
    assert delta["spectrt_time_to_first_token_seconds_count"] == 1
    # each step's wall time and its target forward's (served vs in-process step costs): one within the other
    assert 0 < delta["spectrt_target_forward_seconds_total"] <= delta["spectrt_step_seconds_total"]
    # the Gateway API Inference Extension's queue and KV gauges (an InferencePool's endpoint picker reads them)
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    for label in ('request_type="scheduled"', 'request_type="waiting"'):
        assert re.search(r'^nv_trt_llm_request_metrics\{[^}]*' + label + r'[^}]*\} 0$', text, re.M), label
    assert re.search(r'^nv_trt_llm_kv_cache_block_metrics\{[^}]*kv_cache_block_type="fraction"[^}]*\} 0$', text,
                     re.M)


def _released(server) -> float:
    """Requests Triton has released for the model (success + failure), from /metrics."""
    text = urllib.request.urlopen(server.metrics_url, timeout=30).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(
        r"^nv_inference_request_(?:success|failure)\{[^}]*\} ([0-9.e+-]+)$", text, re.M))


def test_cancelled_stream_stops_decoding(server, session):
    """A client that closes its stream mid-generation: its request is dropped, not run to completion, and decoding
    stops (no slot held, no further batch steps)."""
    import queue

    before, released = scrape_metrics(server), _released(server)
    responses: queue.Queue = queue.Queue()
    session.client.start_stream(callback=lambda result, error: responses.put((result, error)))
    try:
        session.client.async_stream_infer(session.model, grpc_inputs(request_fields(PROMPTS[6], LIMIT, True)))
        result, error = responses.get(timeout=TIMEOUT)
        assert error is None and result.as_numpy("text_output") is not None
    finally:
        session.client.stop_stream(cancel_requests=True)
    _wait_for(lambda: _released(server) > released and _gauge(server, "spectrt_active_requests") == 0)
    after = scrape_metrics(server)
    assert after["spectrt_requests_total"] == before["spectrt_requests_total"], "it ran to completion"
    assert after["spectrt_requests_admitted_total"] == before["spectrt_requests_admitted_total"] + 1
    assert 0 < after["spectrt_batch_steps_total"] - before["spectrt_batch_steps_total"]
    assert scrape_metrics(server)["spectrt_batch_steps_total"] == after["spectrt_batch_steps_total"], "still decoding"
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
    from spectrt.runtime.serving.serve import DEFAULT_REPOSITORY

    text = (DEFAULT_REPOSITORY / "spectrt" / "config.pbtxt").read_text()
    out = write_config(text, {"target_dir": '/a "b"', "tree": "3,1", "new_key": "x"}, instances=5)
    assert re.search(r'key: "target_dir"\s+value: \{ string_value: "/a \\"b\\"" \}', out)
    assert re.search(r'key: "tree"\s+value: \{ string_value: "3,1" \}', out)
    assert 'key: "new_key" value: { string_value: "x" }' in out
    assert re.search(r"instance_group \[ \{ count: 5 kind: KIND_CPU \} \]", out)


def test_stream_interval_is_written_and_checked():
    from spectrt.runtime.serving.serve import DEFAULT_REPOSITORY, STREAM_INTERVAL, ServeError, model_params

    with pytest.raises(ServeError, match="--stream-interval must be >= 1"):
        model_params(stream_interval=0)
    assert model_params(stream_interval=2, engines=None, draft="none")["stream_interval"] == 2
    # one default: the CLI's, the repository's config and the model's fallback
    assert model_params(engines=None, draft="none")["stream_interval"] == STREAM_INTERVAL
    text = (DEFAULT_REPOSITORY / "spectrt" / "config.pbtxt").read_text()
    assert re.search(rf'key: "stream_interval"\s+value: {{ string_value: "{STREAM_INTERVAL}" }}', text)


# ------------------------------------------------------------------------------------------ in-flight batching
def _inputs(fields: dict):
    """grpc_inputs with the types of the tensorrtllm_backend fields request_fields does not know."""
    types = {"min_length": "INT32", "return_num_input_tokens": "BOOL", "return_num_output_tokens": "BOOL",
             "end_id": "INT32", "exclude_input_in_output": "BOOL"}
    words = {k: fields.pop(k) for k in ("stop_words", "bad_words") if k in fields}
    inputs = grpc_inputs(fields, types)
    if words:
        import numpy as np
        import tritonclient.grpc as grpcclient

        for name, values in words.items():
            data = np.array([[w.encode() for w in values]], dtype=np.object_)
            tensor = grpcclient.InferInput(name, list(data.shape), "BYTES")
            tensor.set_data_from_numpy(data)
            inputs.append(tensor)
    return inputs


class Stream:
    """One request over a gRPC stream, every response recorded: text deltas, token counts, final flags, errors."""

    def __init__(self, url: str, model: str):
        import queue

        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.model = model
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((result, error)))
        self.chunks: list[str] = []
        self.n_out, self.n_in, self.finals, self.errors = 0, None, 0, []

    def send(self, inputs) -> Stream:
        self.client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)
        return self

    def next(self, timeout: float = TIMEOUT) -> bool:
        """Record one response; True once it was final (an error response is final)."""
        result, error = self.responses.get(timeout=timeout)
        if error is not None:
            self.errors.append(error.message() if hasattr(error, "message") else str(error))
            self.finals += 1
            return True
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            delta = b"".join(text.reshape(-1).tolist()).decode("utf-8")
            if delta:
                self.chunks.append(delta)
        for name in ("num_output_tokens", "num_input_tokens"):
            value = result.as_numpy(name)
            if value is not None and name == "num_output_tokens":
                self.n_out += int(value.sum())
            elif value is not None:
                self.n_in = int(value.reshape(-1)[0])
        params = result.get_response().parameters
        final = "triton_final_response" in params and params["triton_final_response"].bool_param
        self.finals += int(final)
        return final

    def wait(self, timeout: float = TIMEOUT) -> Stream:
        while not self.next(timeout):
            pass
        return self

    def only_one_final(self, settle: float = 0.3) -> bool:
        import queue

        try:
            self.responses.get(timeout=settle)
        except queue.Empty:
            return self.finals == 1
        return False

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def _stream(server, session, fields: dict) -> Stream:
    return Stream(server.grpc_url, session.model).send(_inputs(fields))


def _gauge(server, name: str) -> float:
    return scrape_metrics(server).get(name, 0.0)


def _wait_for(predicate, timeout: float = WAIT) -> None:
    """Poll until predicate() holds; `timeout` only guards against a hang (it is never what a test asserts)."""
    import time

    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"still not the case after {timeout}s")
        time.sleep(0.05)


def test_sixteen_streams_no_lost_duplicated_or_crossed_tokens(server, session, pipe):
    """16 streams x 20 requests (mixed lengths, trees and AR) on one batching instance; one request per stream
    is bad and one stream cancels a request mid-way: every other output equals its sequential in-process run,
    token counts add up, and each request gets exactly one final response."""
    with _threads(1):  # raw prompts (no chat template): short prefills keep 320 requests quick
        refs = {p: pipe.generate(p, 8, TREE, chat=False).token_ids for p in PROMPTS}
    streams, requests = 16, 20
    results: dict[tuple[int, int], Stream] = {}
    errors: list[str] = []
    barrier = threading.Barrier(streams)

    def job(s: int, k: int) -> tuple[str, int, str]:
        return PROMPTS[(s + 3 * k) % 8], 2 + (s + k) % 7, ("0" if (s + k) % 3 == 0 else TREE)

    def run(s: int) -> None:
        try:
            barrier.wait(timeout=60)
            for k in range(requests):
                prompt, m, tree = job(s, k)
                fields = {**request_fields(prompt, m, True, tree=tree, chat=False), "return_num_output_tokens": True}
                if k == 7:  # a bad request in the middle of the load
                    fields["max_tokens"] = MAX_TOKENS_LIMIT + 1 + s
                if s == 5 and k == 11:  # cancelled mid-way: its stream closes after the first chunk
                    st = Stream(server.grpc_url, session.model).send(_inputs({**fields, "max_tokens": LIMIT}))
                    st.next()
                    st.close(cancel=True)
                    continue
                st = Stream(server.grpc_url, session.model).send(_inputs(fields))
                try:
                    results[(s, k)] = st.wait()
                finally:
                    st.close()
        except Exception as e:  # reported below
            errors.append(f"stream {s}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10 * TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert not errors, errors
    assert len(results) == streams * requests - 1
    for (s, k), r in sorted(results.items()):
        assert r.finals == 1, (s, k)
        if k == 7:
            assert r.errors and "max_tokens must be in" in r.errors[0], (s, k, r.errors)
            continue
        prompt, m, _ = job(s, k)
        want = refs[prompt][:m]
        assert not r.errors, (s, k, r.errors)
        assert r.text == pipe.tokenizer.decode(want, skip_special_tokens=True), f"stream {s} request {k}"
        assert r.n_out == len([t for t in want if t not in pipe.decoder.eos_ids]), (s, k)
    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 0)


def _batch_reference(pipe, prompt: str, max_tokens: int, **constraints):
    from spectrt.runtime.decoding.decoder import Decoder, Job
    from spectrt.runtime.decoding.tree import Tree

    dec = pipe.decoder
    job = Job(pipe.encode(prompt), max_tokens, Tree.parse(TREE), **constraints)
    with _threads(1):
        Decoder(dec.target, dec.draft, dec.eos_ids, MAX_SEQ_LEN).run([job])
    return job


def test_min_length_stop_and_bad_words_and_token_counts(server, session, pipe):
    """As tensorrtllm_backend documents them: end-of-sequence masked before min_length, generation stops after a
    stop word (included), bad words never generated; num_input/num_output_tokens count prompt and output."""
    tok = pipe.tokenizer
    prompt = PROMPTS[4]
    plain = _batch_reference(pipe, prompt, LIMIT)
    assert plain.finish == "stop"
    # a word whose tokenization alone is the token the model emitted (so it matches in context)
    j = next(i for i in range(2, len(plain.out))
             if tok.encode(tok.decode([plain.out[i]]), add_special_tokens=False) == [plain.out[i]])
    word = tok.decode([plain.out[j]])
    cases = [({"min_length": len(plain.out) + 5}, {"min_length": len(plain.out) + 5}),
             ({"stop_words": [word, "zzzq"]},
              {"stop_words": [[plain.out[j]], tok.encode("zzzq", add_special_tokens=False)]}),
             ({"bad_words": [word]}, {"bad_words": [[plain.out[j]]]})]
    for fields, constraints in cases:
        want = _batch_reference(pipe, prompt, LIMIT, **constraints)
        r = _stream(server, session, {**request_fields(prompt, LIMIT, True), **fields,
                                      "return_num_input_tokens": True, "return_num_output_tokens": True}).wait()
        assert not r.errors, r.errors
        assert r.text == tok.decode(want.out, skip_special_tokens=True), fields
        assert r.n_out == len(want.out) and r.n_in == len(pipe.encode(prompt))
    assert len(_batch_reference(pipe, prompt, LIMIT, **cases[0][1]).out) >= len(plain.out) + 5
    stopped = _batch_reference(pipe, prompt, LIMIT, **cases[1][1])
    assert stopped.out == plain.out[:j + 1]
    assert plain.out[j] not in _batch_reference(pipe, prompt, LIMIT, **cases[2][1]).out
    unary = _stream(server, session, {**request_fields(prompt, 6, False), "return_num_output_tokens": True}).wait()
    assert unary.n_out == len(plain.out[:6]) and len(unary.chunks) == 1


def test_stop_word_ending_inside_a_token_cuts_text_and_token_count(server, session, pipe):
    """A stop word that ends inside a generated token (the start of a later word): streamed and non-streamed, the
    text ends right after it and num_output_tokens counts up to the token that completes it; the rest of that
    token and the tokens accepted after it in the same step used to be sent and counted."""
    tok = pipe.tokenizer
    prompt = PROMPTS[4]
    out = _batch_reference(pipe, prompt, LIMIT).out
    text = tok.decode(out, skip_special_tokens=True)
    stop = next(w for w in text.split()[2:] if len(w) >= 4 and w.isalpha())[:2]
    cut = text[:text.index(stop) + len(stop)]
    tokens = next(k for k in range(1, len(out) + 1) if stop in tok.decode(out[:k], skip_special_tokens=True))
    assert tok.decode(out[:tokens], skip_special_tokens=True) != cut  # it ends inside a token
    for stream in (True, False):
        r = _stream(server, session, {**request_fields(prompt, LIMIT, stream), "stop_words": [stop],
                                      "return_num_output_tokens": True}).wait()
        r.close()
        assert not r.errors and r.text == cut and r.n_out == tokens, (stream, r.text, r.n_out, cut, tokens)


def test_queued_request_cancelled_never_prefills_and_slots_free(server, session):
    """Every slot busy: a queued request that is cancelled never takes a slot (the admitted counter does not
    move) and leaves the queue; a full queue refuses with "overloaded"; cancelling a running request frees its
    slot within a second. The busy requests cannot end early (end-of-sequence masked for all their tokens), so
    every slot stays taken however fast the engine runs."""
    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 0, 30)
    hold = {"min_length": MAX_TOKENS_LIMIT}
    busy = [_stream(server, session, {**request_fields(PROMPTS[i], MAX_TOKENS_LIMIT, True, tree="0"), **hold})
            for i in range(MAX_ACTIVE)]
    try:
        _wait_for(lambda: _gauge(server, "spectrt_active_requests") == MAX_ACTIVE, 60)
        admitted = _gauge(server, "spectrt_requests_admitted_total")
        queued = _stream(server, session, request_fields(PROMPTS[5], LIMIT, True))
        _wait_for(lambda: _gauge(server, "spectrt_queued_requests") == 1, 30)
        queued.close(cancel=True)
        _wait_for(lambda: _gauge(server, "spectrt_queued_requests") == 0, 1.0)
        assert _gauge(server, "spectrt_requests_admitted_total") == admitted, "the cancelled queued request ran"
        full = [_stream(server, session, request_fields(PROMPTS[k % 8], LIMIT, True)) for k in range(MAX_QUEUE)]
        _wait_for(lambda: _gauge(server, "spectrt_queued_requests") == MAX_QUEUE, 30)
        refused = _stream(server, session, request_fields(PROMPTS[0], 4, True)).wait(30)
        refused.close()
        assert refused.errors and "overloaded" in refused.errors[0], refused.errors
        assert f"max_queue_size={MAX_QUEUE}" in refused.errors[0]
        for st in full:
            st.close(cancel=True)
        _wait_for(lambda: _gauge(server, "spectrt_queued_requests") == 0, 2.0)
        busy[0].close(cancel=True)
        _wait_for(lambda: _gauge(server, "spectrt_active_requests") == MAX_ACTIVE - 1, 1.0)
    finally:
        for st in busy[1:]:
            st.close(cancel=True)
    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 0, 5)
    _good(session)


def test_newline_stop_word_oversized_fields_and_deadline(server, session, pipe):
    """Over the wire: stop_words ["\\n"] stops at the first newline (a whitespace word is kept, not stripped); a
    1 MB tree string and a 10,000-entry word list are refused before any work (no request admitted); a request
    past its timeout_seconds ends with one deadline error and frees its slot; then a default request is served."""
    tok = pipe.tokenizer
    prompt = "List three fruits, one per line."
    plain = tok.decode(_batch_reference(pipe, prompt, LIMIT).out, skip_special_tokens=True)
    assert "\n" in plain, f"the reference answer has no newline to stop at: {plain!r}"
    r = _stream(server, session, {**request_fields(prompt, LIMIT, True), "stop_words": ["\n"]}).wait()
    r.close()
    assert not r.errors and r.only_one_final(), r.errors
    assert r.text == plain[:plain.index("\n") + 1]

    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 0, 30)
    admitted = _gauge(server, "spectrt_requests_admitted_total")
    for fields, message in (({"tree": "1," * (1 << 19)}, "tree"), ({"stop_words": ["a"] * 10_000}, "stop_words"),
                            ({"bad_words": ["b"] * 10_000}, "bad_words")):
        refused = _stream(server, session, {**request_fields(PROMPTS[0], 8, True), **fields}).wait()
        refused.close()
        assert refused.errors and message in refused.errors[0], (list(fields), refused.errors)
        assert len(refused.errors[0]) < 1000, "the error echoes the oversized input back"
    assert _gauge(server, "spectrt_requests_admitted_total") == admitted, "an oversized request was admitted"

    slow = {**request_fields(PROMPTS[1], MAX_TOKENS_LIMIT, True, tree="0"), "min_length": MAX_TOKENS_LIMIT,
            "timeout_seconds": 0.5}
    late = _stream(server, session, slow).wait()
    late.close()
    assert late.finals == 1 and late.errors and "deadline exceeded" in late.errors[0], late.errors
    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 0, 5)
    _good(session)


def test_non_streaming_request_cancelled_midway_stops(server, session):
    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 0)
    before = scrape_metrics(server)
    st = _stream(server, session, request_fields(PROMPTS[6], LIMIT, False, tree="0"))
    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 1)
    st.close(cancel=True)
    _wait_for(lambda: _gauge(server, "spectrt_active_requests") == 0)
    after = scrape_metrics(server)
    assert after["spectrt_requests_total"] == before["spectrt_requests_total"], "it ran to completion"
    assert after["spectrt_requests_admitted_total"] == before["spectrt_requests_admitted_total"] + 1
    _good(session)


def test_edge_inputs_in_sequence_each_get_one_final_response(server, session, pipe):
    """Custom end_id, a 63-deep chain, a 50 MB prompt, tree "0" and "-1", a whitespace prompt, then a default
    request: one final response each, errors naming the limit, and the last output equals the in-process one."""
    ref = reference(pipe, PROMPTS[0], 16)[0].token_ids
    stop_token = ref[6]
    cases = [
        ({"end_id": stop_token}, pipe.tokenizer.decode(ref[:ref.index(stop_token)], skip_special_tokens=True)),
        ({"tree": ",".join(["1"] * 63)}, "max_tree_depth"),
        ({"text_input": "x" * (50 << 20)}, "bytes"),
        ({"tree": "0"}, pipe.tokenizer.decode(ref, skip_special_tokens=True)),
        ({"tree": "-1"}, "at least 1 child"),
        ({"text_input": " \n\t "}, "empty"),
        ({}, pipe.tokenizer.decode(ref, skip_special_tokens=True)),
    ]
    for fields, expected in cases:
        r = _stream(server, session, {**request_fields(PROMPTS[0], 16, True), **fields})
        try:
            r.wait(60)
            assert r.only_one_final(), fields.keys()
            if r.errors:
                assert expected in r.errors[0], (list(fields), r.errors)
            else:
                assert r.text == expected, list(fields)
        finally:
            r.close()


@pytest.mark.unit
def test_the_models_python_logs_go_to_tritons_log_at_their_level(monkeypatch):
    """The stub configures no logging: without a handler the scheduler's warnings and a failed request's traceback
    went to Python's last-resort handler (bare stderr lines). `route_logs` sends them to Triton's logger by level."""
    import importlib.util
    import logging
    import sys
    import types

    said = []
    fake = types.ModuleType("triton_python_backend_utils")
    fake.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    fake.Logger = types.SimpleNamespace(**{f"log_{level}": (lambda text, level=level: said.append((level, text)))
                                           for level in ("info", "warn", "error")})
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake)
    path = Path(__file__).resolve().parent.parent / "triton_repo" / "spectrt" / "1" / "model.py"
    spec = importlib.util.spec_from_file_location("spectrt_triton_model_under_test", path)
    model = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, model)  # its dataclasses look their module up
    spec.loader.exec_module(model)
    root = logging.getLogger("spectrt")
    saved = root.handlers[:], root.level, root.propagate
    try:
        model.route_logs()
        model.route_logs()  # once a process
        assert sum(isinstance(h, model.TritonLogHandler) for h in root.handlers) == 1
        log = logging.getLogger("spectrt.scheduler")
        log.info("admitted %d", 3)
        log.warning("a step failed")
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("request 'r' failed")
        log.debug("not at INFO")
        assert [level for level, _ in said] == ["info", "warn", "error"]
        assert said[0][1] == "spectrt.scheduler: admitted 3" and "ValueError: boom" in said[2][1]
    finally:
        root.handlers[:], root.level, root.propagate = saved[0], saved[1], saved[2]
