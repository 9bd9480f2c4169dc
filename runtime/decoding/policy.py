"""Speculation policy: how big a tree to build and verify, from this machine's cost curve (pure functions).

Expected tokens per step are Σ over verified nodes of P(target accepts the path to the node) plus the
target's own token; a step costs its draft passes plus one target verify of B tokens. Both the tuner
(offline, over measured acceptance by depth and rank: Sequoia) and each decode step (online, over the
node scores of the tree actually built: EAGLE-2) pick the size that maximises tokens per millisecond,
and B = 1 (plain autoregressive decoding) is always among the choices, so speculation only runs when the
measured curve says it pays.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spectrt.runtime.decoding.sampling import host_kernels


@dataclass(frozen=True)
class CostCurve:
    """Median forward milliseconds vs new tokens T (at one context length), linearly interpolated."""

    ms: dict[int, float]
    # sorted token counts, once (the budget reads a curve ~10 times a request a step)
    _ts: list[int] = field(default_factory=list, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ms or 1 not in self.ms or any(v <= 0 for v in self.ms.values()):
            raise ValueError(f"a cost curve needs positive milliseconds for T=1 at least, got {self.ms}")
        self._ts.extend(sorted(self.ms))
        # `native`, once resolved: not a field (`asdict` of a policy would deep-copy the native object)
        object.__setattr__(self, "_native", [])

    def native(self):
        """This curve in the native module (cpu_kernels.cpp `Curve`: the same values), made once; None where the
        module does not build (`allocate` and the gate's arithmetic then run in Python)."""
        if not self._native:
            kernels = host_kernels()
            self._native.append(kernels.Curve([float(t) for t in self._ts], [self.ms[t] for t in self._ts])
                                if kernels is not None else None)
        return self._native[0]

    def __call__(self, tokens: int) -> float:
        ts, ms = self._ts, self.ms
        if tokens <= ts[0]:
            return ms[ts[0]]
        if tokens >= ts[-1]:  # extrapolate with the last segment's slope
            if len(ts) == 1:
                return ms[ts[0]]
            a, b = ts[-2], ts[-1]
            return ms[b] + (ms[b] - ms[a]) / (b - a) * (tokens - b)
        i = bisect.bisect_left(ts, tokens)
        a, b = ts[i - 1], ts[i]
        return ms[a] + (ms[b] - ms[a]) * (tokens - a) / (b - a)


@dataclass(frozen=True)
class Calibration:
    """Measured P(accept) for candidate scores: draft edges by probability bin, suffix by match length.

    `draft[i]` is the acceptance rate of draft children whose draft probability lies in bin i of
    `len(draft)` equal bins; `suffix[m]` that of a suffix candidate's first token after a match of m
    tokens (the last entry for longer matches); `suffix_next` that of each further suffix token given
    the previous one was accepted. Defaults are uncalibrated guesses, replaced by `spectrt tune`.
    """

    draft: tuple[float, ...] = (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.95)
    suffix: tuple[float, ...] = (0.0, 0.1, 0.2, 0.35, 0.5, 0.6)
    suffix_next: float = 0.7

    def draft_edge(self, q: float) -> float:
        return self.draft[min(int(q * len(self.draft)), len(self.draft) - 1)]

    def suffix_path(self, match: int, share: tuple[float, ...]) -> list[float]:
        """Scores of a suffix candidate's tokens: P(first) * P(next)^(k-1), times the share of occurrences."""
        first = self.suffix[min(match, len(self.suffix) - 1)]
        return [first * self.suffix_next ** k * s for k, s in enumerate(share)]


CONTEXT_BUCKET = 64  # step cost curves are built per 64 committed tokens (the cost moves ~1% per 64 at batch 1)


def _interpolate(points: dict[int, float], x: float, below: bool = False) -> float:
    """Piecewise linear through the points; the last slope above the last; below the first flat, or (`below`) the
    first slope down to half the first value."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    if x <= xs[0]:
        if not below:
            return points[xs[0]]
        slope = (points[xs[1]] - points[xs[0]]) / (xs[1] - xs[0])
        return max(points[xs[0]] - slope * (xs[0] - x), points[xs[0]] / 2)
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    a, b = xs[i - 1], xs[i]
    return points[a] + (points[b] - points[a]) * (x - a) / (b - a)


@dataclass(frozen=True)
class BatchedCost:
    """ms of one `forward_many` by total rows, segments (requests) and committed context, from `spectrt profile`'s
    `<role>_batched` table {context: {segments: {rows: ms}}}.

    Linear in rows, then in segments, then in context between measured points (a grid point returns its
    measurement), the last slope above the largest. Below the smallest measured segment count or context: flat. A
    segment count whose smallest measured row count exceeds `rows` (7 rows against 8 segments measured from 8 rows)
    is extended down with its first slope. Why not flat there: 7 requests then read 7 and 8 rows at almost the same
    cost (8 segments' 8-row figure for both), so a seventh request's extra row looked a quarter of its price and
    batch 7 verified one every step (in process, bf16: 0.93x plain batched decoding). Why segments and context: at
    batch 8 the same rows cost more than one request's tree (attention reads eight caches), and 1024 committed
    tokens cost ~2x 128 at 16 rows (measured, bf16)."""

    table: dict[int, dict[int, dict[int, float]]]
    _curves: dict = field(default_factory=dict, compare=False, repr=False)  # (segments, context bucket) -> curve
    _at_contexts: dict = field(default_factory=dict, compare=False, repr=False)  # segments -> `_rows_at`

    @classmethod
    def from_json(cls, table: dict) -> BatchedCost:
        grid = {int(c): {int(s): {int(r): float(ms) for r, ms in rows.items()} for s, rows in by_s.items()}
                for c, by_s in table.items()}
        if not grid or any(not by_s or any(not rows for rows in by_s.values()) for by_s in grid.values()):
            raise ValueError("a batched cost table needs measured rows for every context and segment count")
        return cls(grid)

    def to_json(self) -> dict:
        return {str(c): {str(s): {str(r): ms for r, ms in rows.items()} for s, rows in by_s.items()}
                for c, by_s in self.table.items()}

    def __call__(self, rows: int, segments: int = 1, context: int = 128) -> float:
        if rows < segments or segments < 1:
            raise ValueError(f"a forward over {segments} segments needs at least one row each, got {rows} rows")
        return _interpolate(self._at_context(rows, segments), context)

    def _at_context(self, rows: int, segments: int) -> dict[int, float]:
        """{measured context: ms} of `rows` rows over `segments` segments (rows, then segments interpolated)."""
        return {c: _interpolate({s: _interpolate(by_rows, rows, below=True) for s, by_rows in by_s.items()}, segments)
                for c, by_s in self.table.items()}

    def curve(self, segments: int, context: int) -> CostCurve:
        """Cost vs total rows for one step's forward over `segments` requests at `context`: what `allocate` reads
        (one interpolation per measured row count here, then a cheap CostCurve per call). The rows' and segments'
        interpolation is done once per segment count, each context bucket then interpolates those values (the same
        numbers as `__call__`). Why: every batch size and 64-token bucket a loop reaches builds a curve, and built
        whole each one cost ~50 us (~25 us a batch-8 step in a first round)."""
        key = (segments, -(-context // CONTEXT_BUCKET) * CONTEXT_BUCKET)
        if key not in self._curves:
            rows_at = self._at_contexts.get(segments)
            if rows_at is None:
                points = sorted({segments} | {r for by_s in self.table.values() for rows in by_s.values()
                                              for r in rows if r > segments})
                rows_at = self._at_contexts[segments] = [(r, self._at_context(r, segments)) for r in points]
            ms = {r: _interpolate(at_context, key[1]) for r, at_context in rows_at}
            self._curves[key] = CostCurve({1: ms[segments], **ms})
        return self._curves[key]


@dataclass(frozen=True)
class DraftingCost:
    """ms of a drafting step's draft passes by (first-pass rows, requests drafting): the pass over the requests'
    accepted tokens, `levels` level passes of `width` rows a request, and the host work the drafted requests add
    (`host_ms` for the first, `host_more_ms` each further one: `Policy.host_charge`). `curves[s - 1]` is one draft
    forward over s segments (`Policy.draft_at`), up to the most requests a step drafts (the last curve for more).
    Made by `drafting_cost`; a plain callable for the budget's functions, and data for their native twins."""

    curves: tuple[CostCurve, ...]
    levels: int
    width: int
    host_ms: float
    host_more_ms: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "_native", [])  # `native`, once resolved

    def pass_ms(self, rows: float, segments: int) -> float:
        return self.curves[min(int(max(min(segments, rows), 1)), len(self.curves)) - 1](rows)

    def __call__(self, rows: float, requests: int) -> float:
        return self.pass_ms(rows, requests) + self.levels * self.pass_ms(self.width * requests, requests) + \
            charged_host_ms(self.host_ms, self.host_more_ms, requests)

    def native(self):
        """This cost in the native module (cpu_kernels.cpp `DraftCost`), made once; None where it does not build."""
        if not self._native:
            curves = [c.native() for c in self.curves]
            kernels = host_kernels()
            self._native.append(kernels.DraftCost(curves, self.levels, self.width, self.host_ms, self.host_more_ms)
                                if kernels is not None and None not in curves else None)
        return self._native[0]


def charged_host_ms(first_ms: float, more_ms: float, drafted: int) -> float:
    """Host ms `drafted` requests drafting in one step add to it: `first_ms` for the first, `more_ms` each further one
    (`Policy.host_charge` says why; `DraftingCost` and its native twin charge the same)."""
    return 0.0 if drafted <= 0 else first_ms + more_ms * (drafted - 1)


# Untuned fallback (relative units): verify cost vs T of the fp32 torch engine measured on a 2-core CPU,
# a 4-layer draft pass ~20% of a target step. `spectrt tune` replaces both with this machine's curves.
DEFAULT_VERIFY = ((1, 1.0), (2, 1.13), (4, 1.48), (8, 2.23), (16, 3.11), (32, 4.8), (64, 8.0))
DEFAULT_DRAFT = ((1, 0.2), (2, 0.22), (4, 0.28), (8, 0.4), (16, 0.6))


@dataclass(frozen=True)
class Policy:
    """What a decode step may build: at most `budget` verified nodes (root included), `depth` draft
    levels expanding the `width` best nodes of each level by their top-`width` children, suffix candidates
    of up to `suffix_depth` tokens. `draft=False` is draft-less speculation (suffix candidates only)."""

    budget: int = 8
    depth: int = 3
    width: int = 2
    draft: bool = True
    suffix: bool = True
    suffix_depth: int = 8
    calibration: Calibration = field(default_factory=Calibration)
    verify_ms: tuple[tuple[int, float], ...] = DEFAULT_VERIFY
    draft_ms: tuple[tuple[int, float], ...] = DEFAULT_DRAFT
    draft_gain: float | None = None  # tuned: expected tokens the draft adds per step (None: a sure token)
    host_ms: float = 0.0  # tuned: host work a drafted request adds to a step (tree, scores, acceptance), ms
    host_more_ms: float | None = None  # tuned: what each further drafted request of a step adds (None: host_ms)
    first_level_gain: float | None = None  # tuned: expected tokens the draft's first level alone adds per step
    verify_batched: BatchedCost | None = field(default=None, hash=False)  # the profile's batched tables, if tuned
    draft_batched: BatchedCost | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.budget < 1 or self.depth < 0 or self.width < 1 or self.suffix_depth < 0:
            raise ValueError(f"policy {self} needs budget >= 1, depth >= 0, width >= 1, suffix_depth >= 0")
        tuned = {"draft_gain": self.draft_gain, "host_ms": self.host_ms, "host_more_ms": self.host_more_ms,
                 "first_level_gain": self.first_level_gain}
        bad = [name for name, value in tuned.items() if value is not None and not 0 <= value < math.inf]
        if bad:  # a hand-edited policy file: NaN or a negative would order the gate's choices arbitrarily
            raise ValueError(f"policy fields {', '.join(bad)} must be finite and >= 0 (got "
                             f"{', '.join(repr(tuned[b]) for b in bad)}): run `spectrt tune` again or fix the file")

    @property
    def expected_draft_gain(self) -> float:
        """Tokens the draft is expected to add per step before a request has its own evidence: the tuned value, or
        (untuned) the acceptance of the most confident draft tokens."""
        return self.draft_gain if self.draft_gain is not None else self.calibration.draft[-1]

    @property
    def verify_cost(self) -> CostCurve:
        return CostCurve(dict(self.verify_ms))

    @property
    def draft_cost(self) -> CostCurve:
        return CostCurve(dict(self.draft_ms))

    def host_charge(self, drafted: int) -> float:
        """Host ms that `drafted` requests drafting in one step add to it: `host_ms` for the first (measured at batch
        1, it holds the step's own part: the level loop, the draft call, the budget's passes) and `host_more_ms` for
        each further one (measured at batch 8, `tune.further_host_ms`). Why not `host_ms` each: a batch shares the
        step's part (bf16dot on AMX, Intel Xeon: 0.7 ms for one drafted request, 0.04-0.17 ms each further one at
        batch 8), and charged in full the gate kept the draft off at batch 8 where it paid. Measured
        (`scripts/batch_vs_plain.py --rounds 10 --alt-policy` the previous policy, one process): closed batches of 8
        1.149x plain batched decoding against 1.038x (10.11 against 7.40 tokens a step), every prompt through 8
        slots 1.090x against 1.050x; batch 1 unchanged (1.82x against 1.80x its AR)."""
        return charged_host_ms(self.host_ms, self.host_ms if self.host_more_ms is None else self.host_more_ms, drafted)

    def verify_at(self, segments: int, context: int) -> CostCurve:
        """Target ms vs total rows for one step's forward over `segments` requests at `context` committed tokens:
        the batched profile when the policy was tuned with one, else the single-request curve."""
        if self.verify_batched is None:
            return self.verify_cost
        return self.verify_batched.curve(segments, context)

    def draft_at(self, context: int) -> Callable[[int, int], float]:
        """Draft ms of one forward by (total rows, segments) at `context`, like `verify_at`."""
        if self.draft_batched is None:
            curve = self.draft_cost
            return lambda rows, segments: curve(rows)
        table = self.draft_batched
        return lambda rows, segments: table.curve(int(max(min(segments, rows), 1)), context)(rows)

    def drafting_cost(self, context: int, segments: int) -> DraftingCost:
        """ms of a drafting step's passes at `context` by (first-pass rows, requests), for steps of at most `segments`
        requests: the pass over the requests' accepted tokens, and for a tuned policy the `depth - 1` level passes of
        `width` nodes each that earn the tree's gain it weighs (untuned, the gain is one sure token, as
        `Controller._prior_rows` says: the first pass's), and the host work each drafted request adds (`host_ms`,
        tuned; a batch's requests share part of it: `host_charge`).

        Why the level passes: charged the first pass only, once `spectrt profile` priced the draft truthfully (its
        subnormal slowdown fixed: 0.8 ms a pass over 8 rows at batch 8, not 1.6), batch 8 drafted as its requests
        finished and ran 0.93x plain batched decoding; with the level passes 0.97-1.00x (`scripts/batch_vs_plain.py
        --rounds 6`, bf16, Intel Xeon, four runs; `--min-length` 1.004x), batch 4 0.98-1.00x (1.02-1.04x before),
        batch 1 the same 1.90 tokens a step. Why the host work: where verify rows are cheap (bf16dot on AMX tiles,
        Intel Xeon, batch 8) the gate drafted every request and the step's Python grew 0.5 -> 2.3 ms, which the
        cheaper rows did not pay back: 0.93x plain batched decoding."""
        levels = max(self.depth - 1, 0) if self.draft_gain is not None else 0
        if self.draft_batched is None:
            curves = (self.draft_cost,)
        else:
            curves = tuple(self.draft_batched.curve(s, context) for s in range(1, max(segments, 1) + 1))
        more = self.host_ms if self.host_more_ms is None else self.host_more_ms
        return DraftingCost(curves, levels, self.width, self.host_ms, more)

    def to_json(self) -> dict:
        data = asdict(self)
        for key in ("verify_batched", "draft_batched"):
            table = getattr(self, key)
            data[key] = table.to_json() if table is not None else None
        return data

    @classmethod
    def from_json(cls, data: dict) -> Policy:
        data = dict(data)
        cal = data.pop("calibration", None)
        fields = {k: data[k] for k in ("budget", "depth", "width", "draft", "suffix", "suffix_depth", "draft_gain",
                                       "host_ms", "host_more_ms", "first_level_gain") if k in data}
        for k in ("verify_ms", "draft_ms"):
            if k in data:
                fields[k] = tuple((int(t), float(ms)) for t, ms in data[k])
        for k in ("verify_batched", "draft_batched"):
            if data.get(k):
                fields[k] = BatchedCost.from_json(data[k])
        calibration = Calibration(**{k: tuple(v) if isinstance(v, list) else v for k, v in cal.items()}) if cal \
            else Calibration()
        return cls(**fields, calibration=calibration)


def allocation_gain(scores: list[list[float]], sizes: list[int], plain: int = 0) -> float:
    """Expected tokens of a step that verifies `sizes` nodes per request (`allocate`'s objective): one per request
    (its root, what plain batched decoding emits) plus the chosen nodes' scores, and one per `plain` request."""
    return float(len(scores) + plain) + sum(sum(row[:b - 1]) for row, b in zip(scores, sizes, strict=True))


def allocate(scores: list[list[float]], budgets: list[int], sunk_ms: float, verify: Callable[[int], float],
             base_rows: int = 0, plain: int = 0, cap: int | None = None) -> tuple[list[int], float]:
    """`allocate_reference`, natively where `verify` is a `CostCurve` and the module builds (the same sizes and rate,
    bitwise: cpu_kernels.cpp says why)."""
    curve = verify.native() if isinstance(verify, CostCurve) else None
    if curve is None:
        return allocate_reference(scores, budgets, sunk_ms, verify, base_rows, plain, cap)
    return host_kernels().allocate(scores, budgets, float(sunk_ms), curve, base_rows, plain, -1 if cap is None else cap)


def allocate_reference(scores: list[list[float]], budgets: list[int], sunk_ms: float, verify: Callable[[int], float],
                       base_rows: int = 0, plain: int = 0, cap: int | None = None) -> tuple[list[int], float]:
    """One speculation budget across a batch: nodes to verify per request (root included, >= 1 each), maximising
    expected tokens per millisecond of the ONE batched forward, and that rate.

    Request j brings its candidates' path scores in descending order (`scores[j]`, each an estimated probability
    that the target accepts the path: a node's expected tokens) and may verify at most `budgets[j]` nodes. The
    forward also carries `base_rows` rows that are paid for anyway (prefill chunks, static trees) and costs
    `verify(total rows)` ms after `sunk_ms` already spent (draft passes). Expected tokens are the N roots (one token
    each: plain batched decoding) plus the chosen scores; the best choice takes the globally highest scores (a
    prefix of each request's list, so each tree stays connected: a node's score never exceeds its parent's) and
    the count is chosen by maximising the rate, so the result is never worse than plain batched decoding
    (nothing chosen), and at batch 1 it is the per-step verify size of one request. `plain` more requests count as
    one row and one token each (requests still prefilling, as the plain step they are about to take). `cap`: at
    most that many nodes beyond the roots over all requests (the decoder's `tree_budget`).
    """
    n = len(scores) + plain
    merged = sorted(((s, j) for j, (row, most) in enumerate(zip(scores, budgets, strict=True))
                     for s in row[:max(most - 1, 0)]), key=lambda sj: (-sj[0], sj[1]))[:cap]
    counts = [0] * len(scores)
    best_k, gain = 0, float(n)
    best_rate = gain / (sunk_ms + verify(base_rows + n))
    for k, (s, _) in enumerate(merged, start=1):
        gain += s
        rate = gain / (sunk_ms + verify(base_rows + n + k))
        if rate > best_rate:
            best_k, best_rate = k, rate
    for _, j in merged[:best_k]:
        counts[j] += 1
    return [1 + c for c in counts], best_rate


def _native_costs(verify: Callable, draft: Callable) -> tuple:
    """(verify, draft) as native twins where both are the policy's own cost objects and the module builds, else None."""
    if isinstance(verify, CostCurve) and isinstance(draft, DraftingCost):
        curve, cost = verify.native(), draft.native()
        if curve is not None and cost is not None:
            return curve, cost
    return None


def drafted_rate(chosen: list[int], gains: list[float], gain_rows: list[float], catch_up: list[float], gain: float,
                 rows: int, verify: Callable[[int], float], draft: Callable[[int, int], float]) -> float:
    """`drafted_rate_reference`, natively where the costs have native twins (`_native_costs`)."""
    native = _native_costs(verify, draft)
    if native is None:
        return drafted_rate_reference(chosen, gains, gain_rows, catch_up, gain, rows, verify, draft)
    return host_kernels().drafted_rate(chosen, gains, gain_rows, catch_up, float(gain), float(rows), *native)


def choose_drafted(gains: list[float], gain_rows: list[float], catch_up: list[float], gain: float, rows: int,
                   verify: Callable[[int], float], draft: Callable[[int, int], float]) -> list[int]:
    """`choose_drafted_reference`, natively where the costs have native twins (`_native_costs`)."""
    native = _native_costs(verify, draft)
    if native is None:
        return choose_drafted_reference(gains, gain_rows, catch_up, gain, rows, verify, draft)
    return host_kernels().choose_drafted(gains, gain_rows, catch_up, float(gain), float(rows), *native)


def drafted_rate_reference(chosen: list[int], gains: list[float], gain_rows: list[float], catch_up: list[float],
                           gain: float, rows: int, verify: Callable[[int], float],
                           draft: Callable[[int, int], float]) -> float:
    """Expected tokens per ms of a step in which the `chosen` requests draft (`choose_drafted`'s terms). Sums added
    one term at a time, in order (not `sum`: Python 3.12's compensates, and the native twin must match bitwise)."""
    if not chosen:
        return gain / verify(rows)
    gained = draft_rows = verified = 0.0
    for j in chosen:
        gained += gains[j]
    for j in chosen:
        draft_rows += catch_up[j]
    for j in chosen:
        verified += gain_rows[j]
    return (gain + gained) / (draft(draft_rows, len(chosen)) + verify(rows + verified))


def choose_drafted_reference(gains: list[float], gain_rows: list[float], catch_up: list[float], gain: float,
                             rows: int, verify: Callable[[int], float],
                             draft: Callable[[int, int], float]) -> list[int]:
    """Which requests run the draft this step (indices, ascending), by expected tokens per millisecond.

    Without the draft the step expects `gain` tokens from a verify of `rows` rows. Drafting request j adds its
    expected gain `gains[j]`, the `gain_rows[j]` verified rows that gain comes with, and `catch_up[j]` rows to the
    one draft forward over the drafted requests (`draft(rows, segments)` ms). Requests are taken best gain per row
    first (fewer catch-up rows on ties) and the count maximises the rate, so drafting never looks worse than not
    drafting and a request whose draft does not pay is left out while the others draft.

    Why the rows: the tuned gain is what a tree of several rows accepts (`Controller._prior_rows`); charged as one
    row, a batch of 8 drafted every request where rows cost 0.64 ms each (bf16, Intel Xeon), and the budget then
    verified ~1 draft row a request for 0.52 tokens: 0.93x plain batched decoding.
    """
    order = sorted(range(len(gains)), key=lambda j: (-gains[j] / max(gain_rows[j], 1e-9), catch_up[j], j))
    best, best_rate = 0, gain / verify(rows)
    total, draft_rows, verified = gain, 0.0, float(rows)
    for k, j in enumerate(order, start=1):
        total += gains[j]
        draft_rows += catch_up[j]
        verified += gain_rows[j]
        rate = total / (draft(draft_rows, k) + verify(verified))
        if rate > best_rate:
            best, best_rate = k, rate
    return sorted(order[:best])


def expected_tokens(acceptance: list[list[float]], budget: int, depth: int, width: int) -> float:
    """Expected tokens per step of the dynamic tree under an acceptance table (Sequoia's model).

    `acceptance[d - 1][r]` = P(the rank-r draft child at depth d is accepted | its parent was); each of
    the `width` best nodes of a level gets its top-`width` children; the best budget-1 nodes count.
    """
    values, level = [], [1.0]
    for d in range(1, depth + 1):
        row = acceptance[min(d, len(acceptance)) - 1] if acceptance else []
        kids = [v * (row[r] if r < len(row) else 0.0) for v in level for r in range(width)]
        values += kids
        level = sorted(kids, reverse=True)[:width]
    return 1.0 + sum(sorted(values, reverse=True)[:budget - 1])


def step_ms(verify: CostCurve, draft: CostCurve | None, budget: int, depth: int, width: int) -> float:
    """One step's cost: the draft's catch-up pass (root logits), depth-1 level passes, one verify."""
    if draft is None or depth == 0:
        return verify(budget)
    return draft(2) + (depth - 1) * draft(width) + verify(budget)


def rank_policies(verify: CostCurve, draft: CostCurve | None, acceptance: list[list[float]],
                  budgets: list[int], depths: list[int], widths: list[int],
                  calibration: Calibration | None = None) -> list[tuple[Policy, float]]:
    """Every (budget, depth <= budget - 1, width) and the draft-off policy with its expected tokens per ms, best first
    (ties: the earlier in budget, depth, width order, the draft-off policy first). Suffix candidates stay on: they
    cost no forward, and each step verifies them only when its own scores say they pay."""
    curves = {"calibration": calibration or Calibration(), "verify_ms": tuple(sorted(verify.ms.items()))}
    if draft is not None:
        curves["draft_ms"] = tuple(sorted(draft.ms.items()))
    ranked = [(Policy(budget=max(budgets), depth=0, draft=False, suffix=True, **curves), 1.0 / verify(1))]
    if draft is not None:
        ranked += [(Policy(budget=b, depth=d, width=w, draft=True, suffix=True, **curves),
                    expected_tokens(acceptance, b, d, w) / step_ms(verify, draft, b, d, w))
                   for b in budgets for d in depths for w in widths if 1 <= d <= b - 1]  # deeper: never verified
    order = sorted(range(len(ranked)), key=lambda i: (-ranked[i][1], i))
    return [ranked[i] for i in order]


def choose_policy(verify: CostCurve, draft: CostCurve | None, acceptance: list[list[float]],
                  budgets: list[int], depths: list[int], widths: list[int],
                  calibration: Calibration | None = None) -> tuple[Policy, float]:
    """The (budget, depth, width) with the most expected tokens per millisecond; AR (draft off) if none beats it.
    Returns the policy and its expected tokens per millisecond (`rank_policies`' first)."""
    return rank_policies(verify, draft, acceptance, budgets, depths, widths, calibration)[0]


def pick_measured(measured: list[float], margin: float) -> int:
    """Index of the candidate to keep from measured tokens per second, candidates in the model's order: the fastest,
    unless it beats the model's first choice (index 0) by no more than `margin` (noise then decides nothing)."""
    best = max(range(len(measured)), key=lambda i: (measured[i], -i))
    return best if measured[best] > measured[0] * (1 + margin) else 0


def policy_path(artifacts: Path, target: str, draft: str | None, dtype: str) -> Path:
    """Where `spectrt tune` saves the policy for a target/draft/dtype on this machine."""
    return Path(artifacts) / f"policy-{target}-{draft or 'nodraft'}-{dtype}.json"


def load_policy(path: Path) -> Policy | None:
    """The policy `spectrt tune` saved at `path`, or None where there is none. A file that is not one (torn by a cut
    write, hand-edited) is skipped with a warning naming it and the fix, so the untuned default runs instead of
    every later load failing on a bare JSONDecodeError; a policy with invalid values is still refused."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))["policy"]
    except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        warnings.warn(f"{path} is not a saved policy ({type(e).__name__}: {e}); decoding with the untuned default: "
                      "run `spectrt tune` again (or delete the file)", stacklevel=2)
        return None
    return Policy.from_json(saved)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: a reader sees the old file or the new one,
    never a torn one (a cut `spectrt tune` left a half-written policy that blocked every later load)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
