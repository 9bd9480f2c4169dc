"""Tie a tritonserver to its launcher: start it, and when the launcher ends, however it ends, stop it and clean up.

The launcher (`serve.TritonServer`) can end without running any Python cleanup: SIGKILL, a terminal closed while
it stops, an interpreter crash. So this small process (standard library only, run by path) sits between them:

    launcher --stdin pipe--> supervise.py (own session) --> tritonserver (own process group) --> python stubs
                                                        `--> the OpenAI frontend, if asked (own process group)

- It runs in its own session, so Ctrl-C and the SIGHUP of a closed terminal reach the launcher, never it.
- The launcher writes "stop" on its stdin to stop the server; the launcher's death closes that pipe (EOF), which
  means the same. SIGINT, SIGTERM and SIGHUP sent to this process directly mean stop too.
- Stopping: SIGINT to the server (in-flight requests get `exit_timeout` seconds), then SIGKILL to its whole
  process group while the server's PID is still unreaped (so the group id cannot have been reused), reaping every
  leftover stub (this process is their subreaper), removing the python backend's /dev/shm regions (our unique
  prefix) and, if told to, the run directory. Further signals during the stop are ignored: it always finishes.
- The server gets PR_SET_PDEATHSIG=SIGKILL, so even a SIGKILL of this process cannot leave it running.
- The frontend (optional) is started and stopped with the server, and gets the same PDEATHSIG. It is stopped first
  (SIGTERM: its open answers get the drain, then a stream still open ends with an error event and its connection
  closes, which cancels its request upstream; SIGKILL to its group after `grace` seconds), and if
  either process exits on its own the other is stopped too: the deployment is up as a whole or not at all.
- A python backend stub that dies (a segfault, the OOM killer) is never restarted by tritonserver 2.51 for a
  decoupled model: its requests hang and the server stays "ready" for good. So the stubs (tritonserver's children)
  are watched: when one that ran dies, the server's whole group is killed at once (its open streams end: the
  frontend answers each with an error, and every health endpoint says not ready) and a fresh server starts on the
  same ports, with SPECTRT_SERVER_RESTARTS in its environment (the model counts it). At most `max_restarts` in
  RESTART_WINDOW seconds; past that the deployment stops, for whatever runs it to decide.

Argument: one JSON object {command, cwd, log (file or null: inherit stdout), shm_prefix, remove_dir (or null),
exit_timeout, report_fd, frontend (null or {command, log, grace: seconds from its SIGTERM to SIGKILL}),
max_restarts, ready_url (the server's /v2/health/ready: stubs are watched once it first answers)}. On report_fd it
writes "pid N" once the server runs (again after each restart, preceded by "restart K"), "frontend_pid N" once the
frontend does, "frontend_exit CODE" once the frontend is stopped and reaped, and "exit CODE" once the server has
exited and its group is reaped; the run directory goes only after the launcher's "stop" (or death), so that a
launcher whose server died can still read the log.
"""

from __future__ import annotations

import ctypes
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
STUB_NAME = "triton_python_b"  # the python backend stub's comm (triton_python_backend_stub, cut to 15 characters)
RESTART_WINDOW = 600.0  # seconds over which max_restarts counts
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the preexec hook only calls into it


def _die_with(parent: int) -> None:
    """preexec hook of the server: SIGKILL when this supervisor dies (and exit if it is already gone)."""
    _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _exited(pid: int) -> bool:
    """Has `pid` exited? Leaves it unreaped (WNOWAIT): its PID, and so its process group id, stay ours."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def sweep_shm(prefix: str) -> None:
    """Remove the /dev/shm entries starting with `prefix` (regions of a killed server or stub)."""
    if prefix:
        for path in Path("/dev/shm").glob(prefix + "*"):
            try:
                path.unlink()
            except OSError:
                pass


def stop(proc: subprocess.Popen, exit_timeout: float) -> int:
    """SIGINT, up to exit_timeout + 10 s for a graceful exit, then SIGKILL the group; reap it all."""
    if not _exited(proc.pid):
        os.kill(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + exit_timeout + 10
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the stubs (and a server that ignored SIGINT); the group id is safe
    except (ProcessLookupError, PermissionError):
        pass
    code = proc.wait()
    deadline = time.monotonic() + 10  # the stubs, re-parented to us (subreaper), die from the SIGKILL above
    while time.monotonic() < deadline:
        try:
            if os.waitpid(-1, os.WNOHANG) == (0, 0):
                time.sleep(0.05)
        except ChildProcessError:
            break
    return code


def stubs(server: int) -> set[int]:
    """The live python backend stubs of tritonserver `server` (its children named STUB_NAME; a zombie is dead)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name == STUB_NAME and int(fields[1]) == server and fields[0] not in "ZX":
            found.add(int(entry.name))
    return found


def _ready(url: str | None) -> bool:
    """tritonserver's /v2/health/ready answers 200 (no url: never, so no stub is watched)."""
    if not url:
        return False
    try:
        with urllib.request.urlopen(url, timeout=1) as answer:
            return answer.status == 200
    except OSError:
        return False


def kill_now(proc: subprocess.Popen) -> int:
    """SIGKILL the server's group at once (a dead stub's requests are lost already) and reap it and its stubs."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return stop(proc, 0)


def stop_frontend(proc: subprocess.Popen, grace: float = 5.0) -> int:
    """SIGTERM (its open streams are cancelled upstream), `grace` seconds, then SIGKILL its group; reap it."""
    if not _exited(proc.pid):
        os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while not _exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # unreaped, so the group id is still its own
    except (ProcessLookupError, PermissionError):
        pass
    return proc.wait()


def main(spec: dict) -> int:
    report = os.fdopen(spec["report_fd"], "w", buffering=1)
    stopping = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stopping.append(True))
    _LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    log = open(spec["log"], "ab") if spec["log"] else None  # noqa: SIM115 (open for the server's lifetime)
    front_spec = spec.get("frontend")
    front_log = open(front_spec["log"], "ab") if front_spec and front_spec["log"] else None  # noqa: SIM115
    code = front = None
    try:
        parent = os.getpid()

        def start_server(restarts: int) -> subprocess.Popen:
            env = {**os.environ, "SPECTRT_SERVER_RESTARTS": str(restarts)}
            return subprocess.Popen(spec["command"], cwd=spec["cwd"], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT if log else None, start_new_session=True, env=env,
                                    preexec_fn=lambda: _die_with(parent))

        proc, restarts, recent = start_server(0), 0, []
        _say(report, f"pid {proc.pid}")
        if front_spec:
            front = subprocess.Popen(front_spec["command"], cwd=spec["cwd"], stdin=subprocess.DEVNULL,
                                     stdout=front_log, stderr=subprocess.STDOUT if front_log else None,
                                     start_new_session=True, preexec_fn=lambda: _die_with(parent))
            _say(report, f"frontend_pid {front.pid}")
        with selectors.DefaultSelector() as sel:
            sel.register(sys.stdin.fileno(), selectors.EVENT_READ)  # "stop", or EOF when the launcher is gone
            watched: set[int] | None = None  # stubs seen running since the server was first ready
            while True:
                dead = set()
                while (not stopping and not _exited(proc.pid) and not (front and _exited(front.pid))
                       and not sel.select(timeout=0.2)):
                    if watched is None:  # loading: Triton runs (and ends) a stub of its own to read the config
                        if not _ready(spec.get("ready_url")):
                            continue
                        watched = stubs(proc.pid)
                        if not watched:  # ready, yet no stub: it died before this first look (a PID not known)
                            dead = {0}
                            break
                        continue
                    alive = stubs(proc.pid)
                    dead, watched = watched - alive, watched | alive
                    if dead:
                        break
                if not dead or stopping or _exited(proc.pid):
                    break
                now = time.monotonic()
                recent = [t for t in recent if now - t < RESTART_WINDOW] + [now]
                which = f"python stub(s) {sorted(dead)}" if 0 not in dead else \
                    "the python stub (gone before it was seen)"
                if len(recent) > spec.get("max_restarts", 3):
                    _log(log, f"{which} died: {len(recent) - 1} restarts in the last {RESTART_WINDOW:g} s already, "
                              "stopping the deployment")
                    break
                restarts += 1
                _log(log, f"{which} died: restarting tritonserver (restart {restarts}; its open requests end with "
                          "an error)")
                kill_now(proc)
                sweep_shm(spec["shm_prefix"])
                proc, watched = start_server(restarts), None
                _say(report, f"restart {restarts}")
                _say(report, f"pid {proc.pid}")
            if front is not None:
                _say(report, f"frontend_exit {stop_frontend(front, front_spec.get('grace', 5.0))}")
            code = stop(proc, spec["exit_timeout"])
            sweep_shm(spec["shm_prefix"])
            _say(report, f"exit {code}")
            while not stopping and not sel.select(timeout=0.2):  # the server exited on its own: the launcher
                pass  # still reads the log, so the run directory stays until it says stop (or dies)
    finally:
        if front is not None and front.returncode is None:  # an error above: the frontend must not outlive us
            stop_frontend(front, grace=0)
        for f in (log, front_log):
            if f is not None:
                f.close()
        sweep_shm(spec["shm_prefix"])
        if spec["remove_dir"]:
            shutil.rmtree(spec["remove_dir"], ignore_errors=True)
        if code is None:
            _say(report, "exit None")  # the server could not be started
        try:
            report.close()
        except OSError:
            pass
    return 0


def _log(log, line: str) -> None:
    """A line in the server's log (or this process's stderr where the server writes to the console)."""
    text = f"spectrt supervisor: {line}\n"
    if log is not None:
        log.write(text.encode())
        log.flush()
    else:
        sys.stderr.write(text)


def _say(report, line: str) -> None:
    try:
        report.write(line + "\n")
    except OSError:  # the launcher is gone: nobody reads the report, the cleanup goes on
        pass


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
