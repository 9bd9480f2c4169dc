"""`spectrt draft | quantize | compare | engines`: the offline work (drafts, INT8 targets, engine plans)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spectrt.build.distill import GREEDY_ANSWERS, DistillConfig
from spectrt.cli.common import add_model_args, model_dirs, positive, share
from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS, CheckpointError, default_draft, resolve_target


def cmd_draft(args: argparse.Namespace) -> int:
    from spectrt.build.corpus import HELDOUT_PROMPTS, read_prompts
    from spectrt.build.draft import install_shipped, make_draft
    from spectrt.runtime.decoding.bench import draft_runtime_report

    target = resolve_target(args.target, args.artifacts)
    default = default_draft(target, args.artifacts)
    out = Path(args.out) if args.out else (default if args.kind == "slice" else
                                           default.with_name(default.name.removesuffix("-draft") + "-eagle3"))
    report_path = out / "draft_report.json"
    if (out / "config.json").is_file() and report_path.is_file() and not args.force:
        if _made_for(target, out, report_path):
            print(f"reusing the draft in {out} (--force rebuilds it)")
            return 0
        print(f"{out} holds a draft made for another target, or a shipped draft that is not the one shipped now "
              "for this target: replacing it")
    if not args.train and args.out is None:  # the draft trained once at scale for this very target, if shipped
        try:
            installed = install_shipped(target, default)
        except ValueError as e:
            print(f"{e}; training one here instead", file=sys.stderr)
            installed = None
        if installed is not None:
            held = json.loads((installed / "draft_report.json").read_text())["heldout"]["distilled"]
            print(f"installed the shipped draft in {installed} (held-out top-1 {held['top1']:.1%}; "
                  "--train makes one here instead)")
            return 0
    overrides = {} if args.lr is None else {"head_lr" if args.kind == "eagle3" else "lr": args.lr}
    if args.data_share is not None:
        overrides["head_data_fraction" if args.kind == "eagle3" else "data_fraction"] = args.data_share
    if args.train_lm_head:
        if args.kind != "eagle3":
            raise SystemExit("--train-lm-head is for --kind eagle3 (a slice's LM head is the target's, frozen)")
        overrides["head_train_lm_head"] = True
    if args.greedy_answers:
        overrides.update(GREEDY_ANSWERS)
    if args.prompts:
        overrides["prompts"] = args.prompts
    make_draft(target, out, kind=args.kind, layers=args.layers, budget_minutes=args.budget_minutes,
               vocab_subset=args.vocab_subset, init_from=args.init_from, **overrides)
    if args.kind == "eagle3":  # the decode loop takes the head through the proposer interface (decoding/propose.py)
        return _report_head(target, out, report_path)
    # what the draft buys at run time, measured on held-out prompts with the default tree
    prompts = [conv[0]["content"] for conv in read_prompts(HELDOUT_PROMPTS) if len(conv) == 1][:8]
    report = json.loads(report_path.read_text())
    report["runtime"] = draft_runtime_report(target, out, prompts, max_new_tokens=64)
    report_path.write_text(json.dumps(report, indent=2))
    r, held, split = report["runtime"], report["heldout"]["distilled"], report["budget_split_s"]
    print(f"{out}: held-out top-1 {held['top1']:.1%} / top-3 {held['top3']:.1%}, tau {r['tau']:.2f} with tree "
          f"{r['tree']}, {r['speedup_vs_ar']:.2f}x AR tokens/s, draft step {r['draft_to_target_step_cost']:.0%} of a "
          f"target step; budget: {split['training_data']:.0f} s target answers, {split['training']:.0f} s training")
    return 0


def _made_for(target: Path, out: Path, report_path: Path) -> bool:
    """Whether the draft in `out` is this target's: an installed shipped draft the one shipped now, any other made
    for these weights (its report's fingerprint; older reports: the same checkpoint path). Why: the default draft
    directory is named after the target directory, so `--target runB/checkpoint-500` reused runA's."""
    from spectrt.build.corpus import target_fingerprint
    from spectrt.build.draft import installed_current

    shipped = installed_current(target, out)
    if shipped is not None:
        return shipped
    report = json.loads(report_path.read_text())
    if report.get("target_fingerprint"):
        return report["target_fingerprint"] == target_fingerprint(target)
    return Path(report.get("target", "")).resolve() == Path(target).resolve()


def _report_head(target: Path, out: Path, report_path: Path) -> int:
    """An EAGLE-3 head's draft step against a target step (both at context 128, this machine, as served)."""
    from spectrt.runtime.decoding.bench import step_cost_ms
    from spectrt.runtime.engines.eagle3 import Eagle3Head, head_step_ms
    from spectrt.runtime.engines.engine import DTYPES, draft_dtype, load_engine

    engine = load_engine(target)
    head = Eagle3Head.load(out, engine, DTYPES[draft_dtype("torch", "fp32")])
    head_ms, target_ms = head_step_ms(head), step_cost_ms(engine)
    report = json.loads(report_path.read_text())
    report["runtime"] = {"target_step_ms": target_ms, "draft_step_ms": head_ms["level"],
                         "catch_up_ms": head_ms["catch_up"], "draft_to_target_step_cost": head_ms["level"] / target_ms}
    report_path.write_text(json.dumps(report, indent=2))
    held, split = report["heldout"]["distilled"], report["budget_split_s"]
    print(f"{out}: held-out top-1 {held['top1']:.1%} / top-3 {held['top3']:.1%} (by draft depth "
          f"{', '.join(f'{x:.1%}' for x in held['top1_by_step'])}), draft step {head_ms['level']:.2f} ms = "
          f"{head_ms['level'] / target_ms:.1%} of a target step; budget: {split['teacher_forcing']:.0f} s teacher "
          f"forcing, {split['training']:.0f} s training")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from spectrt.quant.quantize import CALIBRATION_PROMPTS, quantize_target

    target = resolve_target(args.target, args.artifacts)
    calib_prompts = args.calib_prompts or CALIBRATION_PROMPTS  # resolved here: the parser imports no quantize.py
    if args.search:
        from spectrt.quant.search import search_recipes

        search_recipes(target, out=args.search_out, calib_prompts=calib_prompts, samples=args.calib_samples,
                       force=args.force)
        return 0
    quantize_target(target, args.out, args.qformat, calib_prompts, args.calib_samples, force=args.force)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from spectrt.quant.compare import run_compare
    from spectrt.quant.quantize import default_output
    from spectrt.runtime.decoding.bench import read_prompt_sets

    if args.backend != "torch" or args.engines:
        raise ValueError("compare runs every precision (fp32, bf16, INT8) on the CPU engines in one run: drop "
                         "--backend/--engines (the TensorRT plans are compared by scripts/gpu_check.sh)")
    target, draft = model_dirs(args)
    models = {"fp32": (target, "fp32"), "bf16": (target, "bf16")}
    for qformat in dict.fromkeys((args.qformat, args.weight_only)):
        path = default_output(target, qformat)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"INT8 target {path} does not exist: run `spectrt quantize --qformat {qformat}` "
                                  f"(make quantize QFORMAT={qformat}) first")
        models[qformat] = (path, "fp32")
    # not the long set: four precisions each prefilling 1-2k tokens a prompt, for what chat and repetitive show
    prompt_sets = read_prompt_sets(args.prompts, args.limit, ("chat", "repetitive"))
    run_compare(target, draft, models, prompt_sets, args.max_new_tokens, args.out, args.batch, args.max_seq_len,
                artifacts=args.artifacts)
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    from spectrt.build.engines import ROLES, EngineBuildError, engine_sources, make_engines

    target, draft = engine_sources(args.target, args.draft, args.artifacts)
    int8 = {}
    for item in args.int8_graph:
        role, _, path = item.partition("=")
        if role not in ROLES or not path:
            raise EngineBuildError(f"--int8-graph {item!r}: expected target=PATH or draft=PATH")
        int8[role] = Path(path)
    archs = [a.strip().lower() for a in args.arch.split(",") if a.strip()] if args.arch else None
    out = make_engines(target, draft, args.out, args.precision, archs, args.max_seq_len, args.max_tree_tokens,
                       plans=not args.no_plans, module=args.trt_module, force=args.force, int8_graphs=int8,
                       qformat=args.qformat, max_batch=args.max_batch)
    print(out)
    return 0


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from spectrt.build.compile import RTX_ARCHS
    from spectrt.build.engines import DEFAULT_MAX_BATCH, DEFAULT_MAX_SEQ_LEN, DEFAULT_MAX_TREE_TOKENS, PRECISIONS
    from spectrt.quant.recipes import RECIPES

    p.add_argument("--target", help="HF checkpoint dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="draft checkpoint dir: an EAGLE-3 head (SpecForge layout) or a LLaMA-family draft "
                   "(default: the target's default draft in --artifacts, the shipped EAGLE-3 head for the embedded "
                   "target)")
    p.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS, help="where converted models live")
    p.add_argument("--out", type=Path, help="engines directory (default: engines/<target>-<precision>)")
    p.add_argument("--precision", default="fp16", choices=PRECISIONS, help="TensorRT plan precision")
    p.add_argument("--arch", default=None,
                   help=f"compute capabilities for TensorRT-RTX plans, e.g. sm80,sm86 (default: {','.join(RTX_ARCHS)})")
    p.add_argument("--max-seq-len", type=int, default=DEFAULT_MAX_SEQ_LEN)
    p.add_argument("--max-tree-tokens", type=int, default=DEFAULT_MAX_TREE_TOKENS)
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                   help="requests per batched forward the TensorRT plans take (the server's max_active)")
    p.add_argument("--no-plans", action="store_true", help="graphs only (ONNX Runtime), no TensorRT plans")
    p.add_argument("--trt-module", choices=["tensorrt", "tensorrt_rtx"], default=None,
                   help="TensorRT Python module (default: tensorrt if installed, else tensorrt_rtx)")
    p.add_argument("--qformat", default="int8_sq", choices=list(RECIPES),
                   help="with --precision int8: which `spectrt quantize` checkpoint of the target to compile")
    p.add_argument("--int8-graph", action="append", default=[], metavar="ROLE=PATH",
                   help="a Q/DQ tree-verify ONNX for PRECISION=int8, e.g. target=quant/target.qdq.onnx")
    p.add_argument("--force", action="store_true", help="rebuild everything")


def add_parsers(sub) -> None:
    d = sub.add_parser("draft", help="train a draft on the target's own answers: a slice of the target or an "
                       "EAGLE-3 feature head")
    d.add_argument("--target", help="HF checkpoint dir or .gguf (default: embedded model)")
    d.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    d.add_argument("--kind", choices=("slice", "eagle3"), default="slice",
                   help="slice: the target's first --layers layers, distilled; eagle3: a one-layer head fed with the "
                   "target's low/mid/high features (SpecForge's checkpoint layout), default out <target>-eagle3")
    d.add_argument("--layers", type=int, default=4, help="slice: layers kept")
    d.add_argument("--budget-minutes", type=float, default=10.0,
                   help="wall clock for data and training (2 cores, the embedded target's shipped answers: a head "
                        "reaches ~35%% held-out top-1 in 10 minutes and 45%% in 50; the shipped draft's learning "
                        "curve is in build/drafts/<target>/draft_report.json)")
    d.add_argument("--vocab-subset", type=int, default=DistillConfig.vocab_subset,
                   help="draft head over the K most frequent ids of the target's answers (0: full vocabulary)")
    d.add_argument("--out", help="output dir (default: <artifacts>/<target>-draft)")
    d.add_argument("--init-from", type=Path, default=None,
                   help="eagle3: start from this head's weights and draft vocabulary (e.g. the shipped draft, to "
                        "continue it on more data) when no training state of this --out is resumed")
    d.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {DistillConfig.head_lr:g}); a run that continues a trained head "
                        "does better with a lower one (make ship-draft: 5e-4): at the full rate the shipped head first "
                        "fell from 45.1%% to 42.5%% held-out top-1")
    d.add_argument("--data-share", type=share, default=None,
                   help=f"share of the budget after which no new data is made or teacher-forced (default "
                        f"{DistillConfig.data_fraction:g} for a slice, {DistillConfig.head_data_fraction:g} for a "
                        "head); a long run that must force all the shipped answers before it trains needs more")
    d.add_argument("--train-lm-head", action="store_true",
                   help="eagle3: train the head's draft-vocabulary LM head too (it starts as the target's rows and "
                        "stays frozen by default)")
    d.add_argument("--prompts", type=Path, nargs="+", default=None,
                   help="training prompt files, one prompt per line or a JSON list of messages (default: "
                        "build/prompts/distill.txt and the shipped synth-seed0/1.txt)")
    d.add_argument("--greedy-answers", action="store_true",
                   help="train on one greedy answer of the target per prompt instead of sampled ones (4 a prompt at "
                        "T=0.7); shipped for the embedded target's prompt files, else made here (cached in <out>.work)")
    d.add_argument("--force", action="store_true", help="rebuild even if a finished draft exists")
    d.add_argument("--train", action="store_true",
                   help="train a draft here even where the package ships one for this target")
    d.set_defaults(func=cmd_draft)

    from spectrt.quant.recipes import DEFAULT_QFORMAT, DEFAULT_SAMPLES, RECIPES

    q = sub.add_parser("quantize", help="calibrate + quantize the target to INT8 with ModelOpt (+ accuracy gates)")
    q.add_argument("--target", help="HF checkpoint dir or .gguf (default: embedded model)")
    q.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    q.add_argument("--qformat", default=DEFAULT_QFORMAT,
                   help=f"the recipe (quant/recipes.py): {', '.join(RECIPES)}; default {DEFAULT_QFORMAT}")
    q.add_argument("--calib-prompts", type=Path,
                   help="calibration prompts, one per line; must not overlap the evaluation prompts")
    q.add_argument("--calib-samples", type=int, default=DEFAULT_SAMPLES, help="calibration conversations to use")
    q.add_argument("--out", type=Path, help="output dir (default: <target>-<qformat> next to the target)")
    q.add_argument("--force", action="store_true", help="re-quantize even if an up-to-date result exists")
    q.add_argument("--search", action="store_true", help="quantize with every recipe and measure each on the same "
                   "held-out positions -> which pass the gate, which is fastest (written to --search-out)")
    q.add_argument("--search-out", type=Path, default=Path("bench/results/compare"))
    q.set_defaults(func=cmd_quantize)

    cmp = sub.add_parser("compare", help="fp32 vs bf16 vs INT8 W8A8 vs INT8 weight-only targets, each alone and with "
                         "the default speculation, single and batched, in one interleaved run")
    add_model_args(cmp)
    cmp.add_argument("--qformat", default=DEFAULT_QFORMAT, help="the INT8 W8A8 recipe (`spectrt quantize` output)")
    cmp.add_argument("--weight-only", default="int8_wo", help="the INT8 weight-only recipe compared")
    cmp.add_argument("--prompts", type=Path, help="one prompt per line (default: bench/prompts.txt and "
                     "bench/prompts_repetitive.txt)")
    cmp.add_argument("--limit", type=positive, help="use only the first N prompts of each set")
    cmp.add_argument("--max-new-tokens", type=positive, default=128)
    cmp.add_argument("--batch", type=positive, default=8, help="requests of the batched runs (1 and N concurrent)")
    cmp.add_argument("--out", type=Path, default=Path("bench/results/compare"))
    cmp.set_defaults(func=cmd_compare)

    e = sub.add_parser("engines", help="tree-verify ONNX graphs + TensorRT plans -> engines/<name>/")
    _add_engine_args(e)
    e.set_defaults(func=cmd_engines)

