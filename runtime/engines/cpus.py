"""How many threads the native forward should run: the CPUs this process may actually use, not the machine's cores.

Why: a thread more than the process can run at once is a thread the OS deschedules, and every parallel loop then
waits for the chunk it holds. Two limits bound the usable CPUs: the affinity mask (`taskset`, a cpuset, a container's
`--cpuset-cpus`) and the cgroup CPU quota (`cpu.max`, what a Kubernetes CPU limit or `docker --cpus` sets: 1.5 CPUs
of time a period however many cores are visible). torch's own default counts only the first.
`--threads` (and OMP_NUM_THREADS, as torch reads it) override the choice.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _v2_limit(text: str) -> float | None:
    """CPUs of one cgroup v2 `cpu.max` ('QUOTA PERIOD' or 'max PERIOD'), None when unlimited or unreadable."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_limit(folder: Path) -> float | None:
    """CPUs of one cgroup v1 cpu controller folder (cpu.cfs_quota_us / cpu.cfs_period_us; -1: unlimited)."""
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """The CPU time this process's cgroup may use, in CPUs (1.5: one and a half cores' time), or None if unlimited.

    A limit set on any ancestor binds too, so the smallest one on the path from the process's cgroup up to the
    mount's root counts (inside a container the mount's root is the container's own cgroup)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not path.startswith("/"):
            continue
        if hierarchy == "0" and controllers == "":  # cgroup v2, one unified hierarchy
            unified = root if (root / "cgroup.controllers").exists() or not (root / "unified").is_dir() \
                else root / "unified"  # a hybrid set-up mounts v2 beside the v1 controllers
            folders, read = _ancestors(unified, path), lambda f: _v2_limit(_read(f / "cpu.max"))
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own hierarchy
            mount = next((root / name for name in (controllers, "cpu", "cpu,cpuacct") if (root / name).is_dir()), None)
            if mount is None:
                continue
            folders, read = _ancestors(mount, path), _v1_limit
        else:
            continue
        limits += [limit for limit in map(read, folders) if limit is not None]
    return min(limits) if limits else None


def _ancestors(mount: Path, path: str) -> list[Path]:
    """mount/path and each of its parents up to the mount itself."""
    parts = [p for p in path.split("/") if p and p not in (".", "..")]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (all online CPUs where the platform has no such call)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def usable_cpus(affinity: int | None = None, limit: float | None = None) -> int:
    """CPUs this process can keep busy at once: its affinity mask, capped by the cgroup quota (rounded up: 1.5 CPUs
    of time keep two threads busy most of each period), at least 1. Arguments default to this process's own."""
    affinity = affinity_cpus() if affinity is None else affinity
    limit = cgroup_cpu_limit() if limit is None else limit
    return max(1, min(affinity, math.ceil(limit)) if limit else affinity)


def default_threads(instances: int = 1) -> int:
    """Threads for each of `instances` model copies sharing this process's CPUs: the usable CPUs split evenly."""
    return max(1, usable_cpus() // max(1, instances))


def apply_threads(threads: int = 0) -> int:
    """Set the threads every native and torch parallel loop of this process runs on and return the count: `threads`
    when positive, else OMP_NUM_THREADS where the user set it, else `default_threads()`."""
    import torch

    if threads <= 0:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        threads = int(env) if env.isdigit() and int(env) > 0 else default_threads()
    torch.set_num_threads(threads)
    return threads
