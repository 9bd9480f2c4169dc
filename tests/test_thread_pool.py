"""The native forward's thread pool (runtime/engines/thread_pool.h) and the thread count it runs on (cpus.py):
logits bitwise the same on 1, 2 and 3 threads on every ISA build, work claimed as threads come (a late worker's share
taken by the caller), forwards correct beside a busy thread and beside another caller, and the thread count chosen
from the affinity mask and the cgroup CPU quota."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines import cpus, kernels
from spectrt.runtime.engines.model import Transformer

ISAS = kernels.runnable_isas()
THREAD_COUNTS = (1, 2, 3)


@pytest.fixture
def threads():
    """Set torch's (and so the pool's) thread count for one test, restored after."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _outputs(engine: Transformer) -> list[torch.Tensor]:
    """A 40-row causal prefill chunk's last logits, a tree's logits, and the K/V rows both wrote."""
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, 49152, (40,), generator=gen)
    tree = Tree.parse("3,2,1")
    tokens = torch.randint(0, 49152, (len(tree),), generator=gen)
    cache = engine.new_cache(128, 64)
    out = [engine.forward(prefix, torch.arange(40), torch.ones(40, 40, dtype=torch.bool).tril(), cache)[-2:].clone()]
    cache.commit(40)
    out.append(engine.forward(tokens, tree.positions(40), tree.mask, cache).clone())
    out.append(cache.k[:, :, :40 + len(tree)].clone())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "bf16dot"])
@pytest.mark.parametrize("isa", ISAS)
def test_logits_are_bitwise_the_same_on_any_thread_count(isa_engines, isa, dtype, threads):
    engine = isa_engines(isa, dtype)
    results = {}
    for n in THREAD_COUNTS:
        threads(n)
        before = engine.native.kernels.pool_stats()
        results[n] = _outputs(engine)
        after = engine.native.kernels.pool_stats()
        if n > 1:  # really on the pool: loops dispatched, workers started
            assert after["loops"] > before["loops"] and after["workers"] >= n - 1
    for n in THREAD_COUNTS[1:]:
        for mine, one in zip(results[n], results[1], strict=True):
            assert torch.equal(mine, one)


def test_workers_share_the_loops_when_they_are_awake(isa_engines, threads):
    """Both threads compute: over a few forwards the worker claims items too (run before the late-worker test, whose
    sleeping worker would take none for a second)."""
    engine = isa_engines(ISAS[0], torch.float32)
    module = engine.native.kernels
    threads(2)
    before = module.pool_stats()
    for _ in range(20):  # bounded: one forward is usually enough, a loaded machine may deschedule the worker a while
        _outputs(engine)
        if module.pool_stats()["worker_items"] > before["worker_items"]:
            break
    after = module.pool_stats()
    assert after["worker_items"] > before["worker_items"] and after["caller_items"] > before["caller_items"]


@pytest.mark.parametrize("isa", ISAS)
def test_a_late_worker_takes_nothing_and_holds_nothing_up(isa_engines, isa, threads):
    """Work is claimed, not assigned: with every worker asleep for seconds before it looks at a loop (as a thread
    the OS descheduled), the caller claims every item itself and no loop waits for the worker."""
    engine = isa_engines(isa, torch.float32)
    module = engine.native.kernels
    threads(2)
    quiet = _outputs(engine)
    module.pool_set(spin_us=50, worker_delay_us=1_000_000)
    try:
        before = module.pool_stats()
        late = _outputs(engine)
        after = module.pool_stats()
    finally:
        module.pool_set(spin_us=50, worker_delay_us=0)
    assert after["loops"] > before["loops"]
    assert after["worker_items"] == before["worker_items"]  # the worker was still asleep: it took no item
    assert after["caller_items"] > before["caller_items"]
    assert after["caller_sleeps"] == before["caller_sleeps"]  # and nobody waited for it
    for a, b in zip(late, quiet, strict=True):
        assert torch.equal(a, b)


def test_a_forward_beside_a_busy_thread_is_exact(isa_engines, threads):
    """Another thread of the process keeps a core busy (it runs while the forward has released the GIL): the forward,
    on as many threads as there are cores, still computes exactly the quiet result."""
    engine = isa_engines(ISAS[0], torch.bfloat16)
    threads(max(2, os.cpu_count() or 1))
    quiet = _outputs(engine)
    stop, spins = threading.Event(), [0]

    def spin():
        while not stop.is_set():
            spins[0] += 1

    busy = threading.Thread(target=spin, daemon=True)
    busy.start()
    try:
        shared = [_outputs(engine) for _ in range(3)]
    finally:
        stop.set()
        busy.join()
    assert spins[0] > 0
    for run in shared:
        for a, b in zip(run, quiet, strict=True):
            assert torch.equal(a, b)


def test_two_callers_at_once_each_get_their_own_exact_result(target_dir, threads):
    """Two threads' forwards at once (two engines): one loop at a time runs on the pool, the other caller's inline,
    and each result is what it is alone."""
    engines = [Transformer.load(target_dir, torch.float32) for _ in range(2)]
    threads(2)
    alone = [_outputs(e) for e in engines]
    module = engines[0].native.kernels
    before = module.pool_stats()
    results: dict[int, list] = {}

    def run(i: int) -> None:
        results[i] = [_outputs(engines[i]) for _ in range(4)]

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    after = module.pool_stats()
    assert after["loops"] > before["loops"]
    for i in range(2):
        for run_out in results[i]:
            for a, b in zip(run_out, alone[i], strict=True):
                assert torch.equal(a, b)


# --- the thread count: affinity mask and cgroup quota (no model) ---


def _cgroup(tmp_path: Path, lines: list[str], files: dict[str, str]) -> tuple[Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text("\n".join(lines) + "\n")
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    root.mkdir(exist_ok=True)
    return proc, root


@pytest.mark.unit
@pytest.mark.parametrize(("files", "expected"), [
    ({"cgroup.controllers": "cpu", "kubepods/pod1/cpu.max": "150000 100000\n"}, 1.5),
    ({"cgroup.controllers": "cpu", "kubepods/pod1/cpu.max": "max 100000\n"}, None),
    ({"cgroup.controllers": "cpu", "kubepods/cpu.max": "200000 100000\n", "kubepods/pod1/cpu.max": "max 100000\n"},
     2.0),  # a parent's limit binds its children
    ({"cgroup.controllers": "cpu", "kubepods/cpu.max": "400000 100000\n", "kubepods/pod1/cpu.max": "50000 100000\n"},
     0.5),  # the smallest on the path
    ({"cgroup.controllers": "cpu", "kubepods/pod1/cpu.max": "garbage\n"}, None),
    ({"cgroup.controllers": "cpu"}, None),
    ({"unified/kubepods/pod1/cpu.max": "300000 100000\n"}, 3.0),  # hybrid: v2 mounted at unified/
])
def test_cgroup_v2_cpu_max_is_read_up_the_path(tmp_path, files, expected):
    proc, root = _cgroup(tmp_path, ["0::/kubepods/pod1"], files)
    assert cpus.cgroup_cpu_limit(proc, root) == expected


@pytest.mark.unit
def test_cgroup_v1_cfs_quota_is_read(tmp_path):
    proc, root = _cgroup(tmp_path, ["4:memory:/docker/c1", "2:cpu,cpuacct:/docker/c1", "0::/"], {
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_cpu_limit(proc, root) == 2.5
    proc, root = _cgroup(tmp_path / "none", ["1:cpu:/", "0::/"], {
        "cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cpus.cgroup_cpu_limit(proc, root) is None


@pytest.mark.unit
def test_no_cgroup_file_means_no_limit(tmp_path):
    assert cpus.cgroup_cpu_limit(tmp_path / "missing", tmp_path) is None


@pytest.mark.unit
@pytest.mark.parametrize(("affinity", "limit", "instances", "expected"), [
    (8, None, 1, 8), (8, 1.5, 1, 2), (8, 0.5, 1, 1), (2, 16.0, 1, 2), (8, None, 3, 2), (2, None, 4, 1),
    (16, 4.0, 2, 2),
])
def test_threads_follow_affinity_and_quota(monkeypatch, affinity, limit, instances, expected):
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: affinity)
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: limit)
    assert cpus.default_threads(instances) == expected


@pytest.mark.unit
def test_usable_cpus_round_a_quota_up():
    assert [cpus.usable_cpus(8, q) for q in (0.1, 1.0, 1.01, 2.5)] == [1, 1, 2, 3]


@pytest.mark.unit
def test_apply_threads_prefers_the_flag_then_omp_num_threads(monkeypatch, threads):
    monkeypatch.setattr(cpus, "default_threads", lambda instances=1: 3)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpus.apply_threads() == 3 and torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert cpus.apply_threads() == 2 and torch.get_num_threads() == 2
    assert cpus.apply_threads(1) == 1 and torch.get_num_threads() == 1


@pytest.mark.unit
def test_the_affinity_mask_bounds_the_threads():
    """A process pinned to one CPU (taskset -c N) runs one thread, whatever the machine has."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from spectrt.runtime.engines import cpus; print(cpus.affinity_cpus(), cpus.default_threads())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "1" and out[1] == "1"
