"""Run the real Triton Inference Server (the `tritonserver` binary shipped in the `nvidia-pytriton` wheel).

`TritonServer` lays out a run directory, starts the server on 127.0.0.1 and always cleans up:

    <run dir>/models/<model>/   a copy of triton_repo/spectrt with the deploy-time parameters written into
                                its config.pbtxt (absolute paths, instance count)
    <run dir>/backends/python/  libtriton_python.so, triton_python_backend_utils.py and the stub built for
                                this interpreter's Python version (symlinks into the wheel)
    <run dir>/server.log        the server's stdout and stderr

Environment: LD_LIBRARY_PATH gets the interpreter's `lib/` (libpython for the stub) and the wheel's
`nvidia_pytriton.libs`; this virtualenv's `bin/` goes first on PATH because the stub finds its Python
through PATH (PYTHONPATH is ignored: spectrt must be installed into that environment).

The server gets its own process group. If the stub cannot load its libraries the server never becomes
ready and never exits, so readiness has a timeout, stopping is by PID (SIGINT, then SIGKILL of the whole
group) and the python backend's shared-memory regions (our own unique prefix under /dev/shm) are swept
after every stop, normal or not. An atexit hook stops any server still running when Python exits.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REPOSITORY = REPO_ROOT / "triton_repo"
DEFAULT_MODEL = "spectrt"
SHM_DIR = Path("/dev/shm")
SHM_GENERIC_PREFIX = "triton_python_backend_shm_region_"
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sweep_shm(prefix: str) -> list[str]:
    """Remove /dev/shm entries starting with `prefix` (regions a killed server or stub left behind)."""
    removed = []
    if not prefix or not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.glob(prefix + "*"):
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path.name)
    return removed


# --------------------------------------------------------------------------- the server process


class TritonServer:
    """One tritonserver process serving a spectrt model repository; use as a context manager or start()/stop()."""

    def __init__(self, params: dict[str, object] | None = None, *, instances: int | None = None,
                 model: str = DEFAULT_MODEL, served_name: str | None = None, repository: Path = DEFAULT_REPOSITORY,
                 host: str = "127.0.0.1", http_port: int = 0, grpc_port: int = 0, metrics_port: int = 0,
                 ready_timeout: float = 180.0, exit_timeout: int = 10, run_dir: Path | None = None,
                 log_verbose: int = 0, console: bool = False):
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
        self._own_run_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else None
        self.log_verbose, self.console = log_verbose, console
        self.proc: subprocess.Popen | None = None
        self.shm_prefix = f"{SHM_GENERIC_PREFIX}spectrt{os.getpid()}x{os.urandom(3).hex()}_"
        self._log = None

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
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def log_path(self) -> Path:
        return self.run_dir / "server.log"

    def endpoints(self) -> dict[str, str]:
        return {"grpc": self.grpc_url, "http": self.http_url, "metrics": self.metrics_url,
                "generate": f"{self.http_url}/v2/models/{self.served_name}/generate",
                "generate_stream": f"{self.http_url}/v2/models/{self.served_name}/generate_stream",
                "model": self.served_name}

    # lifecycle ---------------------------------------------------------------------------------------
    def command(self) -> list[str]:
        dist = pytriton_dist()
        return [
            str(dist / "bin" / "tritonserver"),
            f"--model-repository={self.run_dir / 'models'}",
            f"--backend-directory={self.run_dir / 'backends'}",
            f"--cache-directory={dist / 'caches'}",
            f"--http-address={self.host}", f"--http-port={self.http_port}",
            f"--grpc-address={self.host}", f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}", f"--metrics-port={self.metrics_port}",
            "--allow-gpu-metrics=false", "--allow-cpu-metrics=true",
            "--strict-readiness=true", f"--exit-timeout-secs={self.exit_timeout}", "--exit-on-error=true",
            "--backend-config=python,shm-default-byte-size=4194304",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--log-verbose={self.log_verbose}",
        ]

    def prepare(self) -> None:
        if self.run_dir is None:
            self.run_dir = Path(tempfile.mkdtemp(prefix="spectrt-triton-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        models = self.run_dir / "models"
        if models.exists():
            shutil.rmtree(models)
        prepare_model_repository(models, self.repository, self.model, self.params, self.instances, self.served_name)
        prepare_backends(self.run_dir / "backends")

    def start(self) -> TritonServer:
        if self.proc is not None:
            raise ServeError("this server is already started")
        self.prepare()
        out = None if self.console else open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        self._log = out
        self.proc = subprocess.Popen(self.command(), env=server_env(), cwd=self.run_dir, stdin=subprocess.DEVNULL,
                                     stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True)
        _RUNNING.add(self)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise ServeError(f"tritonserver exited with code {code} before it was ready\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"tritonserver was not ready after {self.ready_timeout:.0f}s (pid {self.pid}); "
                           f"stopped it\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        if self.run_dir is None or not self.log_path.is_file():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(["--- server log (tail) ---", *text[-lines:]])

    def stop(self, keep_run_dir: bool = False) -> int | None:
        """SIGINT (graceful: in-flight requests get exit_timeout seconds), then SIGKILL the process group."""
        code = None
        if self.proc is not None:
            pgid = self.proc.pid  # start_new_session=True: the server leads its own group (the stubs are in it)
            if self.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGINT)
                try:
                    self.proc.wait(timeout=self.exit_timeout + 10)
                except subprocess.TimeoutExpired:
                    pass
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)  # stubs left behind, or a server that ignored SIGINT
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
            code = self.proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        sweep_shm(self.shm_prefix)
        _RUNNING.discard(self)
        if self._own_run_dir and not keep_run_dir and self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return code

    def __enter__(self) -> TritonServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for server in list(_RUNNING):
        server.stop()


# --------------------------------------------------------------------------- command line


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Flags of `spectrt serve` (the lead wires them into cli.py; `python -m spectrt.runtime.serve` uses them too)."""
    p.add_argument("--target", help="HF checkpoint dir or .gguf (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="draft checkpoint dir, or 'none' for the target alone "
                                   "(default: the target's distilled draft in --artifacts)")
    p.add_argument("--engines", type=Path, default=None,
                   help="engines/<name> dir from `spectrt engines` (replaces --target/--draft; see --backend)")
    p.add_argument("--artifacts", type=Path, default=None, help="where converted models live (default: artifacts)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"],
                   help="onnxruntime/tensorrt run the graphs/plans of --engines; torch runs checkpoints")
    p.add_argument("--tree", default=None, help="default tree of the served model, e.g. 2,1 (requests may override)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="context per KV slot (prompt + output)")
    p.add_argument("--max-tokens-limit", type=int, default=1024, help="largest max_tokens a request may ask for")
    p.add_argument("--instances", type=int, default=1,
                   help="model instances, each a full model copy batching up to max_active requests (config.pbtxt)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per instance (0: cores / instances)")
    p.add_argument("--model-name", default=DEFAULT_MODEL, help="name the model is served under")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for readiness")
    p.add_argument("--run-dir", type=Path, default=None, help="where to write the deployed repository and log")
    p.add_argument("--log", action="store_true", help="server log to the terminal instead of <run dir>/server.log")
    p.add_argument("--log-verbose", type=int, default=0, help="Triton verbose level (1: one line per request)")


def model_params(args: argparse.Namespace) -> dict[str, object]:
    """Resolve the CLI's model flags into the model's config.pbtxt parameters (absolute paths)."""
    params: dict[str, object] = {"backend": args.backend, "dtype": args.dtype, "max_seq_len": args.max_seq_len,
                                 "max_tokens_limit": args.max_tokens_limit, "threads": args.threads}
    if args.tree:
        params["tree"] = args.tree
    if args.engines:
        engines = Path(args.engines).resolve()
        if not (engines / "manifest.json").is_file():
            raise ServeError(f"{engines} has no manifest.json: build it with `spectrt engines` (make engines)")
        params.update(engine_dir=engines, target_dir="", draft_dir="")
        return params
    if args.backend != "torch":
        raise ServeError(f"--backend {args.backend} runs built engines: pass --engines engines/<name>")
    from spectrt.build.checkpoint import DEFAULT_ARTIFACTS, default_draft, resolve_target

    artifacts = args.artifacts or DEFAULT_ARTIFACTS
    target = resolve_target(args.target, artifacts).resolve()
    if args.draft and args.draft.lower() == "none":
        draft = "none"
    else:
        draft_path = Path(args.draft) if args.draft else default_draft(target, artifacts)
        if not draft_path.is_dir():
            raise ServeError(f"draft {draft_path} does not exist: build one with `spectrt draft`, pass --draft DIR, "
                             "or --draft none to serve the target alone")
        draft = draft_path.resolve()
    params.update(target_dir=target, draft_dir=draft, engine_dir="")
    return params


def cmd_serve(args: argparse.Namespace) -> int:
    """`spectrt serve`: start the real tritonserver, wait for readiness, print the endpoints, stop on Ctrl-C."""
    try:
        params = model_params(args)
    except ServeError as e:
        print(f"spectrt serve: error: {e}", file=sys.stderr)
        return 2
    server = TritonServer(params, instances=args.instances, served_name=args.model_name, host=args.host,
                          http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
                          ready_timeout=args.ready_timeout, run_dir=args.run_dir, console=args.log,
                          log_verbose=args.log_verbose)

    def _terminate(*_):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _terminate) for sig in (signal.SIGTERM, signal.SIGINT)}  # SIGINT too:
    # a background job of a non-interactive shell starts with SIGINT ignored
    try:
        print(f"starting tritonserver (model {args.model_name}, {args.instances} instance(s)) ...", flush=True)
        try:
            server.start()
        except (ServeError, TimeoutError) as e:
            print(f"spectrt serve: error: {e}", file=sys.stderr)
            return 2
        ends = server.endpoints()
        print(json.dumps({**ends, "pid": server.pid, "run_dir": str(server.run_dir)}, indent=2))
        print(f"ready: gRPC {ends['grpc']} | HTTP {ends['http']} | metrics {ends['metrics']}  (Ctrl-C stops)",
              flush=True)
        while server.proc.poll() is None:
            time.sleep(0.5)
        print(f"tritonserver exited with code {server.proc.returncode}\n{server.log_tail()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping tritonserver ...", file=sys.stderr, flush=True)
        return 0
    finally:
        code = server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if code is not None:
            print(f"tritonserver stopped (exit code {code})", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="spectrt serve", description=cmd_serve.__doc__)
    add_serve_args(parser)
    args = parser.parse_args(argv)
    try:
        sys.exit(cmd_serve(args))
    except (ServeError, ValueError, FileNotFoundError, TimeoutError) as e:
        print(f"spectrt serve: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
