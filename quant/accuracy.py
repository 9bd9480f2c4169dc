"""Accuracy gates of an INT8 target against its FP target, teacher-forced on held-out text.

The text is the FP target's own greedy answers to the held-out prompts (build/prompts/heldout.txt), the
tokens it would serve. At every answer position both engines see the same context and we measure:
- top-1 agreement: the INT8 argmax equals the FP argmax (greedy decoding diverges where it does not);
- mean KL(FP || INT8) over the full vocabulary, in nats;
- perplexity of the answers under each model, and the relative delta.
The gate (default top-1 >= 0.97) is reported loudly when missed; both engines are the engines that serve
(the native forward, runtime/engines/int8.py for INT8), not the fake-quantized module. Every recipe and precision is
judged on the same records (their fingerprint is in the report).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from spectrt.build.corpus import HELDOUT_PROMPTS, generate_distill_data, read_prompts
from spectrt.build.distill import DistillConfig
from spectrt.runtime.engines.engine import Engine, load_engine

GATE_TOP1 = 0.97


def answer_logits(engine: Engine, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """Logits predicting each answer token of `ids` (prompt + answer), from one causal prefill."""
    t = ids.shape[0]
    cache = engine.new_cache(t, t)
    logits = engine.forward(ids.long(), torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril(), cache)
    return logits[prompt_len - 1:t - 1]


def agreement(reference: torch.Tensor, candidate: torch.Tensor, answer: torch.Tensor) -> dict:
    """Sums over positions: argmax matches, KL(reference || candidate), both models' answer NLL."""
    ref_logp, cand_logp = reference.float().log_softmax(-1), candidate.float().log_softmax(-1)
    rows = torch.arange(len(answer))
    return {
        "positions": len(answer),
        "top1_matches": int((reference.argmax(-1) == candidate.argmax(-1)).sum()),
        "kl_sum": float((ref_logp.exp() * (ref_logp - cand_logp)).sum()),
        "nll_reference": float(-ref_logp[rows, answer].sum()),
        "nll_candidate": float(-cand_logp[rows, answer].sum()),
    }


def summarize(sums: dict, gate: float) -> dict:
    n = max(sums["positions"], 1)
    ppl_ref, ppl_cand = math.exp(sums["nll_reference"] / n), math.exp(sums["nll_candidate"] / n)
    top1 = sums["top1_matches"] / n
    return {"positions": sums["positions"], "top1_agreement": round(top1, 4), "mean_kl": round(sums["kl_sum"] / n, 5),
            "perplexity_fp": round(ppl_ref, 4), "perplexity_int8": round(ppl_cand, 4),
            "perplexity_delta_pct": round(100 * (ppl_cand / ppl_ref - 1), 3),
            "gate_top1": gate, "gate_passed": top1 >= gate}


def records_fingerprint(records: list[dict]) -> str:
    """Identifies the exact held-out positions a report was computed on (the same for every recipe compared)."""
    h = hashlib.sha1()
    for rec in records:
        h.update(rec["input_ids"].long().numpy().tobytes())
        h.update(int(rec["prompt_len"]).to_bytes(8, "little"))
    return h.hexdigest()[:16]


def heldout_records(target: Path, progress: bool = True) -> list[dict]:
    """The FP target's greedy answers to the held-out prompts (generated once, cached with the quant work)."""
    from spectrt.quant.quantize import work_dir

    records, _ = generate_distill_data(target, read_prompts(HELDOUT_PROMPTS), work_dir(target), DistillConfig(),
                                       eval_set=True, progress=progress)
    return records


def engine_agreement(reference: Engine, candidate: Engine, records: list[dict], gate: float = GATE_TOP1,
                     progress: bool = True) -> dict:
    """The gates of `candidate` against `reference` on `records` (dicts with `input_ids` = prompt + answer and
    `prompt_len`), with the records' fingerprint."""
    from tqdm.auto import tqdm

    sums = {"positions": 0, "top1_matches": 0, "kl_sum": 0.0, "nll_reference": 0.0, "nll_candidate": 0.0}
    for rec in tqdm(records, desc="accuracy gates", unit="answer", disable=not progress):
        ids, start = rec["input_ids"].long(), rec["prompt_len"]
        part = agreement(answer_logits(reference, ids, start), answer_logits(candidate, ids, start), ids[start:])
        for k, v in part.items():
            sums[k] += v
    return {"heldout_answers": len(records), "heldout_fingerprint": records_fingerprint(records),
            **summarize(sums, gate)}


def accuracy_report(target: Path, quantized: Path, gate: float = GATE_TOP1, progress: bool = True,
                    log: Callable[[str], None] = print, records: list[dict] | None = None, dtype: str = "fp32") -> dict:
    """The gates of `quantized` (run in `dtype`) against the fp32 `target` on `records` (default: held-out)."""
    records = records if records is not None else heldout_records(target, progress)
    fp, q = load_engine(Path(target), dtype="fp32"), load_engine(Path(quantized), dtype=dtype)
    report = {"target": str(target), "quantized": str(quantized), "dtype": dtype,
              **engine_agreement(fp, q, records, gate, progress)}
    message = gate_message(report)
    if report["gate_passed"]:
        log(message)
    else:
        print(message, file=sys.stderr)
    return report


def gate_message(report: dict) -> str:
    line = (f"INT8 vs FP on {report['positions']} held-out positions: top-1 agreement {report['top1_agreement']:.4f}, "
            f"mean KL {report['mean_kl']:.5f} nats, perplexity {report['perplexity_fp']:.3f} -> "
            f"{report['perplexity_int8']:.3f} ({report['perplexity_delta_pct']:+.2f}%)")
    if report["gate_passed"]:
        return line + f" [gate top-1 >= {report['gate_top1']}: passed]"
    banner = "!" * 100
    return (f"{banner}\nACCURACY GATE MISSED: top-1 agreement {report['top1_agreement']:.4f} < {report['gate_top1']}: "
            f"this INT8 target changes greedy outputs noticeably.\n{line}\n{banner}")
