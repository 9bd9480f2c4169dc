"""Draft maker: slice the target's first layers, distill the slice on the target's own answers, write it.

A slice shares the target's tokenizer, embeddings, final norm and LM head, so its proposals live
in exactly the target's vocabulary; the runtime loads the result like any model.

Pipeline (`make_draft`), all inside one wall-clock budget, one job per module:

1. **slice** (build/slice.py): embeddings + first K decoder layers + final norm + LM head.
2. **corpus** (build/corpus.py): the target's answers with top-k log-probs, cached per target checksum.
3. **subset** (`frequent_ids`): the K ids most frequent in the target's answers (FR-Spec): the draft's
   head scores only them (a 4-layer draft's full head is 28M of its 42M parameters and half its step).
4. **train** (build/distill.py): KL + CE to the target over the subset, frozen shared tensors.
5. **report** (`evaluate`): top-1/top-3 agreement with the target's greedy answers to the held-out
   prompts (`build/prompts/heldout.txt`), before and after training, in `draft_report.json`.

The saved draft is a normal HF checkpoint plus, for a subset head, `draft_head.weight` (the head's K rows,
bit-identical to the target's) and `draft_head.ids` (their target ids) in model.safetensors and
`spectrt_draft.vocab_subset = K` in config.json; runtime/model.py and build/export.py read them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from spectrt.build.corpus import (
    DISTILL_PROMPTS,
    HELDOUT_PROMPTS,
    conv_key,
    generate_distill_data,
    read_prompts,
    target_fingerprint,
)
from spectrt.build.distill import DistillConfig, evaluate, frozen_names, load_draft, train_draft, trainable_names
from spectrt.build.slice import TOKENIZER_FILES, slice_target
from spectrt.runtime.model import SUBSET_HEAD, SUBSET_IDS

DEFAULT_BUDGET_MINUTES = 10.0
REPORT_NAME = "draft_report.json"
STATE_NAME = "train_state.pt"


def frequent_ids(records: Sequence[dict], k: int, vocab: int) -> torch.Tensor:
    """The `k` ids most frequent in the target's answers in `records` (ties: lower id), sorted ascending.

    Counted on the answers' tokens (EAGLE-3 counts assistant tokens), which is what the target emits.
    """
    if not 0 < k < vocab:
        raise ValueError(f"vocab_subset must be between 1 and {vocab - 1} (0 = full head), got {k}")
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in records:
        counts.index_add_(0, r["input_ids"][r["prompt_len"]:].long(), torch.ones(len(r["top_ids"]), dtype=torch.long))
    return torch.sort(counts, descending=True, stable=True).indices[:k].sort().values


def save_draft(model, slice_dir: Path, out_dir: Path, trainable: Sequence[str], extra_config: dict,
               vocab_ids: torch.Tensor | None = None) -> Path:
    """Write a normal HF checkpoint: the slice's tensors with the trained ones replaced, plus the subset head.

    Frozen tensors are copied from the slice file itself, so they are bit-identical to the target's;
    this is checked against the live model too. With `vocab_ids` the subset head's rows (copied from the
    slice's head) and ids are added (runtime/model.py SUBSET_HEAD, SUBSET_IDS).
    """
    slice_dir, out_dir = Path(slice_dir), Path(out_dir)
    state = load_file(slice_dir / "model.safetensors")
    live = model.state_dict()
    for name, tensor in state.items():
        if name in trainable:
            state[name] = live[name].detach().to(tensor.dtype).contiguous()
        elif name in live and not torch.equal(live[name], tensor):
            raise RuntimeError(f"frozen tensor {name} changed during training: refusing to write the draft")
    config = json.loads((slice_dir / "config.json").read_text())
    if vocab_ids is not None:
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        state[SUBSET_HEAD] = head[vocab_ids].contiguous()
        state[SUBSET_IDS] = vocab_ids.to(torch.int64).contiguous()
        extra_config = {**extra_config, "vocab_subset": len(vocab_ids)}
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(state, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_dir / "model.safetensors")
    config["spectrt_draft"] = {**config.get("spectrt_draft", {}), **extra_config}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (slice_dir / name).is_file():
            shutil.copy(slice_dir / name, out_dir / name)
    return out_dir


def make_draft(
    target: Path,
    out_dir: Path,
    layers: int = 4,
    budget_minutes: float = DEFAULT_BUDGET_MINUTES,
    prompts: Path = DISTILL_PROMPTS,
    heldout: Path = HELDOUT_PROMPTS,
    work_dir: Path | None = None,
    resume: bool = True,
    max_steps: int | None = None,
    progress: bool = True,
    config: DistillConfig | None = None,
    **overrides,
) -> Path:
    """Slice `target`'s first `layers` layers, distill them within `budget_minutes`, write a HF checkpoint.

    `out_dir` receives config.json + model.safetensors + tokenizer files + draft_report.json.
    Intermediate files (slice, cached target answers, training state) live in `work_dir`
    (default: `<out_dir>.work`). Budget: held-out answers (fp32, cached), then training data while
    the cache's generation seconds (all runs together) stay below `data_fraction` of the budget, then
    training until the budget minus the final evaluation: a rerun with a filled cache trains all the
    time. With `resume` a matching training state in `work_dir` is continued (interrupted or finished
    run), so running again keeps improving the draft. `max_steps` caps training steps (tests);
    `overrides` set DistillConfig fields. Raises ValueError (saying what to fix) for a layer count
    outside 1..target layers-1, an empty or missing corpus, held-out prompts inside the corpus, a
    target without LM head or without config.json, a negative vocab_subset.
    """
    t_start = time.monotonic()
    target, out_dir = Path(target), Path(out_dir)
    cfg = dataclasses.replace(config or DistillConfig(), **overrides)
    if budget_minutes <= 0:
        raise ValueError(f"budget_minutes must be positive, got {budget_minutes}")
    if not (target / "config.json").is_file():
        raise ValueError(f"{target} is not a Hugging Face checkpoint (no config.json): pass the target's directory")
    train_convs = read_prompts(prompts)
    eval_convs = read_prompts(heldout)
    overlap = {conv_key(c) for c in train_convs} & {conv_key(c) for c in eval_convs}
    if overlap:
        raise ValueError(f"{len(overlap)} held-out conversations also appear in {prompts}: remove them from one file")
    work_dir = Path(work_dir) if work_dir else out_dir.with_name(out_dir.name + ".work")
    slice_dir = slice_target(target, layers, work_dir / f"slice-{layers}")
    vocab = json.loads((slice_dir / "config.json").read_text())["vocab_size"]
    if cfg.vocab_subset < 0:
        raise ValueError(f"vocab_subset must be 0 (full head) or a positive number of ids, got {cfg.vocab_subset}")
    subset = cfg.vocab_subset if cfg.vocab_subset < vocab else 0  # a subset as large as the vocabulary is the head
    fingerprint = target_fingerprint(target)
    budget_s = budget_minutes * 60
    deadline = t_start + budget_s

    # held-out answers first (small, needed for the report), then as much training data as allowed
    eval_records, eval_stats = generate_distill_data(target, eval_convs, work_dir, cfg, eval_set=True,
                                                     progress=progress)
    data_s = cfg.data_fraction * budget_s
    records, data_stats = generate_distill_data(target, train_convs, work_dir, cfg, deadline=t_start + data_s,
                                                progress=progress, time_budget_s=data_s)
    vocab_ids = frequent_ids(records, subset, vocab) if subset else None

    untrained = evaluate(load_draft(slice_dir), eval_records, vocab_ids)
    eval_reserve = 5 + 2 * untrained["tokens"] / 1000  # measured ~1.5 s per 1000 eval tokens, plus save
    train_budget = max(1.0, deadline - time.monotonic() - eval_reserve)
    model, train_stats = train_draft(
        slice_dir, records, work_dir / f"{STATE_NAME[:-3]}-{out_dir.name}-{layers}.pt", cfg,
        budget_s=train_budget, max_steps=max_steps, resume=resume,
        progress=progress, tag=fingerprint, vocab_ids=vocab_ids,
    )
    distilled = evaluate(model, eval_records, vocab_ids)
    names = trainable_names(model, cfg.train_norm)
    extra = {"distilled": True, "trainable": "layers+norm" if cfg.train_norm else "layers",
             "heldout_top1": distilled["top1"], "heldout_top3": distilled["top3"]}
    save_draft(model, slice_dir, out_dir, names, extra, vocab_ids)
    report = {
        "target": str(target),
        "layers": layers,
        "budget_minutes": budget_minutes,
        "vocab_subset": subset,
        "heldout": {"prompts": len(eval_convs), "tokens": untrained["tokens"], "untrained": untrained,
                    "distilled": distilled},
        "budget_split_s": {"heldout_answers": eval_stats["generation_s"], "training_data": data_stats["generation_s"],
                           "training": train_stats["train_s"]},
        "data": data_stats,
        "heldout_data": eval_stats,
        "train": train_stats,
        "frozen": frozen_names(model, cfg.train_norm),
        "config": dataclasses.asdict(cfg),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2))
    return out_dir
