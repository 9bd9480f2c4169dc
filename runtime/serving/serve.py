"""Run the real Triton Inference Server (the `tritonserver` binary shipped in the `nvidia-pytriton` wheel).

`TritonServer` lays out a fresh run directory (a temporary one, or a new subdirectory of `run_dir`: it never
writes into, or deletes, a directory it did not create), starts the server on 127.0.0.1 and always cleans up:

    <run dir>/models/<model>/   a copy of triton_repo/spectrt with the deploy-time parameters written into
                                its config.pbtxt (absolute paths, instance count)
    <run dir>/backends/python/  libtriton_python.so, triton_python_backend_utils.py and the stub built for
                                this interpreter's Python version (symlinks into the wheel)
    <run dir>/server.log        the server's stdout and stderr
    <run dir>/openai.log        the OpenAI frontend's log (with `openai_port`: runtime/serving/openai_frontend.py,
                                started as `python -m spectrt.cli.openai_frontend`)
    <run dir>/admin-key         the key of the restricted admin APIs (model repository, shared memory, trace,
                                logging): HTTP header ADMIN_HEADER, gRPC metadata GRPC_ADMIN_HEADER

Environment: LD_LIBRARY_PATH gets the interpreter's `lib/` (libpython for the stub) and the wheel's
`nvidia_pytriton.libs`; this virtualenv's `bin/` goes first on PATH because the stub finds its Python
through PATH (PYTHONPATH is ignored: spectrt must be installed into that environment).

With `openai_port`, the OpenAI-compatible frontend runs next to the server under the same supervisor (started,
stopped and cleaned up with it; readiness waits for both).

The server runs under `supervise.py` (its own session; see there), which stops it, kills its process group,
sweeps the python backend's shared-memory regions (our own unique prefix under /dev/shm) and removes a
temporary run directory when told to stop or when this process dies, however it dies. If the stub cannot
load its libraries the server never becomes ready and never exits, so readiness has a timeout. An atexit
hook stops any server still running when Python exits.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import ipaddress
import json
import os
import re
import secrets
import select
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from spectrt.runtime.resources import package_path
from spectrt.runtime.serving.supervise import sweep_shm

DEFAULT_REPOSITORY = package_path("triton_repo")  # shipped inside the package (a checkout's own in an editable install)
DEFAULT_MODEL = "spectrt"
SHM_DIR = Path("/dev/shm")
SHM_GENERIC_PREFIX = "triton_python_backend_shm_region_"
SUPERVISOR = package_path("runtime/serving/supervise.py")
ADMIN_HEADER = "spectrt-admin-key"  # the HTTP header the restricted APIs require
GRPC_ADMIN_HEADER = f"triton-grpc-protocol-{ADMIN_HEADER}"  # the gRPC metadata key (Triton adds this prefix)
RESTRICTED_APIS = ("model-repository", "shared-memory", "trace", "logging")
_RUNNING: set[TritonServer] = set()


class ServeError(RuntimeError):
    """The server could not be set up or started; the message says why (with the log's tail)."""


# --------------------------------------------------------------------------- layout and environment


def pytriton_dist() -> Path:
    """The `tritonserver` distribution inside the installed nvidia-pytriton wheel (located, never imported)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServeError(
            "nvidia-pytriton is not installed in this environment: "
            ".venv/bin/pip install --no-deps nvidia-pytriton==0.7.0 tritonclient==2.51.0"
        )
    dist = Path(list(spec.submodule_search_locations)[0]).resolve() / "tritonserver"
    if not (dist / "bin" / "tritonserver").is_file():
        raise ServeError(f"{dist}/bin/tritonserver is missing: reinstall nvidia-pytriton==0.7.0")
    return dist


def prepare_backends(dest: Path) -> Path:
    """backends/python/ with the python backend library, its utils module and the stub for this Python."""
    dist = pytriton_dist()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServeError(f"nvidia-pytriton ships no python backend stub for Python {version} ({stub})")
    python = Path(dest) / "python"
    python.mkdir(parents=True, exist_ok=True)
    for name, source in (("libtriton_python.so", dist / "backends/python/libtriton_python.so"),
                         ("triton_python_backend_utils.py", dist / "backends/python/triton_python_backend_utils.py"),
                         ("triton_python_backend_stub", stub)):
        link = python / name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source)
    return Path(dest)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    dist = pytriton_dist()
    libs = [sysconfig.get_config_var("LIBDIR") or str(Path(sys.base_prefix) / "lib"),
            str(dist.parent.parent / "nvidia_pytriton.libs")]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(libs)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env.setdefault("OMP_NUM_THREADS", "1")  # instances set their torch threads themselves (model parameter)
    return env


def _quote(value: str) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_config(config_text: str, params: dict[str, object] | None = None, instances: int | None = None,
                 max_batch_size: int | None = None) -> str:
    """Return config.pbtxt text with model parameters (string_value), instance count and batch size replaced."""
    text = config_text
    for key, value in (params or {}).items():
        if value is None:
            continue
        pattern = re.compile(r'(key:\s*"' + re.escape(key) + r'"\s*value:\s*\{\s*string_value:\s*)"(?:[^"\\]|\\.)*"')
        new, count = pattern.subn(lambda m, v=value: m.group(1) + _quote(str(v)), text)
        if count == 0:
            entry = f"parameters: {{ key: {_quote(key)} value: {{ string_value: {_quote(str(value))} }} }}"
            new = f"{text.rstrip()}\n{entry}\n"
        text = new
    if instances is not None:
        text, count = re.subn(r"(instance_group\s*\[\s*\{[^}]*?count:\s*)\d+", lambda m: m.group(1) + str(instances),
                              text)
        if count != 1:
            raise ServeError("config.pbtxt needs exactly one instance_group with a count")
    if max_batch_size is not None:
        text = re.sub(r"max_batch_size:\s*\d+", f"max_batch_size: {max_batch_size}", text)
    return text


def prepare_model_repository(dest: Path, source: Path = DEFAULT_REPOSITORY, model: str = DEFAULT_MODEL,
                             params: dict[str, object] | None = None, instances: int | None = None,
                             served_name: str | None = None) -> Path:
    """Copy `source/model` into `dest/<served_name>` and write the deploy-time parameters into its config."""
    src = Path(source) / model
    if not (src / "config.pbtxt").is_file():
        raise ServeError(f"{src} is not a Triton model (no config.pbtxt)")
    out = Path(dest) / (served_name or model)
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    config = out / "config.pbtxt"
    config.write_text(write_config(config.read_text(), params, instances))
    return Path(dest)


def tokenizer_dir(params: dict[str, object]) -> Path:
    """The served target's directory (tokenizer and chat template) from the model parameters, as the model picks it:
    engine_dir's target for its backend, else target_dir, else the embedded default in artifacts/."""
    engine = str(params.get("engine_dir") or "")
    if engine:
        from spectrt.runtime.engines.onnx_engine import engine_models

        return Path(engine_models(Path(engine), str(params.get("backend") or "torch"))[0]).resolve()
    target = str(params.get("target_dir") or "")
    if target:
        return Path(target).resolve()
    from spectrt.runtime.engines.checkpoint import resolve_target

    return resolve_target().resolve()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- the server process


class TritonServer:
    """One tritonserver process serving a spectrt model repository; use as a context manager or start()/stop().

    The server runs under `supervise.py`, which stops it and cleans up when this process ends, however it ends.
    `run_dir=None`: a temporary run directory, removed at stop. `run_dir=DIR`: a fresh `spectrt-triton-*`
    subdirectory of DIR, kept at stop (its server.log); nothing else in DIR is read, changed or removed.
    """

    def __init__(self, params: dict[str, object] | None = None, *, instances: int | None = None,
                 model: str = DEFAULT_MODEL, served_name: str | None = None, repository: Path = DEFAULT_REPOSITORY,
                 host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 ready_timeout: float = 180.0, exit_timeout: int = 10, run_dir: Path | None = None,
                 log_verbose: int = 0, console: bool = False, admin_key: str | None = None,
                 openai_port: int | None = None, openai_host: str | None = None, openai_timeout: float = 600.0,
                 tokenizer: Path | None = None, api_key: str | None = None, allowed_origins: str = "",
                 max_restarts: int = 3):
        # Path values are made absolute here (the deployed copy lives elsewhere); strings are written as given,
        # and the model resolves relative ones against the model repository's parent directory
        self.params = {k: (str(Path(v).resolve()) if isinstance(v, Path) else v) for k, v in (params or {}).items()}
        self.instances = instances
        self.model, self.served_name = model, served_name or model
        self.repository = Path(repository)
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.ready_timeout, self.exit_timeout = ready_timeout, exit_timeout
        self.run_parent = Path(run_dir) if run_dir else None
        self.run_dir: Path | None = None  # created by prepare()
        self.log_verbose, self.console = log_verbose, console
        # the OpenAI frontend (None: none); its tokenizer (chat template) is the served target's unless given
        self.openai_host = openai_host or host
        self.openai_port = None if openai_port is None else (openai_port or free_port(self.openai_host))
        self.openai_timeout = openai_timeout
        # the model's drain at stop (its drain_seconds parameter), which the frontend's open answers get too
        self.drain_seconds = float(self.params.get("drain_seconds") or 5.0)
        self.api_key = api_key  # the OpenAI endpoint's; handed over in a file of the run dir, not on a command line
        self.allowed_origins = allowed_origins  # the OpenAI endpoint's CORS origins (comma-separated)
        if max_restarts < 0:
            raise ServeError(f"max_restarts must be >= 0, got {max_restarts}")
        self.max_restarts = max_restarts  # server restarts after a python stub died, per 10 minutes (supervise.py)
        self.tokenizer = Path(tokenizer).resolve() if tokenizer else None
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", self.served_name):  # a folder of the repository
            raise ServeError(f"--model-name {self.served_name!r} is not a model name: use letters, digits and ._- "
                             "(starting with a letter or digit), e.g. spectrt or smollm2-135m")
        if not openai_timeout > 0:
            raise ServeError(f"--openai-timeout must be a positive number of seconds, got {openai_timeout:g}")
        if api_key is not None and not api_key.strip():
            raise ServeError("--api-key (or $SPECTRT_API_KEY) is empty, which would leave the OpenAI endpoint open: "
                             "give a key, or unset it to serve without one")
        if admin_key is not None and not re.fullmatch(r"[A-Za-z0-9._~-]{16,}", admin_key):
            raise ServeError("the admin key must be 16 or more letters, digits or ._~- "
                             "(e.g. `python -c 'import secrets; print(secrets.token_hex(16))'`)")
        self.admin_key = admin_key or secrets.token_hex(16)
        self.shm_prefix = f"{SHM_GENERIC_PREFIX}spectrt{os.getpid()}x{os.urandom(3).hex()}_"
        self.supervisor: subprocess.Popen | None = None
        self._report_fd: int | None = None
        self._reported: dict[str, str] = {}

    # endpoints ---------------------------------------------------------------------------------------
    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def openai_url(self) -> str | None:
        """The OpenAI API's base URL (http://host:port/v1), None without the frontend."""
        return None if self.openai_port is None else f"http://{self.openai_host}:{self.openai_port}/v1"

    @property
    def pid(self) -> int | None:
        """The tritonserver's PID (its parent is the supervisor)."""
        return int(self._reported["pid"]) if "pid" in self._reported else None

    @property
    def openai_pid(self) -> int | None:
        """The OpenAI frontend's PID (its parent is the supervisor)."""
        return int(self._reported["frontend_pid"]) if "frontend_pid" in self._reported else None

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    def endpoints(self) -> dict[str, str]:
        return {"grpc": self.grpc_url, "http": self.http_url, "metrics": self.metrics_url,
                "generate": f"{self.http_url}/v2/models/{self.served_name}/generate",
                "generate_stream": f"{self.http_url}/v2/models/{self.served_name}/generate_stream",
                "model": self.served_name, **({"openai": self.openai_url} if self.openai_url else {})}

    # lifecycle ---------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        dist = pytriton_dist()
        restricted = f"{','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}"
        return [
            str(dist / "bin" / "tritonserver"),
            f"--model-repository={self.run_dir / 'models'}",
            f"--backend-directory={self.run_dir / 'backends'}",
            f"--cache-directory={dist / 'caches'}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            f"--http-restricted-api={restricted}", f"--grpc-restricted-protocol={restricted}",
            "--allow-gpu-metrics=false", "--allow-cpu-metrics=true",
            "--strict-readiness=true", f"--exit-timeout-secs={self.exit_timeout}", "--exit-on-error=true",
            "--backend-config=python,shm-default-byte-size=4194304",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--log-verbose={self.log_verbose}",
        ]

    def frontend_command(self) -> list[str]:
        """The OpenAI frontend, against this server's gRPC port (loopback when Triton listens on every address)."""
        grpc_host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        tokenizer = self.tokenizer or tokenizer_dir(self.params)
        return [sys.executable, "-m", "spectrt.cli.openai_frontend",
                f"--grpc-url={grpc_host}:{self.grpc_port}",
                f"--model={self.served_name}", f"--tokenizer={tokenizer}", f"--host={self.openai_host}",
                f"--port={self.openai_port}", f"--timeout={self.openai_timeout:g}",
                f"--drain-seconds={self.drain_seconds:g}",
                *([f"--api-key-file={self.run_dir / 'api-key'}"] if self.api_key else []),
                *([f"--allowed-origins={self.allowed_origins}"] if self.allowed_origins else [])]

    def prepare(self) -> None:
        """A fresh run directory (never one that exists: we delete only what we made) with the model and backends."""
        if self.run_parent is not None:
            self.run_parent.mkdir(parents=True, exist_ok=True)
        self.run_dir = Path(tempfile.mkdtemp(prefix="spectrt-triton-", dir=self.run_parent))  # mode 0700
        prepare_model_repository(self.run_dir / "models", self.repository, self.model, self.params, self.instances,
                                 self.served_name)
        prepare_backends(self.run_dir / "backends")
        (self.run_dir / "admin-key").write_text(self.admin_key + "\n")
        if self.api_key:
            (self.run_dir / "api-key").write_text(self.api_key + "\n")

    def start(self) -> TritonServer:
        if self.supervisor is not None:
            raise ServeError("this server is already started")
        try:
            self.prepare()
            spec = {"command": self.command(), "cwd": str(self.run_dir),
                    "log": None if self.console else str(self.log_path), "shm_prefix": self.shm_prefix,
                    "remove_dir": None if self.run_parent else str(self.run_dir), "exit_timeout": self.exit_timeout,
                    "max_restarts": self.max_restarts, "ready_url": f"{self.http_url}/v2/health/ready",
                    "frontend": None if self.openai_port is None else {
                        "command": self.frontend_command(), "grace": self.drain_seconds + 5,
                        "log": None if self.console else str(self.run_dir / "openai.log")}}
            read_fd, write_fd = os.pipe()
            self._report_fd = read_fd
            try:
                self.supervisor = subprocess.Popen([sys.executable, str(SUPERVISOR), json.dumps(
                    {**spec, "report_fd": write_fd})], env=server_env(), stdin=subprocess.PIPE, pass_fds=(write_fd,),
                    start_new_session=True)
            finally:
                os.close(write_fd)
        except BaseException:
            self._remove_run_dir()
            raise
        _RUNNING.add(self)
        try:
            if not self._wait_report("pid", 60):
                raise ServeError(f"the supervisor could not start tritonserver (exit code {self.supervisor.poll()})")
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_report(self, key: str, timeout: float) -> bool:
        """Read the supervisor's report lines until `key` arrives (True), EOF or the timeout (False)."""
        deadline = time.monotonic() + timeout
        while key not in self._reported and self._report_fd is not None:
            ready, _, _ = select.select([self._report_fd], [], [], max(deadline - time.monotonic(), 0))
            if not ready:
                return False
            data = os.read(self._report_fd, 4096)
            if not data:
                os.close(self._report_fd)
                self._report_fd = None
                break
            for line in data.decode().splitlines():
                name, _, value = line.partition(" ")
                self._reported[name] = value
        return key in self._reported

    def poll(self) -> int | None:
        """The server's exit code once it has exited (on its own or stopped), else None."""
        if not self._wait_report("exit", 0):
            return None
        return None if self._reported["exit"] == "None" else int(self._reported["exit"])

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.poll() is not None or self.supervisor.poll() is not None:
                raise ServeError(f"tritonserver exited with code {self.poll()} before it was ready\n"
                                 f"{self.log_tail()}")
            if self.is_ready() and self.openai_ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"tritonserver was not ready after {self.ready_timeout:.0f}s (pid {self.pid}); "
                           f"stopped it\n{self.log_tail()}")

    def openai_ready(self) -> bool:
        """The frontend answers /health with 200 (it checks the model through Triton); True without a frontend."""
        if self.openai_port is None:
            return True
        try:
            host = "127.0.0.1" if self.openai_host in ("0.0.0.0", "::", "") else self.openai_host
            with urllib.request.urlopen(f"http://{host}:{self.openai_port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        if self.run_dir is None:
            return ""
        out = []
        for name, path in (("server", self.log_path), ("OpenAI frontend", self.run_dir / "openai.log")):
            if path.is_file():
                text = path.read_text(errors="replace").splitlines()
                out += [f"--- {name} log (tail) ---", *text[-lines:]]
        return "\n".join(out)

    def stop(self) -> int | None:
        """Tell the supervisor to stop the server (SIGINT, exit_timeout seconds, SIGKILL) and clean up; idempotent.

        Interrupting this wait changes nothing: the supervisor finishes the cleanup on its own.
        """
        sup = self.supervisor
        if sup is not None and sup.poll() is None:
            with contextlib.suppress(OSError):  # a dead supervisor's pipe: it cleaned up already
                sup.stdin.write(b"stop\n")
                sup.stdin.flush()
            try:
                sup.wait(timeout=self.exit_timeout + 40)
            except subprocess.TimeoutExpired:  # a wedged supervisor: its death kills the server (PDEATHSIG)
                sup.kill()
                sup.wait()
        if sup is not None and sup.stdin and not sup.stdin.closed:
            with contextlib.suppress(OSError):
                sup.stdin.close()
        self._wait_report("exit", 1 if sup is not None else 0)
        if self._report_fd is not None:
            os.close(self._report_fd)
            self._report_fd = None
        sweep_shm(self.shm_prefix)
        self._remove_run_dir()
        _RUNNING.discard(self)
        return self.poll()

    def _remove_run_dir(self) -> None:
        if self.run_parent is None and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start() if self.supervisor is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


def host_warning(host: str) -> str | None:
    """A warning when `host` is reachable from other machines (anything but a loopback address)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"--host {host} serves beyond this machine: inference is unauthenticated, the python backend of this "
            "bundled tritonserver 2.51 predates security fixes, and the admin key is visible in the local process "
            "list. Use it on a trusted network only; deploy triton_repo/ on a current Triton release instead.")


# A served stream's responses after its first carry at least this many tokens (the first text and a row's last are
# never held). Why 4, not 1: every response is CPU work in the instance (building and sending it), tritonserver and
# the client, on the cores the forward runs on. Measured (2-core Zen 4, bf16, AR, scripts/served_vs_inprocess.py):
# at 1 the decode thread spent 0.7-0.9 ms a step sending and the forward ran 5-8% slower than in process, served AR
# 0.84-0.91x in process; at 4 0.93x (0.925, 0.927, 0.939); at concurrency 8 the sends took 2.9 ms of a 17 ms step.
STREAM_INTERVAL = 4


def model_params(*, backend: str = "torch", dtype: str = "auto", max_seq_len: int = 2048,
                 max_tokens_limit: int = 1024, threads: int = 0, prefix_cache: bool = True,
                 stream_interval: int = STREAM_INTERVAL,
                 tree: str | None = None,
                 engines: Path | None = None, target: str | None = None, draft: str | None = None,
                 artifacts: Path | None = None) -> dict[str, object]:
    """The model's config.pbtxt parameters (absolute paths) from `spectrt serve`'s model choices."""
    params: dict[str, object] = {"backend": backend, "dtype": dtype, "max_seq_len": max_seq_len,
                                 "max_tokens_limit": max_tokens_limit, "threads": threads,
                                 "prefix_cache": str(prefix_cache).lower(), "stream_interval": stream_interval}
    if stream_interval < 1:
        raise ServeError(f"--stream-interval must be >= 1 token, got {stream_interval}")
    if tree:
        params["tree"] = tree
    if engines:
        engines = Path(engines).resolve()
        if not (engines / "manifest.json").is_file():
            raise ServeError(f"{engines} has no manifest.json: build it with `spectrt engines` (make engines)")
        params.update(engine_dir=engines, target_dir="", draft_dir="")
        return params
    if backend != "torch":
        raise ServeError(f"--backend {backend} runs built engines: pass --engines engines/<name>")
    from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS, CheckpointError, resolve_models

    try:
        target_dir, draft_dir = resolve_models(target, draft, artifacts or DEFAULT_ARTIFACTS)
    except CheckpointError as e:
        raise ServeError(str(e)) from None
    params.update(target_dir=target_dir.resolve(), draft_dir=draft_dir.resolve() if draft_dir else "none",
                  engine_dir="")
    return params
