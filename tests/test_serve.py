"""`spectrt serve` under abuse, with the real tritonserver: signals, a killed launcher, --run-dir, admin APIs;
and the client's deadlines against an in-process server that trickles its response.

The launcher runs as a subprocess (`python -m spectrt serve --target STUB --draft none`: lifecycle, not decoding,
is under test, so the model is a tiny random checkpoint with the embedded tokenizer, conftest's `stub_target`).
After each stop nothing may be left: no server or stub process, no listening port, no /dev/shm region, no run
directory.
"""

from __future__ import annotations

import http.server
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import SERVE_READY_TIMEOUT, launch_serve
from spectrt.runtime.serving.client import GrpcSession, http_generate, load_run
from spectrt.runtime.serving.serve import (
    ADMIN_HEADER,
    GRPC_ADMIN_HEADER,
    SHM_DIR,
    ServeError,
    TritonServer,
    host_warning,
)

GONE_TIMEOUT = 120.0  # how long cleanup may take before the test fails (a hang guard, not a speed check)


def _state(pid: int) -> str | None:
    """The process state letter, None once it is gone (a zombie waiting for a reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state = stat.rpartition(")")[2].split()[0]
    return None if state in "ZX" else state


def _group(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (tritonserver leads its own; the python stubs are in it)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in "ZX":
            members.append(int(stat.parent.name))
    return members


def _port_free(url: str) -> bool:
    host, port = url.replace("http://", "").split("/")[0].rsplit(":", 1)
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine, a listener is not
        try:
            s.bind((host, int(port)))
        except OSError:
            return False
    return True


@pytest.fixture
def launch(stub_target):
    def start(*extra: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, dict]:
        proc, info, _ = launch_serve(stub_target, *extra, env=env)
        return proc, info

    return start


def _assert_nothing_left(info: dict) -> None:
    """Wait (bounded) for the supervisor to finish, then check every resource the server held is released."""
    deadline = time.monotonic() + GONE_TIMEOUT
    while time.monotonic() < deadline and (_state(info["supervisor_pid"]) or Path(info["run_dir"]).exists()):
        time.sleep(0.2)
    assert _state(info["pid"]) is None, f"tritonserver {info['pid']} is still running"
    assert _group(info["pid"]) == [], "processes of the server's group (python stubs) are still running"
    assert _state(info["supervisor_pid"]) is None, "the supervisor is still running"
    assert not list(SHM_DIR.glob(info["shm_prefix"] + "*")), "shared-memory regions left in /dev/shm"
    assert not Path(info["run_dir"]).exists(), f"{info['run_dir']} was not removed"
    for name in ("http", "grpc", "metrics"):
        assert _port_free(info[name]), f"the {name} port is still open"


def test_sighup_stops_the_server_and_cleans_up(launch):
    """A closed terminal sends SIGHUP: it used to kill the launcher and orphan the server."""
    proc, info = launch()
    proc.send_signal(signal.SIGHUP)
    assert proc.wait(timeout=GONE_TIMEOUT) == 0, proc.stderr.read()
    _assert_nothing_left(info)


def test_killed_launcher_leaves_nothing_behind(launch):
    """SIGKILL runs no cleanup in the launcher: its supervisor sees the pipe close and cleans up instead."""
    proc, info = launch()
    proc.kill()
    proc.wait(timeout=60)
    _assert_nothing_left(info)


def test_second_sigint_during_stop_still_cleans_up(launch):
    proc, info = launch()
    proc.send_signal(signal.SIGINT)
    err = ""
    while "stopping tritonserver" not in err:
        line = proc.stderr.readline()
        assert line, f"the launcher ended without stopping:\n{err}"
        err += line
    proc.send_signal(signal.SIGINT)  # the impatient second Ctrl-C, while the server shuts down
    assert proc.wait(timeout=GONE_TIMEOUT) == 0
    err += proc.stderr.read()
    assert "already stopping" in err and "Traceback" not in err, err
    _assert_nothing_left(info)


def test_sigterm_during_a_long_request_answers_it_refuses_new_ones_and_leaves_nothing(launch):
    """SIGTERM while a request decodes: that request still gets its one final response (all its text, or an error
    saying the server is stopping), a request sent once the server is no longer ready is refused, and nothing is
    left behind."""
    import tritonclient.grpc as grpcclient
    from spectrt.runtime.serving.client import RequestFailed, grpc_inputs, request_fields
    from tritonclient.utils import InferenceServerException

    long = 1000  # the stub model decodes fast: a request long enough to be in flight when the signal comes
    proc, info = launch("--max-tokens-limit", str(long), "--max-seq-len", str(long + 64))
    started, outcome = threading.Event(), {}

    def long_request() -> None:
        fields = {**request_fields("Name three colors.", long, True), "min_length": long}  # no early end
        with GrpcSession(info["grpc"]) as session:
            try:
                outcome["result"] = session.infer(grpc_inputs(fields), on_text=lambda *_: started.set(), timeout=120)
            except (RequestFailed, ConnectionError) as e:
                outcome["error"] = str(e)

    worker = threading.Thread(target=long_request)
    worker.start()
    assert started.wait(120), "the long request produced no text"
    proc.send_signal(signal.SIGTERM)
    client = grpcclient.InferenceServerClient(info["grpc"])
    try:
        deadline = time.monotonic() + GONE_TIMEOUT
        while time.monotonic() < deadline:
            try:
                if not client.is_server_ready():
                    break
            except Exception:  # the endpoint already closed: refused as well
                break
            time.sleep(0.05)
        with pytest.raises((RequestFailed, ConnectionError, InferenceServerException)):  # UNAVAILABLE, or refused
            GrpcSession(info["grpc"]).generate("Say hi.", 2, stream=True, timeout=30)
    finally:
        client.close()
    worker.join(GONE_TIMEOUT)
    assert not worker.is_alive(), "the in-flight request never got a final response"
    if "result" in outcome:
        assert outcome["result"].final and outcome["result"].perf.get("output_tokens") == long, outcome
    else:
        assert "stopping" in outcome["error"].lower() or "unavailable" in outcome["error"].lower(), outcome
    assert proc.wait(timeout=GONE_TIMEOUT) == 0, proc.stderr.read()
    _assert_nothing_left(info)


def test_torch_reference_path_serves_min_length_and_bad_words(launch, tokenizer):
    """SPECTRT_NATIVE=0: `spectrt serve` says once that the torch reference path runs, and two concurrent greedy
    requests with min_length and bad words decode there (its logits were inference tensors that the in-place
    masking refused: such requests ended in an error)."""
    from concurrent.futures import ThreadPoolExecutor

    from spectrt.runtime.serving.client import grpc_inputs, request_fields

    proc, info = launch(env={"SPECTRT_NATIVE": "0"})
    try:
        with GrpcSession(info["grpc"]) as session:
            plain = session.generate("Name three colors.", 8, stream=False, timeout=180)
        ids = tokenizer.encode(plain.text, add_special_tokens=False)
        word = next(w for t in ids[1:]  # a word the answer holds whose own tokenization is that one token
                    if (w := tokenizer.decode([t])).strip() and tokenizer.encode(w, add_special_tokens=False) == [t])
        requests = [{"min_length": 8}, {"bad_words": [word]}]

        def send(extra: dict):
            with GrpcSession(info["grpc"]) as session:
                fields = {**request_fields("Name three colors.", 8, False), **extra}
                return session.infer(grpc_inputs(fields), timeout=180)

        with ThreadPoolExecutor(len(requests)) as pool:
            longer, banned = pool.map(send, requests)
        assert longer.final and longer.tokens == 8
        assert banned.final and banned.text != plain.text
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=GONE_TIMEOUT) == 0
    err = proc.stderr.read()
    assert err.count("the native CPU forward is unavailable (disabled by SPECTRT_NATIVE=0): the torch reference "
                     "path runs") == 1, err
    _assert_nothing_left(info)


def test_run_dir_with_unrelated_files_is_left_untouched(launch, tmp_path):
    """`--run-dir ~` used to delete ~/models: now the launcher writes only into a fresh subdirectory it made."""
    mine = {"models/keep.txt": "model notes", "server.log": "my log", "backends/python/x": "x", "notes.txt": "n"}
    for name, text in mine.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    proc, info = launch("--run-dir", str(tmp_path))
    run_dir = Path(info["run_dir"])
    assert run_dir.parent == tmp_path and run_dir.name.startswith("spectrt-triton-")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=GONE_TIMEOUT) == 0
    for name, text in mine.items():
        assert (tmp_path / name).read_text() == text, f"{name} was changed or removed"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({"models", "server.log", "backends", "notes.txt",
                                                                  run_dir.name})
    assert (run_dir / "server.log").is_file(), "a --run-dir run keeps its log"
    assert _state(info["pid"]) is None and not list(SHM_DIR.glob(info["shm_prefix"] + "*"))


@pytest.fixture(scope="module")
def server(stub_target):
    params = {"target_dir": stub_target, "draft_dir": "none", "max_seq_len": 128, "max_tokens_limit": 8,
              "threads": 1, "warmup": "false"}
    with TritonServer(params, instances=1, ready_timeout=SERVE_READY_TIMEOUT) as server:
        yield server
    code = server.poll()
    assert server.stop() == code, "a second stop() is a no-op"
    assert _state(server.pid) is None and not server.run_dir.exists()


def test_tiny_temperature_is_served_greedily(server):
    """temperature=1e-40 used to end in an INTERNAL error (NaN probabilities); now it decodes greedily."""
    with GrpcSession(server.grpc_url) as session:
        tiny = session.generate("Name three colors.", 6, stream=False, timeout=180, temperature=1e-40, seed=1)
        greedy = session.generate("Name three colors.", 6, stream=False, timeout=180, temperature=0.0)
    assert tiny.text == greedy.text and tiny.perf["output_tokens"] == greedy.perf["output_tokens"] > 0


def test_admin_apis_need_the_key(server):
    """Model repository, shared memory, trace and logging APIs answer only with the admin key; inference,
    health and metadata stay open."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    key = {ADMIN_HEADER: server.admin_key}
    for path in ("/v2/repository/index", "/v2/systemsharedmemory/status", "/v2/trace/setting", "/v2/logging"):
        method = "POST" if "repository" in path else "GET"
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(urllib.request.Request(server.http_url + path, method=method), timeout=30)
        assert refused.value.code == 403 and ADMIN_HEADER in refused.value.read().decode()
        request = urllib.request.Request(server.http_url + path, method=method, headers=key)
        assert urllib.request.urlopen(request, timeout=30).status == 200
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match=ADMIN_HEADER):
            client.get_model_repository_index()
        with pytest.raises(InferenceServerException, match=ADMIN_HEADER):
            client.update_log_settings({"log_verbose_level": 1})
        assert client.get_model_repository_index(headers={GRPC_ADMIN_HEADER: server.admin_key}) is not None
        assert client.is_server_ready() and client.get_model_metadata("spectrt").name == "spectrt"
    finally:
        client.close()
    assert urllib.request.urlopen(server.http_url + "/v2/models/spectrt/config", timeout=30).status == 200


@pytest.mark.unit
def test_admin_key_that_would_break_the_flag_is_refused(target_dir):
    with pytest.raises(ServeError, match="admin key must be 16 or more"):
        TritonServer({"target_dir": target_dir}, admin_key="short:key=x")


@pytest.mark.unit
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"served_name": "../x"}, "is not a model name"),  # would have escaped the run directory
    ({"served_name": "a/b"}, "is not a model name"),
    ({"openai_timeout": 0}, "--openai-timeout must be a positive"),  # every request would have been a 504
    ({"openai_timeout": float("nan")}, "--openai-timeout must be a positive"),
    ({"api_key": ""}, "is empty, which would leave the OpenAI endpoint open"),  # silently disabled auth
    ({"api_key": "   "}, "is empty"),
])
def test_serve_flags_that_would_misbehave_are_refused(target_dir, kwargs, message):
    with pytest.raises(ServeError, match=message):
        TritonServer({"target_dir": target_dir}, **kwargs)


@pytest.mark.unit
def test_non_loopback_host_warns():
    assert host_warning("127.0.0.1") is None and host_warning("localhost") is None and host_warning("::1") is None
    for host in ("0.0.0.0", "192.168.1.5", "example.org"):
        assert "trusted network" in host_warning(host)


# --------------------------------------------------------------------------- client deadlines


class _Trickle(http.server.BaseHTTPRequestHandler):
    """Answers 200 and then one byte every 50 ms, forever: every read succeeds, the response never completes."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        try:
            self.wfile.write(b'data: {"text_output": "a"}\n\n')
            while True:
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:  # the client gave up
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def trickle_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Trickle)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("stream", [True, False])
def test_trickling_response_hits_the_request_deadline(trickle_url, stream):
    """A socket timeout bounds each read only; the request's deadline bounds the whole response."""
    with pytest.raises(TimeoutError, match=r"deadline passed: no complete response within 1\.5s"):
        http_generate(trickle_url, "hi", 4, stream=stream, timeout=1.5)


def test_load_run_has_one_deadline(trickle_url):
    """Requests get the run's remaining time, not their own (longer) timeout; the rest never start."""
    summary, results = load_run(["hi"], concurrency=2, requests=6, http=True, url=trickle_url, timeout=600,
                                run_timeout=1.0)
    assert results == [None] * 6 and summary["errors"] == 6
    assert all("deadline" in e for e in summary["first_errors"]), summary["first_errors"]


def test_serve_splits_the_cpus_it_may_use_between_instances_and_says_so(stub_target):
    """Pinned to one CPU (taskset -c N), two instances get one thread each, and the start line says so; then it
    stops cleanly (SIGTERM during the start)."""
    import os
    import sys

    cpu = min(os.sched_getaffinity(0))
    cmd = [sys.executable, "-m", "spectrt", "serve", "--target", str(stub_target), "--draft", "none",
           "--instances", "2", "--max-seq-len", "128", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    try:
        lines = []
        while len(lines) < 20 and not any("starting tritonserver" in line for line in lines):  # among the first
            lines.append(proc.stdout.readline())
        start = lines[-1]
        assert "2 instance(s), 1 thread(s) each of 1 usable CPU(s)" in start, start
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
