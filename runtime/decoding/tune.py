"""`spectrt tune`: pick the speculation policy that decodes the most tokens per second on this machine.

Inputs: the engines' cost curves (`spectrt profile`'s artifacts/cost_profile-<target>-<dtype>.json when
present, else a short measurement here) and acceptance measured on held-out prompts with a generous
measurement tree (every candidate verified): P(accept) by draft depth and rank (Sequoia's table),
by draft probability (calibrating the node scores dynamic trees rank by) and by suffix match length.
A model (Sequoia's expected tokens over the cost curves) ranks every (budget, depth, width); its best few are then
timed in the decode loop on the same prompts, interleaved, and the fastest is kept (`FINALISTS`). The chosen
policy, its curves and calibration are saved under artifacts/, keyed by target/draft/dtype, and `generate`,
`bench` and the Triton model use it by default.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch
from spectrt.runtime.decoding.decoder import Decoder, Job, StepClock
from spectrt.runtime.decoding.policy import (
    BatchedCost,
    Calibration,
    CostCurve,
    Policy,
    expected_tokens,
    pick_measured,
    policy_path,
    rank_policies,
    write_atomically,
)
from spectrt.runtime.decoding.profile import cost_profile_path
from spectrt.runtime.decoding.tree import AUTO
from tqdm import tqdm

PROFILE_TOKENS = (1, 2, 4, 8, 16, 32, 64)
BUDGETS = [2, 3, 4, 5, 6, 8, 12, 16, 24, 32]
# The model's best candidates timed in the decode loop, and how much faster than the model's own choice one must run to
# replace it: a guard against what the model does not see (host work per draft level, the draft pass on cold caches,
# a verify curve that flattens while this host's bandwidth is low, the per-step truncation of dynamic trees). Measured
# (Zen 4, bf16, one process, no prefix cache, order rotated): on the tune prompts the five finalists decoded within
# 2-3% of each other (noise), so the margin is wider than that; on the bench's chat prompts budget 3 / depth 2 /
# width 1 ran 1.32-1.34x AR against 1.21-1.28x for the model's budget 2 / depth 1 (repetitive: 1.78-2.01x against
# 1.85-1.97x).
FINALISTS = 5
MEASURED_MARGIN = 0.05


def curve_from_profile(profile: dict, role: str, context: int = 128) -> CostCurve | None:
    """The cost curve of `role` ("target" / "draft") at the profiled context nearest `context`."""
    table = profile.get(role)
    if not table:
        return None
    nearest = min(table, key=lambda c: abs(int(c) - context))
    return CostCurve({int(t): float(ms) for t, ms in table[nearest].items()})


def measure_curve(engine, tokens: tuple[int, ...] = PROFILE_TOKENS, context: int = 128, repeats: int = 5) -> CostCurve:
    """Median forward milliseconds at `context` cached tokens for each T (the fallback when no profile exists)."""
    from spectrt.runtime.decoding.bench import step_cost_ms

    ms, most = {}, 0.0
    for t in tokens:  # a forward of more tokens never costs less: a dip is noise (a shared machine)
        most = max(most, step_cost_ms(engine, t, context, repeats))
        ms[t] = most
    return CostCurve(ms)


def _profiled_draft(profile: dict, draft: Path | None) -> bool:
    """Whether the profile's draft tables were measured on a draft of `draft`'s shape (a profile from before shapes
    were recorded: taken as such). Why: profiled with the sliced draft, a head was tuned on the slice's costs."""
    from spectrt.runtime.decoding.profile import draft_shape

    return draft is None or "draft_shape" not in profile or profile["draft_shape"] == draft_shape(draft)


def cost_curves(decoder: Decoder, artifacts: Path, target: str, dtype: str, draft_dir: Path | None = None
                ) -> tuple[CostCurve, CostCurve | None, str]:
    """(target curve, draft curve or None, where they came from): the profile file wins when present (its draft
    curve only when measured on a draft of `draft_dir`'s shape; else the draft is timed here)."""
    path = cost_profile_path(Path(target), dtype, artifacts)
    if path.is_file():
        profile = json.loads(path.read_text(encoding="utf-8"))
        verify = curve_from_profile(profile, "target")
        draft = curve_from_profile(profile, "draft") if decoder.draft is not None and \
            _profiled_draft(profile, draft_dir) else None
        if verify is not None and (draft is not None or decoder.draft is None):
            return verify, draft, str(path)
        if verify is not None:  # the profile's target curve, the draft timed here
            return verify, _draft_curve(decoder), f"{path} (the draft timed by spectrt tune: profiled on another)"
    return measure_curve(decoder.target), _draft_curve(decoder), "measured by spectrt tune (no cost profile file)"


def _draft_curve(decoder: Decoder) -> CostCurve | None:
    if decoder.draft is None:
        return None
    from spectrt.runtime.decoding.profile import HeadRows

    # an EAGLE-3 head also reads hidden rows: timed as `spectrt profile` times it
    engine = HeadRows(decoder.draft) if decoder.drafter.feature_layers is not None else decoder.draft
    return measure_curve(engine, tuple(t for t in PROFILE_TOKENS if t <= 16))


def batched_tables(artifacts: Path, target: str, dtype: str, with_draft: bool, draft_dir: Path | None = None
                   ) -> dict[str, BatchedCost]:
    """The profile's batched cost tables as policy fields (`verify_batched`, `draft_batched`), {} without them: what
    each decode step weighs (its own segment count and context) instead of the single-request curve; the draft's
    only when measured on a draft of `draft_dir`'s shape."""
    path = cost_profile_path(Path(target), dtype, artifacts)
    profile = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    tables = {}
    if profile.get("target_batched"):
        tables["verify_batched"] = BatchedCost.from_json(profile["target_batched"])
    if with_draft and profile.get("draft_batched") and _profiled_draft(profile, draft_dir):
        tables["draft_batched"] = BatchedCost.from_json(profile["draft_batched"])
    return tables


CALIBRATION_PRIOR = 8.0  # pseudo-candidates at the default guess behind each calibration cell's measured rate


def monotone(values: list[float], weights: list[float]) -> list[float]:
    """The weighted least-squares non-decreasing fit of `values` (pool adjacent violators): a cell that reads below
    an earlier one is pooled with it, weighted by how many candidates each holds."""
    blocks: list[list[float]] = []  # [mean, weight, cells]
    for v, w in zip(values, weights, strict=True):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (v2, w2, n2), (v1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [mean for mean, _, n in blocks for _ in range(int(n))]


def acceptance_tables(trace: list[tuple], depth: int, width: int,
                      default: Calibration | None = None) -> tuple[list[list[float]], Calibration, dict]:
    """From DecodeStats.trace: acceptance by draft depth/rank, draft-probability bins and suffix match length.

    Only candidates whose parent was accepted count (the rest were never in play). Each calibration cell is its
    measured rate shrunk toward the default guess by `CALIBRATION_PRIOR` pseudo-candidates (a cell without data keeps
    the default), then made non-decreasing in draft probability and in match length (`monotone`). Why: a tune run
    reads ~90 suffix candidates over six match lengths, and cells of a handful read 1.0 and 0.0 (the shipped
    tuning: match >= 5 at 1.0, match 4 at 0.0); at batch 8 the budget then verified suffix rows scored as sure
    tokens of which about half were accepted, +2% rows for +1% tokens (docs/serving.md).
    """
    default = default or Calibration()
    tried: dict[tuple, int] = defaultdict(int)
    hits: dict[tuple, int] = defaultdict(int)
    bins = len(default.draft)
    for kind, key, parent_ok, accepted in trace:
        if not parent_ok:
            continue
        if kind == "draft":
            d, rank, prob = key
            cells = [("rank", d, rank), ("bin", min(int(prob * bins), bins - 1))]
        else:
            match, k = key
            cells = [("match", min(match, len(default.suffix) - 1))] if k == 0 else [("next",)]
        for cell in cells:
            tried[cell] += 1
            hits[cell] += bool(accepted)

    def rate(cell, fallback):
        return hits[cell] / tried[cell] if tried[cell] else fallback

    def shrunk(cells, prior):
        m = CALIBRATION_PRIOR
        rates = [(hits[c] + m * p) / (tried[c] + m) for c, p in zip(cells, prior, strict=True)]
        return monotone(rates, [tried[c] + m for c in cells])

    acceptance = [[rate(("rank", d, r), 0.0) for r in range(width)] for d in range(1, depth + 1)]
    matches = range(len(default.suffix))
    calibration = Calibration(
        draft=tuple(shrunk([("bin", i) for i in range(bins)], default.draft)),
        suffix=tuple(shrunk([("match", m) for m in matches], default.suffix)),
        suffix_next=shrunk([("next",)], [default.suffix_next])[0],
    )
    counts = {"draft_candidates": sum(v for k, v in tried.items() if k[0] == "rank"),
              "suffix_candidates": sum(v for k, v in tried.items() if k[0] in ("match", "next"))}
    return acceptance, calibration, counts


def measure_acceptance(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int, depth: int,
                       width: int) -> list[tuple]:
    """Decode the prompts greedily verifying every candidate of a depth x width dynamic tree; the trace."""
    budget = decoder.max_tree_tokens
    # flat costs and a free draft: every candidate with any chance is drafted and verified
    probe = Policy(budget=budget, depth=depth, width=width, draft=decoder.draft is not None, suffix=True,
                   verify_ms=((1, 1.0),), draft_ms=((1, 1e-6),))
    trace: list[tuple] = []
    decoder.record = True
    try:
        for ids in tqdm(prompts, desc="tune: acceptance", unit="prompt"):
            trace += decoder.generate(ids, max_new_tokens, policy=probe).stats.trace
    finally:
        decoder.record = False
    return trace


def distinct(ranked: list[tuple[Policy, float]]) -> list[tuple[Policy, float]]:
    """The ranking without candidates the model cannot tell from a better-ranked one (same budget, depth and rate: at
    depth 1 the width changes neither the expected tokens nor the cost), so the finalists are different trees."""
    seen, out = set(), []
    for policy, rate in ranked:
        key = (policy.budget, policy.depth, round(rate, 12))
        if key not in seen:
            seen.add(key)
            out.append((policy, rate))
    return out


def time_finalists(decoder: Decoder, prompts: list[list[int]], policies: list[Policy],
                   max_new_tokens: int) -> list[float]:
    """Decode tokens per second of each policy in the loop (greedy, dynamic trees), the policies interleaved prompt
    by prompt so that a drift of the machine's speed hits them alike, each prompt starting with the next policy. Run
    it on a decoder without the prefix cache (`spectrt tune` does): with it, every later decode of a prompt starts
    from the first one's KV and draft rows, and the first policy of each prompt read 6-11% slower."""
    tokens, seconds = [0] * len(policies), [0.0] * len(policies)
    for p, ids in enumerate(tqdm(prompts, desc="tune: finalists", unit="prompt")):
        for k in range(len(policies)):
            i = (p + k) % len(policies)
            stats = decoder.generate(ids, max_new_tokens, policy=policies[i]).stats
            tokens[i] += stats.new_tokens
            seconds[i] += stats.decode_seconds
    return [t / s if s else 0.0 for t, s in zip(tokens, seconds, strict=True)]


def drafting_host_ms(decoder: Decoder, prompts: list[list[int]], policy: Policy, max_new_tokens: int) -> float:
    """Host ms a drafted request adds to a step (`Policy.host_ms`, which the draft gate charges): the loop's host time
    a step (`Decoder.clock`: total minus forwards) under `policy` minus the target alone's, at batch 1, each prompt
    both ways in turn. It holds the step's own part too, which a batch's drafted requests share (`further_host_ms`
    measures what each further one adds)."""
    clocks = {False: StepClock(), True: StepClock()}
    for ids in tqdm(prompts, desc="tune: host work", unit="prompt"):
        for drafting in (False, True):
            decoder.clock = clocks[drafting]
            decoder.generate(ids, max_new_tokens, policy=policy if drafting else None)
    decoder.clock = StepClock()
    return max(clocks[True].per_step_ms()["host"] - clocks[False].per_step_ms()["host"], 0.0)


def further_host_ms(decoder: Decoder, prompts: list[list[int]], policy: Policy, max_new_tokens: int,
                    first_ms: float) -> float | None:
    """Host ms each further drafted request adds to a step (`Policy.host_more_ms`): batches of as many requests as
    the decoder has slots (`spectrt tune --batch`, at most the prompts), every request drafting (the gate told the
    draft is sure and free) and then the same batch by the target alone, `min_length` keeping the batch full; the
    host time a step between the two, less the first drafted request's `first_ms`, over the further requests a step.
    None where no batch of 2 fits."""
    n = min(decoder.max_active, len(prompts))
    if n < 2:
        return None
    forced = replace(policy, draft_gain=float(policy.budget), first_level_gain=None, host_ms=0.0, host_more_ms=0.0)
    served, clocks = decoder.controller.policy, {False: StepClock(), True: StepClock()}
    try:
        decoder.controller.policy = forced
        for start in tqdm(range(0, len(prompts) - n + 1, n), desc=f"tune: host work at batch {n}", unit="batch"):
            for drafting in (False, True):
                decoder.clock = clocks[drafting]
                decoder.run([Job(list(ids), max_new_tokens, AUTO if drafting else None, min_length=max_new_tokens)
                             for ids in prompts[start:start + n]])
    finally:
        decoder.controller.policy, decoder.clock = served, StepClock()
    drafting = clocks[True]
    further = drafting.rows / max(drafting.steps, 1) - 1  # requests a step besides the first (all draft)
    added = drafting.per_step_ms()["host"] - clocks[False].per_step_ms()["host"]
    return max((added - first_ms) / further, 0.0) if further > 0.5 else None


def run_tune(pipe, target: Path, draft: Path | None, dtype: str, artifacts: Path, prompts: list[str],
             max_new_tokens: int = 64, depth: int = 4, width: int = 3) -> dict:
    """Measure, choose, save; returns the saved report."""
    decoder = pipe.decoder
    start = time.perf_counter()
    verify, draft_curve, source = cost_curves(decoder, artifacts, Path(target).name, dtype, draft)
    trace = measure_acceptance(decoder, [pipe.encode(p) for p in prompts], max_new_tokens, depth, width)
    acceptance, calibration, counts = acceptance_tables(trace, depth, width)
    budgets = [b for b in BUDGETS if b <= decoder.max_tree_tokens]
    ranked = rank_policies(verify, draft_curve, acceptance, budgets, list(range(1, depth + 1)),
                           list(range(1, width + 1)), calibration)
    tables = batched_tables(artifacts, Path(target).name, dtype, decoder.draft is not None, draft)
    finalists = [(replace(p, draft_gain=expected_tokens(acceptance, p.budget, p.depth, p.width) - 1
                          if p.draft else None,
                          first_level_gain=expected_tokens(acceptance, p.budget, 1, p.width) - 1 if p.draft else None,
                          **tables), r) for p, r in distinct(ranked)[:FINALISTS]]
    measured, chosen = [None], 0  # one candidate (no draft: the draft-off policy): nothing to time
    if len(finalists) > 1:
        measured = time_finalists(decoder, [pipe.encode(p) for p in prompts], [p for p, _ in finalists],
                                  max_new_tokens)
        chosen = pick_measured(measured, MEASURED_MARGIN)
    policy, rate = finalists[chosen]
    if policy.draft:
        ids = [pipe.encode(p) for p in prompts]
        first = drafting_host_ms(decoder, ids, policy, max_new_tokens)
        more = further_host_ms(decoder, ids, policy, max_new_tokens, first)
        policy = replace(policy, host_ms=round(first, 3), host_more_ms=None if more is None else round(more, 3))
    report = {
        "target": str(target), "draft": str(draft) if draft else None, "dtype": dtype,
        "threads": torch.get_num_threads(), "cost_source": source, "prompts": len(prompts),
        "max_new_tokens": max_new_tokens, "candidates": counts,
        "acceptance_by_depth_rank": acceptance,
        "expected_tokens_per_second": 1000 * rate, "ar_tokens_per_second": 1000 / verify(1),
        "finalists": [{"budget": p.budget, "depth": p.depth, "width": p.width, "draft": p.draft,
                       "expected_tokens_per_second": round(1000 * r, 1),
                       "measured_tokens_per_second": None if m is None else round(m, 1)}
                      for (p, r), m in zip(finalists, measured, strict=True)],
        "time": time.strftime("%Y-%m-%d %H:%M:%S"), "tune_seconds": round(time.perf_counter() - start, 1),
        "policy": policy.to_json(),
    }
    out = policy_path(artifacts, Path(target).name, Path(draft).name if draft else None, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(out, json.dumps(report, indent=2))
    report["path"] = str(out)
    return report
