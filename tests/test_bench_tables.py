"""docs/benchmarks.md's tables are generated from bench/results/<cpu class>/ (scripts/bench_tables.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "scripts" / "bench_tables.py")
bench_tables = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_tables)


def test_the_benchmark_page_is_what_the_results_give():
    page = bench_tables.PAGE.read_text(encoding="utf-8")
    assert bench_tables.updated(page, bench_tables.render()) == page, \
        "docs/benchmarks.md differs from bench/results/: run scripts/bench_tables.py"


def _report(cpu_class: str, dtype: str, tok_s: float) -> dict:
    row = {"set": "chat", "tree_nodes": 1.0, "min_prompt_speedup": 1.0, "tau": 1.0, "outputs_equal_to_ar": "2/2"}
    return {"cpu": {"class": cpu_class, "cores": 2, "native_isa": "avx2"}, "dtype": dtype, "backend": "torch",
            "time": "2026-12-03 01:00:00 UTC", "command": "spectrt bench --limit 2", "machine": "x86_64 2 threads",
            "prompt_sets": {"chat": 2}, "max_new_tokens": 16, "draft": "artifacts/d", "policy": {"budget": 3},
            "results": [{**row, "config": "autoregressive", "temperature": 0.0, "tokens_per_second": tok_s,
                         "speedup_vs_ar": 1.0},
                        {**row, "config": "policy (default)", "temperature": 0.7, "tokens_per_second": 1.0,
                         "speedup_vs_ar": 0.5}]}


def test_one_section_per_cpu_class_with_greedy_rows_only(tmp_path):
    for slug, cpu_class, dtype, tok_s in (("amd-epyc-zen-3-avx2", "AMD EPYC Zen 3, AVX2", "bf16", 47.5),
                                          ("amd-epyc-zen-3-avx2", "AMD EPYC Zen 3, AVX2", "fp32", 31.25),
                                          ("intel-xeon-avx-512", "Intel Xeon, AVX-512", "bf16", 60.0)):
        (tmp_path / "results" / slug).mkdir(parents=True, exist_ok=True)
        (tmp_path / "results" / slug / f"bench_torch_{dtype}.json").write_text(
            json.dumps(_report(cpu_class, dtype, tok_s)))
    (tmp_path / "results" / "old").mkdir()
    (tmp_path / "results" / "old" / "bench_torch_bf16.json").write_text(json.dumps({"results": []}))  # no class
    block = bench_tables.render(tmp_path / "results")
    sections = block.split("### ")[1:]
    assert [s.splitlines()[0] for s in sections] == ["AMD EPYC Zen 3, AVX2, 2 cores", "Intel Xeon, AVX-512, 2 cores"]
    assert sections[0].index("**bf16") < sections[0].index("**fp32")  # bf16 first
    assert "| chat | autoregressive | 47.5 |" in sections[0] and "| chat | autoregressive | 31.2 |" in sections[0]
    assert "policy (default)" not in block  # its only row here is sampled
    assert "`spectrt bench --limit 2`" in block and "2026-12-03 01:00:00 UTC" in block
    with pytest.raises(ValueError, match="no generated block"):
        bench_tables.updated("# a page without markers\n", block)


def test_a_prompts_speedup_sums_its_rounds_run_in_alternating_order():
    """A prompt's speedup is its tokens over the seconds summed over rounds, so a machine that runs its second round
    at half speed still reads the true ratio; the rounds alternate the order (a drift cancels); outputs compare."""
    from types import SimpleNamespace

    from spectrt.runtime.decoding.bench import BenchSettings, _bench_temperature
    from spectrt.runtime.decoding.decoder import DecodeStats

    calls = []

    class Pipe:  # a decode takes 1 s (AR) or 0.5 s (policy) at full speed
        def generate(self, prompt, max_new_tokens, tree, params):
            calls.append(tree)
            slow = 2.0 if len(calls) > 2 else 1.0  # the second round runs at half speed
            seconds = (1.0 if tree is None else 0.5) * slow
            stats = DecodeStats(new_tokens=10, emitted_tokens=10, target_passes=10 if tree is None else 5,
                                seconds=seconds, accepted=[0] * 5, verified=[1] * 5)
            return SimpleNamespace(stats=stats, token_ids=[1, 2, 3])

    rows = _bench_temperature(Pipe(), "chat", ["p"], {"autoregressive": None, "policy": "auto"}, 0.0,
                              BenchSettings(rounds=2))
    assert calls == [None, "auto", "auto", None]  # the second round runs the configurations in reverse order
    policy = next(r for r in rows if r["config"] == "policy")
    assert policy["min_prompt_speedup"] == pytest.approx(2.0)  # 20 tokens in 0.5 + 1 s vs in 1 + 2 s
    assert policy["speedup_vs_ar"] == pytest.approx(2.0)
    assert policy["tau"] == pytest.approx(2.0) and policy["outputs_equal_to_ar"] == "1/1"


# ------------------------------------------------------------------ how `spectrt bench` records runs (review)


class _FakePipe:
    """A pipeline whose every generation is n tokens in one second: what the bench writes, not what it measures."""

    def __init__(self, *args, **kw):
        from spectrt.runtime.decoding.policy import Policy

        self.policy, self.dtype, self.kwargs = Policy(), "bf16", kw

    def generate(self, prompt, n, tree=None, params=None, **kw):
        from spectrt.runtime.decoding.decoder import DecodeStats
        from spectrt.runtime.decoding.pipeline import Generation

        stats = DecodeStats(new_tokens=n, emitted_tokens=n, target_passes=n, seconds=1.0, prefill_seconds=0.1)
        return Generation("x", [1] * n, "length", stats)


def test_a_partial_or_sampled_bench_run_keeps_the_published_result(tmp_path, monkeypatch):
    """Only the full greedy run writes `bench_<backend>_<dtype>.json` (what the page renders): a sampled run, a
    `--limit` run or another prompt file gets a tagged file of its own, which the page leaves out. Every run wrote
    the one file, so a sampled run emptied the class's table."""
    from spectrt.runtime.decoding import bench

    monkeypatch.setattr(bench, "Pipeline", _FakePipe)
    monkeypatch.setattr(bench, "plot", lambda report, path: None)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\nb\n")
    for extra in ({}, {"temperatures": (0.7,)}, {"limit": 1}):
        bench.run_bench(Path("t"), None, bench.BenchSettings(prompts=prompts, dtype="bf16", out=tmp_path / "out",
                                                             max_new_tokens=4, **extra))
    names = sorted(p.name for p in (tmp_path / "out").glob("*/*.json"))
    assert names == ["bench_torch_bf16_p.json", "bench_torch_bf16_p_limit1.json", "bench_torch_bf16_p_t0.7.json"]
    assert bench_tables.load(tmp_path / "out") == {}  # none of them is a full run of the default sets
    bench.run_bench(Path("t"), None, bench.BenchSettings(dtype="bf16", out=tmp_path / "out", max_new_tokens=4,
                                                         limit=1, temperatures=(0.0, 0.7)))
    assert "bench_torch_bf16_limit1_t0-0.7.json" in {p.name for p in (tmp_path / "out").glob("*/*.json")}


def test_the_draft_report_compares_alternately_without_the_prefix_cache(monkeypatch):
    """`spectrt draft`'s speedup: no prefix cache (the tree's run reused the AR run's prompt, and its draft read the
    prompt inside the timed decode), AR and the tree alternate which runs first, outputs checked."""
    from spectrt.runtime.decoding import bench

    made, order = [], []

    class Pipe(_FakePipe):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(kw)
            self.decoder = type("D", (), {"target": None, "draft": None})()

        def generate(self, prompt, n, tree=None, **kw):
            order.append(tree is not None)
            return super().generate(prompt, n, tree, **kw)

    monkeypatch.setattr(bench, "Pipeline", Pipe)
    monkeypatch.setattr(bench, "step_cost_ms", lambda engine: 1.0)
    report = bench.draft_runtime_report(Path("t"), Path("d"), ["a", "b"])
    assert made[0].get("prefix_cache") is False and report["outputs_equal_to_ar"] == "2/2"
    assert order[1:] == [False, True, True, False]  # after the warm-up


def test_shared_cpu_runs_render_under_their_class(tmp_path):
    cpu = {"class": "AMD EPYC Zen 3, AVX2", "cores": 2, "native_isa": "avx2"}
    folder = tmp_path / "results" / "amd-epyc-zen-3-avx2"
    folder.mkdir(parents=True)
    (folder / "bench_torch_bf16.json").write_text(json.dumps(_report(cpu["class"], "bf16", 40.0)))
    settings = {"requests": 12, "concurrency": 4, "max_tokens": 96, "rounds": 2, "busy": 1, "taskset": None,
                "serve_arg": []}
    (folder / "shared_cpu_x.json").write_text(json.dumps({
        "cpu": cpu, "label": "server X", "command": "scripts/shared_cpu.py", "time": "t", "settings": settings,
        "rate": {"quiet": 200.0, "busy": 120.0}, "rounds": []}))
    (folder / "shared_cpu_y.json").write_text(json.dumps({
        "cpu": cpu, "label": "server Y", "command": "c", "time": "t", "settings": {**settings, "busy": 0,
                                                                                   "taskset": "0"},
        "rate": {"quiet": 100.0}, "rounds": []}))
    metric = {"avg": 50.0, "p50": 40.0}
    (folder / "aiperf_x.json").write_text(json.dumps({
        "cpu": cpu, "label": "server X", "server": "x serve", "aiperf": "0.13.0", "command": "aiperf profile",
        "time": "t", "metrics": {"output_token_throughput": {"avg": 61.0}, "inter_token_latency": metric,
                                 "time_to_first_token": metric}}))
    rows = [{"config": "constrained AR", "tokens_per_second": 80.0, "vs_constrained_ar": 1.0},
            {"config": "constrained, default policy", "tokens_per_second": 140.0, "vs_constrained_ar": 1.75}]
    for name, served in (("structured_bf16.json", None), ("structured_served_bf16.json", "spectrt serve")):
        (folder / name).write_text(json.dumps({"cpu": cpu, "dtype": "bf16", "prompts": 6, "rounds": 2,
                                               "max_new_tokens": 96, "outputs_equal": "12/12", "time": "t",
                                               "results": rows, **({"served": served} if served else {})}))
    page = bench_tables.render(tmp_path / "results")
    assert "| in process | bf16 | constrained, default policy | 140.0 | 1.75× | 12/12 | t |" in page
    assert "| served | bf16 | constrained AR | 80.0 | 1.00× | 12/12 | t |" in page
    assert "| server X | all | 200.0 | 1 | 120.0 | 0.60× |" in page
    assert "| server Y | CPUs 0 | 100.0 | 0 | – | – |" in page
    assert "| server X (`x serve`) | 61.0 | 50 / 40 | 50 / 40 |" in page
