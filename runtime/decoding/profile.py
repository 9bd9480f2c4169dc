"""`spectrt profile`: this machine's engine cost curve (ms per forward vs T new tokens) for target and draft.

Every speedup divides by this curve: a tree of T nodes pays only if verifying it costs little more than one
step. The curve is measured with tree masks (a binary tree of T nodes after `context` committed tokens), saved as
the machine's cost profile (artifacts/cost_profile-<target>-<dtype>.json) for the tree tuner, and written with a
per-component breakdown as JSON + markdown + PNG under bench/results/profile/.

The batched profile (`<role>_batched`: {context: {segments: {total rows: ms}}}) is the cost of one `forward_many`
over several requests' segments, for the batch-wide speculation budget (`policy.BatchedCost` interpolates it).

Each timed forward follows one forward of the other engine (target after draft, draft after target), as the decode
loop interleaves them. Why: the draft's weights (~38 MB in bf16) stay in cache when it runs alone but not after the
target has streamed its ~270 MB through; measured on the 2-core Xeon, a draft T=1 pass costs 1.6 ms alone and 2.5 ms
after a target forward, and the loop's own draft calls averaged 2.8 ms while the old profile said 1.2 ms.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.model import Transformer
from tqdm import tqdm

T_VALUES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 1024)
SEGMENTS = (1, 2, 4, 8)  # requests per batched forward
ROUNDS = 3  # every profile shape is measured once a round; its figure is the best round's median (cost_curve)


def binary_tree(nodes: int) -> Tree:
    """`nodes` nodes, node i's parent (i - 1) // 2: a tree in breadth-first order, not a causal chunk."""
    return Tree(tuple([-1] + [(i - 1) // 2 for i in range(1, nodes)]))


def prefilled_caches(engine: Transformer, context: int, slots: int, window: int = 64) -> list:
    """`slots` caches of one pool, each holding the same `context` committed random tokens (the first is fed in
    `window`-token causal chunks, the others copy its K/V: the cost of a forward does not depend on the values)."""
    caches = engine.new_caches(slots, context + window, window)
    first = caches[0]
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(0, engine.config.vocab_size, (context,), generator=gen)
    causal = torch.ones(window, window, dtype=torch.bool).tril()
    for start in range(0, context, window):
        chunk = ids[start:start + window]
        engine.forward(chunk, torch.arange(start, start + len(chunk)), causal[:len(chunk), :len(chunk)], first)
        first.commit(len(chunk))
    for cache in caches[1:]:
        cache.k.copy_(first.k)
        cache.v.copy_(first.v)
        cache.commit(context)
    return caches


def prefilled_cache(engine: Transformer, context: int, window: int = 64):
    """A cache holding `context` committed random tokens, fed in `window`-token causal chunks."""
    return prefilled_caches(engine, context, 1, window)[0]


def forward_ms(engine: Transformer, nodes: int, cache, repeats: int, before: Callable[[], None] | None = None) -> float:
    """Median wall time of one forward of a `nodes`-node tree after the cache's committed tokens; `before()` runs
    untimed ahead of each timed forward (the other engine's pass, as in the decode loop)."""
    tree = binary_tree(nodes)
    tokens = torch.randint(0, engine.config.vocab_size, (nodes,), generator=torch.Generator().manual_seed(nodes))
    positions = tree.positions(cache.length)
    engine.forward(tokens, positions, tree.mask, cache)  # warm-up
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        engine.forward(tokens, positions, tree.mask, cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def cost_curve(engine: Transformer, contexts=CONTEXTS, t_values=T_VALUES, repeats: int = 15,
               label: str = "", before: Callable[[], None] | None = None) -> dict[str, dict[str, float]]:
    """{context: {T: ms}} for tree forwards of T nodes: the best of ROUNDS rounds' medians, every shape once a
    round. Why rounds: measured one shape after another, a host whose bandwidth drifts within minutes put T=2 at
    1.43x T=1 and T=4 at 1.47x in one profile (an interleaved run of the same kernels: 1.1x and 1.5x), and the tuner
    priced trees by that."""
    caches = {context: prefilled_cache(engine, context, max(t_values)) for context in contexts}
    per_round = max(3, repeats // ROUNDS)
    best: dict[str, dict[str, float]] = {str(c): {} for c in contexts}
    with tqdm(total=ROUNDS * len(contexts) * len(t_values), desc=f"profile {label}".strip(), unit="shape") as bar:
        for _ in range(ROUNDS):
            for context in contexts:
                row = best[str(context)]
                for t in t_values:
                    ms = forward_ms(engine, t, caches[context], per_round, before)
                    row[str(t)] = round(min(row.get(str(t), float("inf")), ms), 3)
                    bar.update()
    return best


def batch_rows(segments: int, max_rows: int = max(T_VALUES)) -> list[int]:
    """Total rows measured for a segment count: 1, 2, 4 and 8 rows per segment, and 16, 32, 64 in all."""
    wanted = (segments, 2 * segments, 4 * segments, 8 * segments, 16, 32, 64)
    return sorted({r for r in wanted if segments <= r <= max_rows})


def batched_forward_ms(engine: Transformer, caches: list, rows: int, repeats: int,
                       before: Callable[[], None] | None = None) -> float:
    """Median wall time of one `forward_many` over len(caches) segments sharing `rows` rows (as evenly as possible,
    the first segments one more), each a binary tree after its cache's committed tokens."""
    n = len(caches)
    segments = []
    for i, cache in enumerate(caches):
        tree = binary_tree(rows // n + (i < rows % n))
        tokens = torch.randint(0, engine.config.vocab_size, (len(tree),), generator=torch.Generator().manual_seed(i))
        segments.append((tokens, tree.positions(cache.length), tree.mask, cache))
    engine.forward_many(segments)  # warm-up
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        engine.forward_many(segments)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def batched_curve(engine: Transformer, contexts=CONTEXTS, segments=SEGMENTS, repeats: int = 5,
                  label: str = "", before: Callable[[], None] | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{context: {segments: {total rows: ms}}} for `forward_many` over `segments` requests at `context`: the best of
    ROUNDS rounds' medians, every shape once a round (as `cost_curve`)."""
    table: dict[str, dict[str, dict[str, float]]] = {str(c): {str(s): {} for s in segments} for c in contexts}
    caches = {context: prefilled_caches(engine, context, max(segments), max(T_VALUES)) for context in contexts}
    shapes = [(context, s, rows) for context in contexts for s in segments for rows in batch_rows(s)]
    per_round = max(3, repeats // ROUNDS)
    with tqdm(total=ROUNDS * len(shapes), desc=f"batched {label}".strip(), unit="shape") as bar:
        for _ in range(ROUNDS):
            for context, s, rows in shapes:
                ms = batched_forward_ms(engine, caches[context][:s], rows, per_round, before)
                cell = table[str(context)][str(s)]
                cell[str(rows)] = round(min(cell.get(str(rows), float("inf")), ms), 3)
                bar.update()
    return table


def one_pass(engine: Transformer) -> Callable[[], None]:
    """A callable running one T=1 forward of `engine` on a cache of its own: what precedes each forward of the other
    engine in the decode loop."""
    cache = prefilled_cache(engine, 128, 1)
    token, position = torch.zeros(1, dtype=torch.long), torch.tensor([cache.length])
    mask = torch.ones(1, 1, dtype=torch.bool)
    return lambda: engine.forward(token, position, mask, cache)


def breakdown(engine: Transformer, nodes: int, context: int = 128, repeats: int = 15) -> dict[str, float]:
    """ms per forward by component at `nodes` rows. Native engine: each packed GEMM shape timed alone (weights
    streamed as in a forward: every layer's own panels) and the rest (attention, norms, RoPE, SiLU, call overhead)
    as the difference, signed: where it is negative the GEMMs' separate calls (a Python call, a thread team and the
    activations' conversion each) cost more than they do inside one forward, so the rest is not separable there
    (bf16dot on AMX tiles: 10.95 ms of GEMMs timed alone against a 10.06 ms forward; it read 0.00 when clamped).
    Reference engine: the torch profiler's per-op self CPU time."""
    total = forward_ms(engine, nodes, prefilled_cache(engine, context, 64), repeats)
    if engine.native is None:
        from torch.profiler import ProfilerActivity, profile

        cache = prefilled_cache(engine, context, 64)
        tree = binary_tree(nodes)
        tokens = torch.zeros(nodes, dtype=torch.long)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.forward(tokens, tree.positions(context), tree.mask, cache)
        ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:8]
        parts = {f"op {e.key}": round(e.self_cpu_time_total / 3e3, 3) for e in ops}
        return {"total": round(total, 3), **parts}
    from spectrt.runtime.engines import kernels

    native, c = engine.native, engine.config
    x = torch.randn(nodes, max(c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim))
    q_dim = c.num_heads * c.head_dim
    shapes = {  # name: (K, N, every layer's projection)
        f"gemm qkv {c.hidden_size}->{q_dim + 2 * c.num_kv_heads * c.head_dim}":
            (c.hidden_size, q_dim + 2 * c.num_kv_heads * c.head_dim, native.projections[0::4]),
        f"gemm o {q_dim}->{c.hidden_size}": (q_dim, c.hidden_size, native.projections[1::4]),
        f"gemm gate/up {c.hidden_size}->{2 * c.intermediate_size}":
            (c.hidden_size, 2 * c.intermediate_size, native.projections[2::4]),
        f"gemm down {c.intermediate_size}->{c.hidden_size}": (c.intermediate_size, c.hidden_size,
                                                              native.projections[3::4]),
        f"lm head {c.hidden_size}->{len(native.head_ids) if native.head_ids is not None else c.vocab_size}":
            (c.hidden_size, native.head.shape[0] * kernels.PANEL, [[native.head]]),
    }
    parts = {}
    for name, (k, n, projections) in shapes.items():
        times = []
        for _ in range(max(3, repeats // 3)):
            start = time.perf_counter()
            for proj in projections:
                kernels.linear(x[:, :k], proj, n)
            times.append(time.perf_counter() - start)
        parts[name] = round(statistics.median(times) * 1e3, 3)
    parts["attention, norms, RoPE, SiLU, overhead (the difference)"] = round(total - sum(parts.values()), 3)
    return {"total": round(total, 3), **parts}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


DRAFT_SHAPE_KEYS = ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "vocab_size", "draft_vocab_size")


def draft_shape(draft: Path) -> dict:
    """What a draft's forward costs depend on (its config.json's sizes), recorded in a cost profile: `spectrt tune`
    prices a draft with the profile's draft tables only when they were measured on a draft of this shape."""
    config = json.loads((Path(draft) / "config.json").read_text(encoding="utf-8"))
    return {k: config.get(k) for k in DRAFT_SHAPE_KEYS}


def cost_profile_path(target: Path, dtype: str, artifacts: Path) -> Path:
    """Where the tree tuner finds this machine's cost profile for a target and dtype."""
    return Path(artifacts) / f"cost_profile-{Path(target).name}-{dtype}.json"


class HeadRows:
    """An EAGLE-3 head seen as an engine of (tokens, positions, mask, cache) segments, for the cost curves: each row's
    input hidden state is random (a forward's cost does not depend on its values). The loop's draft pass of a head is
    this forward: one level of rows after the committed ones (its catch-up rows are rows like any other)."""

    def __init__(self, head):
        self.head, self.config, self.native = head, head.config.model, None
        self.hidden = torch.randn(max(T_VALUES) * max(SEGMENTS), self.config.hidden_size,
                                  generator=torch.Generator().manual_seed(0))

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list:
        return self.head.new_caches(slots, capacity, max_window)

    def forward_many(self, segments) -> list[torch.Tensor]:
        rows = [len(s[0]) for s in segments]
        hidden = self.hidden[:sum(rows)].split(rows)
        segments = [(*s, h) for s, h in zip(segments, hidden, strict=True)]
        return [logits for logits, _ in self.head.forward_many(segments, full_vocab=False)]  # as the loop reads it

    def forward(self, tokens, positions, tree_mask, cache) -> torch.Tensor:
        return self.forward_many([(tokens, positions, tree_mask, cache)])[0]


def loop_host(target: Path, draft: Path | None, dtype: str, artifacts: Path, batches=(1, 8), tokens: int = 64,
              prompts: int = 8) -> dict[str, dict[str, float]]:
    """{batch: ms per step by part} of the decode loop itself under its default policy (`Decoder.clock`): the target
    and draft forwards and the host work around them (proposing, acceptance, the rest), greedy, `prompts` chat
    prompts of the bench set, `tokens` each; batch 1 decodes them one at a time, batch B together. Past batch 1 also
    "B plain": the same requests without speculation (the target alone), the step speculation must not lose to.
    Each setting runs a round unmeasured first: the policy's cost curves are made once per batch and 64-token context
    bucket (~50 us each, `BatchedCost.curve`), ~25 us a step at batch 8 in a first round (line_profiler), which a
    long-running loop does not pay."""
    from spectrt.runtime.decoding.bench import DEFAULT_PROMPTS, read_prompts
    from spectrt.runtime.decoding.decoder import Job, StepClock
    from spectrt.runtime.decoding.pipeline import Pipeline, trained_context
    from spectrt.runtime.decoding.tree import AUTO

    # no prefix cache: every run decodes the same prompts, and a later one would skip the prefill an earlier one did;
    # 1024 positions hold a prompt and its answer, within what the target was trained on
    pipe = Pipeline(target, draft, dtype=dtype, max_seq_len=min(1024, trained_context(target) or 1024),
                    artifacts=artifacts, max_active=max(batches), prefix_cache=False)
    decoder = pipe.decoder
    ids = [pipe.encode(p) for p in read_prompts(DEFAULT_PROMPTS)[:prompts]]
    report = {}
    for batch in batches:
        modes = [(str(batch), AUTO)] + ([(f"{batch} plain", None)] if batch > 1 else [])
        for name, tree in modes:
            for _ in range(2):  # the second round measured
                decoder.clock = StepClock()
                for start in range(0, len(ids), batch):
                    decoder.run([Job(list(p), tokens, tree, min_length=tokens) for p in ids[start:start + batch]])
            report[name] = decoder.clock.per_step_ms()
    return report


def run_profile(target: Path, draft: Path | None, dtype: str, artifacts: Path, out_dir: Path,
                repeats: int = 15) -> dict:
    """Measure target (and draft) curves + breakdowns; save the cost profile and the report files. The draft is a
    sliced model or an EAGLE-3 head (its forwards timed as `HeadRows`; no per-component breakdown)."""
    from spectrt.runtime.engines.eagle3 import Eagle3Head, is_eagle3
    from spectrt.runtime.engines.engine import DTYPES, draft_dtype, load_transformer

    report = {"backend": "torch", "dtype": dtype, "threads": torch.get_num_threads(), "cpu": _cpu_name(),
              "cores": os.cpu_count(), "target_name": Path(target).name}
    engines = {"target": load_transformer(target, dtype)}
    if draft is not None:  # in the precision the pipeline runs it
        if is_eagle3(Path(draft)):
            engines["draft"] = HeadRows(Eagle3Head.load(Path(draft), engines["target"],
                                                        DTYPES[draft_dtype("torch", dtype)]))
            report["draft_kind"] = "eagle3"
        else:
            engines["draft"] = Transformer.load(draft, DTYPES[draft_dtype("torch", dtype)])
        report["draft_dtype"] = draft_dtype("torch", dtype)
        report["draft_shape"] = draft_shape(Path(draft))
    report["native"] = engines["target"].native is not None
    report["breakdown"] = {}
    others = {"target": engines.get("draft"), "draft": engines["target"]}
    for role, engine in engines.items():
        before = one_pass(others[role]) if others[role] is not None else None
        report[role] = cost_curve(engine, repeats=repeats, label=role, before=before)
        report[f"{role}_batched"] = batched_curve(engine, repeats=max(5, repeats // 2), label=role, before=before)
        if not isinstance(engine, HeadRows):
            report["breakdown"][role] = {str(t): breakdown(engine, t, repeats=repeats) for t in (1, 8)}
    del engines, others
    report["loop"] = loop_host(target, draft, dtype, artifacts)
    path = cost_profile_path(target, dtype, artifacts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"profile_{dtype}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(to_markdown(report))
    plot(report, stem.with_suffix(".png"))
    print(to_markdown(report))
    print(f"cost profile -> {path}; report -> {stem}.{{json,md,png}}")
    return report


def to_markdown(report: dict) -> str:
    lines = [f"### cost profile: {report['target_name']} {report['dtype']} "
             f"({'native' if report['native'] else 'torch reference'} forward, {report['threads']} threads, "
             f"{report['cpu']})", ""]
    for role in ("target", "draft"):
        if role not in report:
            continue
        lines += [f"**{role}** — ms per forward of a T-node tree (ratio to T=1)", "",
                  "| context | " + " | ".join(f"T={t}" for t in T_VALUES) + " |",
                  "|---|" + "---|" * len(T_VALUES)]
        for context, row in report[role].items():
            one = row["1"]
            lines.append(f"| {context} | " + " | ".join(f"{row[str(t)]:.1f} ({row[str(t)] / one:.2f}×)"
                                                       for t in T_VALUES) + " |")
        lines.append("")
        batched = report.get(f"{role}_batched", {})
        for context, by_segments in batched.items():
            all_rows = sorted({int(r) for rows in by_segments.values() for r in rows})
            lines += [f"**{role}, batched** (`forward_many`, context {context}) — ms by requests (segments) and "
                      "total rows", "", "| segments | " + " | ".join(f"{r} rows" for r in all_rows) + " |",
                      "|---|" + "---|" * len(all_rows)]
            for segments, rows in by_segments.items():
                lines.append(f"| {segments} | " + " | ".join(f"{rows[str(r)]:.1f}" if str(r) in rows else "–"
                                                           for r in all_rows) + " |")
            lines.append("")
        for t, parts in report["breakdown"].get(role, {}).items():
            lines.append(f"breakdown at T={t}, context 128: " + ", ".join(f"{k} {v:.2f} ms" for k, v in parts.items()))
        lines.append("")
    loop = report.get("loop")
    if loop:
        names = list(next(iter(loop.values())))
        lines += ["**the decode loop** (default policy, greedy, chat prompts; `Decoder.clock`) — ms per step", "",
                  "| batch | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for batch, parts in loop.items():
            lines.append(f"| {batch} | " + " | ".join(f"{parts[n]:.2f}" for n in names) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for role in ("target", "draft"):
        for context, row in report.get(role, {}).items():
            ax.plot(T_VALUES, [row[str(t)] for t in T_VALUES], marker="o", label=f"{role}, context {context}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("T (tree nodes per forward)")
    ax.set_ylabel("ms per forward")
    ax.set_title(f"{report['target_name']} {report['dtype']}, {report['threads']} threads")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
