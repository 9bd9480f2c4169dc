"""Draft maker: a draft trained on the target's own answers, of one of two kinds, written next to the target.

- `slice`: the target's first K layers (build/slice.py), sharing its tokenizer, embeddings, final norm and LM head,
  distilled (build/distill.py); a normal HF checkpoint the runtime loads like any model.
- `eagle3`: a feature-level EAGLE-3 head (build/eagle3.py, runtime/engines/eagle3.py) that drafts from the target's own
  low/mid/high hidden states, written in SpecForge's checkpoint layout.

Pipeline (`make_draft`), all inside one wall-clock budget, one job per module:

1. **answers** (build/corpus.py): the target's answers to the written (`build/prompts/distill.txt`) and its own
   self-synthesized prompts (`build/prompts/synth-seed*.txt`, build/synth.py) and to the held-out ones, shipped with the
   package for the embedded target (no generation), cached or generated (build/generation.py) for any other.
2. **teacher forcing** (build/corpus.py): one batched target forward per group of answers gives their top-k
   log-probs (and, for a head, the target's features), until the data share of the budget is spent.
3. **subset** (`frequent_ids`): the K ids most frequent in the target's answers (FR-Spec): the draft's
   head scores only them (a 4-layer draft's full head is 28M of its 42M parameters and half its step).
4. **train**: KL + CE to the target over the subset (the head with training-time test), frozen shared tensors.
5. **report**: top-1/top-3 agreement with the target's greedy answers to the held-out prompts
   (`build/prompts/heldout.txt`, never trained on), before and after training, in `draft_report.json`.

A saved slice is a normal HF checkpoint plus, for a subset head, `draft_head.weight` (the head's K rows,
bit-identical to the target's) and `draft_head.ids` (their target ids) in model.safetensors and
`spectrt_draft.vocab_subset = K` in config.json; runtime/engines/model.py and build/export.py read them. A saved head is
SpecForge's layout (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`; runtime/engines/eagle3.py).

The shipped draft (`build/drafts/<target>/`, `ship_draft`): the best draft trained once at scale for the embedded
target, bf16 weights, keyed by the target's weights checksum with a sha256 per file; `spectrt draft` installs it
(`install_shipped`) instead of training, so every machine gets the same draft in seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from spectrt.build.corpus import (
    HELDOUT_PROMPTS,
    TRAIN_PROMPTS,
    conv_key,
    generate_distill_data,
    read_prompts,
    target_fingerprint,
    teacher_force,
)
from spectrt.build.distill import (
    DistillConfig,
    atomic_save,
    evaluate,
    frozen_names,
    load_draft,
    train_draft,
    trainable_names,
)
from spectrt.build.slice import TOKENIZER_FILES, slice_target
from spectrt.runtime.engines.model import SUBSET_HEAD, SUBSET_IDS, ModelConfig
from spectrt.runtime.resources import package_path

KINDS = ("slice", "eagle3")
DRAFTS_DIR = package_path("build/drafts")  # drafts shipped with the package, one directory per target
SHIP_NAME = "ship.json"
GENERATION_SHARE = 0.7  # of a run's data window, at most, for generating answers (the rest: forcing them)

DEFAULT_BUDGET_MINUTES = 10.0
REPORT_NAME = "draft_report.json"
STATE_NAME = "train_state.pt"
SHIPPED_FILES = ("config.json", "model.safetensors", REPORT_NAME)
SHIPPED_LIMIT_MB = 30


def frequent_ids(records: Sequence[dict], k: int, vocab: int) -> torch.Tensor:
    """The `k` ids most frequent in the target's answers in `records` (ties: lower id), sorted ascending.

    Counted on the answers' tokens (EAGLE-3 counts assistant tokens), which is what the target emits.
    """
    if not 0 < k < vocab:
        raise ValueError(f"vocab_subset must be between 1 and {vocab - 1} (0 = full head), got {k}")
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in records:
        answer = r["input_ids"][r["prompt_len"]:].long()
        counts.index_add_(0, answer, torch.ones(len(answer), dtype=torch.long))
    return torch.sort(counts, descending=True, stable=True).indices[:k].sort().values


def save_draft(model, slice_dir: Path, out_dir: Path, trainable: Sequence[str], extra_config: dict,
               vocab_ids: torch.Tensor | None = None) -> Path:
    """Write a normal HF checkpoint: the slice's tensors with the trained ones replaced, plus the subset head.

    Frozen tensors are copied from the slice file itself, so they are bit-identical to the target's;
    this is checked against the live model too. With `vocab_ids` the subset head's rows (copied from the
    slice's head) and ids are added (runtime/engines/model.py SUBSET_HEAD, SUBSET_IDS).
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
    kind: str = "slice",
    layers: int = 4,
    budget_minutes: float = DEFAULT_BUDGET_MINUTES,
    prompts: Path | Sequence[Path] = TRAIN_PROMPTS,
    heldout: Path = HELDOUT_PROMPTS,
    work_dir: Path | None = None,
    resume: bool = True,
    max_steps: int | None = None,
    progress: bool = True,
    config: DistillConfig | None = None,
    init_from: Path | None = None,
    **overrides,
) -> Path:
    """Make a `kind` draft (slice: `target`'s first `layers` layers; eagle3: a feature head) within `budget_minutes`.

    `out_dir` receives the checkpoint + tokenizer files + draft_report.json. Intermediate files (slice, cached
    target answers, training state) live in `work_dir` (default: `<out_dir>.work`). Budget: held-out answers (fp32,
    shipped or cached) and their teacher forcing, then training answers (shipped, cached, or generated) and their
    teacher forcing while less than `data_fraction` (a head: `head_data_fraction`) of the budget has passed, then
    training until the budget minus the final evaluation. With `resume` a matching training state in `work_dir` is
    continued (interrupted or finished run), so running again keeps improving the draft; without one, `init_from`
    (an EAGLE-3 head made for this target, e.g. the shipped draft) gives the starting weights and the draft
    vocabulary, so a run on more data continues a finished draft (the optimizer starts afresh). `max_steps` caps
    training steps (tests); `overrides` set DistillConfig fields. Raises ValueError (saying what to fix) for an
    unknown kind, a layer count outside 1..target layers-1, an empty or missing corpus, held-out prompts inside the
    corpus, a target without LM head or without config.json, a negative vocab_subset, `init_from` for a slice.
    """
    t_start = time.monotonic()
    target, out_dir = Path(target), Path(out_dir)
    cfg = dataclasses.replace(config or DistillConfig(), **overrides)
    if kind not in KINDS:
        raise ValueError(f"--kind {kind!r} is not a draft kind: choose one of {', '.join(KINDS)}")
    if init_from is not None and kind != "eagle3":
        raise ValueError("--init-from continues an EAGLE-3 head: use it with --kind eagle3")
    if budget_minutes <= 0:
        raise ValueError(f"budget_minutes must be positive, got {budget_minutes}")
    if not (target / "config.json").is_file():
        raise ValueError(f"{target} is not a Hugging Face checkpoint (no config.json): pass the target's directory")
    (out_dir / SHIP_NAME).unlink(missing_ok=True)  # a draft made here is no installed shipped one (`installed_current`)
    prompt_files = [Path(prompts)] if isinstance(prompts, (str, Path)) else [Path(p) for p in prompts]
    train_convs = [conv for path in prompt_files for conv in read_prompts(path)]
    eval_convs = read_prompts(heldout)
    overlap = {conv_key(c) for c in train_convs} & {conv_key(c) for c in eval_convs}
    if overlap:
        raise ValueError(f"{len(overlap)} held-out conversations also appear in "
                         f"{', '.join(map(str, prompt_files))}: remove them from one file")
    work_dir = Path(work_dir) if work_dir else out_dir.with_name(out_dir.name + ".work")
    slice_dir = slice_target(target, layers, work_dir / f"slice-{layers}") if kind == "slice" else None
    target_config = ModelConfig.from_dir(target)
    vocab = target_config.vocab_size
    if cfg.vocab_subset < 0:
        raise ValueError(f"vocab_subset must be 0 (full head) or a positive number of ids, got {cfg.vocab_subset}")
    subset = cfg.vocab_subset if cfg.vocab_subset < vocab else 0  # a subset as large as the vocabulary is the head
    fingerprint = target_fingerprint(target)
    budget_s = budget_minutes * 60
    deadline = t_start + budget_s
    if kind == "eagle3":
        from spectrt.runtime.engines.eagle3 import default_feature_layers

        features = default_feature_layers(target_config.num_layers)
    else:
        features = ()

    # held-out answers first (small, needed for the report), then as much training data as the data share allows
    eval_answers, eval_stats = generate_distill_data(target, eval_convs, work_dir, cfg, eval_set=True,
                                                     progress=progress)
    forced_dir = work_dir / f"teacher-{fingerprint[:16]}"  # kept across runs: forcing 1M tokens takes most of an hour
    eval_records, eval_tf = teacher_force(target, eval_answers, cfg.eval_dtype, cfg.top_k, features,
                                          progress=progress, desc="teacher forcing (held-out)", cache_dir=forced_dir)
    fraction = cfg.data_fraction if kind == "slice" else cfg.head_data_fraction
    data_end = t_start + fraction * budget_s
    # new answers stop where the window's last share begins, which teacher forcing keeps for them (it forces a token
    # 3-6x faster than one is generated). Why: generating until the window's end left forcing one call, so a first
    # run for a target without shipped answers trained its whole budget on a handful of answers
    forcing_s = (1 - GENERATION_SHARE) * fraction * budget_s
    answers, data_stats = generate_distill_data(target, train_convs, work_dir, cfg, deadline=data_end - forcing_s,
                                                progress=progress, time_budget_s=GENERATION_SHARE * fraction * budget_s)
    records, train_tf = teacher_force(target, answers, cfg.gen_dtype, cfg.top_k, features, deadline=data_end,
                                      rows_per_call=cfg.tf_rows_per_call, seed=cfg.seed, progress=progress,
                                      cache_dir=forced_dir)
    data_stats["teacher_forcing"] = train_tf
    init = None
    if init_from is not None:  # the vocabulary the head was trained on (a full-vocabulary head carries no d2t)
        from spectrt.build.eagle3 import load_head_init

        init = load_head_init(Path(init_from), target_config, features)
        vocab_ids = init["d2t"] + torch.arange(len(init["d2t"])) if "d2t" in init else None
    elif subset:
        vocab_ids = _draft_vocab(records, subset, vocab, work_dir / f"vocab-{out_dir.name}-{kind}.pt", fingerprint,
                                 resume)
    else:
        vocab_ids = None
    if kind == "slice":
        train = _train_slice(target, slice_dir, out_dir, layers, records, eval_records, vocab_ids, cfg, deadline,
                             work_dir, resume, max_steps, progress, fingerprint)
    else:
        train = _train_eagle3(target, target_config, out_dir, features, records, eval_records, vocab_ids, cfg,
                              deadline, work_dir, resume, max_steps, progress, fingerprint, init)
    untrained, distilled, train_stats, extra_report = train
    report = {
        "target": str(target),
        "target_fingerprint": fingerprint,  # `spectrt draft` reuses the draft only for this very target
        "kind": kind,
        **extra_report,
        "budget_minutes": budget_minutes,
        "init_from": str(init_from) if init_from is not None else None,
        "vocab_subset": subset,
        "heldout": {"prompts": len(eval_convs), "tokens": untrained["tokens"], "untrained": untrained,
                    "distilled": distilled},
        "budget_split_s": {"heldout_answers": eval_stats["generation_s"],
                           "heldout_teacher_forcing": eval_tf["seconds"],
                           "training_data": data_stats["generation_s"], "teacher_forcing": train_tf["seconds"],
                           "training": train_stats["train_s"]},
        "data": data_stats,
        "heldout_data": {**eval_stats, "teacher_forcing": eval_tf},
        "train": train_stats,
        "config": dataclasses.asdict(cfg),
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    (out_dir / REPORT_NAME).write_text(json.dumps(report, indent=2))
    return out_dir


def _draft_vocab(records: Sequence[dict], subset: int, vocab: int, path: Path, tag: str, resume: bool
                 ) -> torch.Tensor:
    """The draft vocabulary: the `subset` ids most frequent in the answers, chosen once per work dir and kept for a
    resumed run. Why: a rerun of an interrupted run has more answers (it reaches ones the first did not), so another
    top-K, and its training state was dropped as another draft's: every rerun of a cut run restarted from step 0."""
    if resume and path.is_file():
        saved = torch.load(path, weights_only=True)
        if saved.get("tag") == tag and saved.get("subset") == subset:
            return saved["ids"]
    ids = frequent_ids(records, subset, vocab)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_save({"tag": tag, "subset": subset, "ids": ids}, path)  # a run cut mid-write leaves no torn file
    return ids


def _train_budget(deadline: float, eval_tokens: int) -> float:
    eval_reserve = 5 + 2 * eval_tokens / 1000  # measured ~1.5 s per 1000 eval tokens, plus save
    return max(1.0, deadline - time.monotonic() - eval_reserve)


def _train_slice(target, slice_dir, out_dir, layers, records, eval_records, vocab_ids, cfg, deadline, work_dir,
                 resume, max_steps, progress, fingerprint):
    untrained = evaluate(load_draft(slice_dir), eval_records, vocab_ids)
    model, train_stats = train_draft(
        slice_dir, records, work_dir / f"{STATE_NAME[:-3]}-{out_dir.name}-{layers}.pt", cfg,
        budget_s=_train_budget(deadline, untrained["tokens"]), max_steps=max_steps, resume=resume,
        progress=progress, tag=fingerprint, vocab_ids=vocab_ids,
    )
    distilled = evaluate(model, eval_records, vocab_ids)
    names = trainable_names(model, cfg.train_norm)
    extra = {"distilled": True, "trainable": "layers+norm" if cfg.train_norm else "layers",
             "heldout_top1": distilled["top1"], "heldout_top3": distilled["top3"]}
    save_draft(model, slice_dir, out_dir, names, extra, vocab_ids)
    return untrained, distilled, train_stats, {"layers": layers, "frozen": frozen_names(model, cfg.train_norm)}


def _train_eagle3(target, target_config, out_dir, features, records, eval_records, vocab_ids, cfg, deadline,
                  work_dir, resume, max_steps, progress, fingerprint, init=None):
    from spectrt.build.eagle3 import Eagle3Module, evaluate_head, save_head, train_head
    from spectrt.runtime.engines.model import Transformer

    ref = Transformer.load(target, measure_kernels=False)  # fp32 embedding, head rows and final norm
    if ref.head_ids is not None:
        raise ValueError(f"{target} has a vocabulary-subset head: a feature head needs the target's full LM head")
    ids = vocab_ids if vocab_ids is not None else torch.arange(target_config.vocab_size)
    pad = json.loads((Path(target) / "config.json").read_text()).get("pad_token_id") or 0
    untrained_model = Eagle3Module(target_config, ids, cfg.head_init_std)
    untrained_model.init_from_target(ref.head, ref.norm)
    untrained = evaluate_head(untrained_model, eval_records, ref.embed, cfg.ttt_steps, pad_id=pad)
    model, train_stats = train_head(
        records, target_config, ref.embed, ref.head, ref.norm, ids,
        work_dir / f"{STATE_NAME[:-3]}-{out_dir.name}-eagle3.pt", cfg,
        budget_s=_train_budget(deadline, untrained["tokens"]), max_steps=max_steps, resume=resume,
        progress=progress, tag=fingerprint, pad_id=pad, init=init,
        evaluate=lambda m: evaluate_head(m, eval_records, ref.embed, cfg.ttt_steps, pad_id=pad),
    )
    distilled = evaluate_head(model, eval_records, ref.embed, cfg.ttt_steps, pad_id=pad)
    extra = {"distilled": True, "sliced_from": None, "target": str(target), "heldout_top1": distilled["top1"],
             "heldout_top3": distilled["top3"]}
    save_head(model, target, out_dir, features, extra)
    return untrained, distilled, train_stats, {"feature_layers": list(features)}


# --------------------------------------------------------------------------------------------------
# The shipped draft: trained once at scale for the embedded target, installed instead of trained


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def ship_draft(draft_dir: Path, target: Path, out_dir: Path, command: str, force: bool = False) -> Path:
    """Write `draft_dir` (a trained draft of `target`) as package data in `out_dir`: its weights in bf16 (half the
    bytes; the runtime casts them to its precision), config and report, and `ship.json` with the target's weights
    checksum (no other target ever reads it), a sha256 per file and the `command` that remakes it. A draft with a
    lower held-out top-1 than the one `out_dir` ships for the same target is refused (ValueError) unless `force`:
    a shorter run on a slower day must not replace a better draft."""
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    new_top1 = _heldout_top1(draft_dir)
    if not force and (out_dir / SHIP_NAME).is_file() and (out_dir / REPORT_NAME).is_file():
        shipped_for = json.loads((out_dir / SHIP_NAME).read_text()).get("target")
        old_top1 = _heldout_top1(out_dir)
        if shipped_for == target_fingerprint(target) and new_top1 < old_top1:
            raise ValueError(f"{draft_dir} agrees less with the target than the shipped draft (held-out top-1 "
                             f"{new_top1:.1%} < {old_top1:.1%}): train it longer, or pass --force to ship it anyway")
    # built and checked beside the package, then moved in, ship.json last: a refused or interrupted ship leaves the
    # shipped draft as it was (written in place, a too-large draft replaced the weights and then failed the check,
    # and every install refused the package as corrupted)
    staging = out_dir.with_name(out_dir.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                 for k, v in load_file(draft_dir / "model.safetensors").items()}
        save_file(state, staging / "model.safetensors", metadata={"format": "pt"})
        for name in ("config.json", REPORT_NAME):
            shutil.copy(draft_dir / name, staging / name)
        size_mb = sum((staging / n).stat().st_size for n in SHIPPED_FILES) / 2**20
        if size_mb > SHIPPED_LIMIT_MB:
            raise ValueError(f"the draft takes {size_mb:.1f} MB: a shipped draft must stay under {SHIPPED_LIMIT_MB} "
                             "MB")
        meta = {"target": target_fingerprint(target), "target_name": Path(target).name, "command": command,
                "sha256": {n: _sha256(staging / n) for n in SHIPPED_FILES}}
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / SHIP_NAME).unlink(missing_ok=True)  # no ship.json vouches for a half-moved draft
        for name in SHIPPED_FILES:
            os.chmod(staging / name, 0o644)  # safetensors writes 0600; servers may run as another user
            os.replace(staging / name, out_dir / name)
        (out_dir / SHIP_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def _heldout_top1(draft_dir: Path) -> float:
    return json.loads((Path(draft_dir) / REPORT_NAME).read_text())["heldout"]["distilled"]["top1"]


def shipped_draft(target: Path, drafts_dir: Path = DRAFTS_DIR) -> Path | None:
    """The shipped draft made for exactly this target (its weights checksum), else None."""
    metas = sorted(Path(drafts_dir).glob(f"*/{SHIP_NAME}")) if Path(drafts_dir).is_dir() else []
    if not metas:
        return None
    fingerprint = target_fingerprint(target)
    return next((m.parent for m in metas if json.loads(m.read_text()).get("target") == fingerprint), None)


def install_shipped(target: Path, out_dir: Path, drafts_dir: Path = DRAFTS_DIR) -> Path | None:
    """Copy the shipped draft of `target` into `out_dir` (with the target's tokenizer files), checked against its
    sha256s; None when none was shipped for this target. Raises ValueError naming the file when one is corrupted."""
    source = shipped_draft(target, drafts_dir)
    if source is None:
        return None
    meta = json.loads((source / SHIP_NAME).read_text())
    for name, digest in meta["sha256"].items():
        if not (source / name).is_file() or _sha256(source / name) != digest:
            raise ValueError(f"the shipped draft's {source / name} fails its sha256 (a corrupted package): "
                             "reinstall spectrt")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in meta["sha256"]:
        shutil.copy(source / name, out_dir / name)
    for name in TOKENIZER_FILES:
        if (Path(target) / name).is_file():
            shutil.copy(Path(target) / name, out_dir / name)
    shutil.copy(source / SHIP_NAME, out_dir / SHIP_NAME)  # last: what was installed, once it all was
    return out_dir


def installed_current(target: Path, out_dir: Path, drafts_dir: Path = DRAFTS_DIR) -> bool | None:
    """For a draft `install_shipped` put in `out_dir`: whether it is the one shipped now for this target (None: a
    draft made here, or installed before installs recorded their `ship.json`). Why: `spectrt draft` reused whatever
    `out_dir` held, so after an update that shipped a better draft the old one was served, tuned and benchmarked."""
    installed = Path(out_dir) / SHIP_NAME
    if not installed.is_file():
        return None
    source = shipped_draft(target, drafts_dir)
    return source is not None and (source / SHIP_NAME).read_text() == installed.read_text()
