"""`spectrt` command line: generate, bench, profile, tune, draft, quantize, compare, engines, serve, client."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spectrt.build.checkpoint import DEFAULT_ARTIFACTS, CheckpointError, default_draft, resolve_models, resolve_target
from spectrt.build.distill import DistillConfig
from spectrt.runtime.decoding.tree import AUTO, TreeError, parse_tree_arg


def _positive(value: str) -> int:
    if not value.lstrip("-").isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)


def _models(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(target, draft) checkpoint or engine dirs for the chosen backend; draft None for --no-spec."""
    if args.engines:
        from spectrt.build.engines import engine_models

        target, draft = engine_models(args.engines, args.backend)
        return target, None if getattr(args, "no_spec", False) else draft
    if args.backend != "torch":
        raise CheckpointError(f"--backend {args.backend} runs built engines: pass --engines engines/<name> "
                              "(make engines)")
    return resolve_models(args.target, "none" if getattr(args, "no_spec", False) else args.draft, args.artifacts)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="HF checkpoint dir or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="draft checkpoint dir (default: the target's distilled draft in --artifacts); "
                   "none: draft-less speculation with suffix candidates")
    p.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS, help="where converted models live")
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                   help="auto: bf16 on the native CPU forward (exact, 2x fp32's speed), else fp32")
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"])
    p.add_argument("--engines", type=Path, help="engines dir from `spectrt engines` (onnxruntime/tensorrt)")
    p.add_argument("--max-seq-len", type=_positive, default=2048)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = disabled")
    p.add_argument("--seed", type=int, default=None, help="same seed + same engine -> same output")
    p.add_argument("--children", default="sample", choices=["sample", "topk"],
                   help="with sampling: draft children drawn without replacement, or the draft's top-k")


def _sampling(args: argparse.Namespace):
    from spectrt.runtime.decoding.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.engines.engine import fallback_notice

    params = _sampling(args)  # validate before loading models
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: pass some text with --prompt")
    target, draft = _models(args)
    if notice := fallback_notice(args.backend):
        print(notice, file=sys.stderr)
    pipe = Pipeline(target, draft, args.backend, args.dtype, args.max_seq_len, artifacts=args.artifacts)
    on_text = None if args.json else (lambda s: print(s, end="", flush=True))
    gen = pipe.generate(args.prompt, args.max_new_tokens, None if args.no_spec else args.tree,
                        chat=not args.raw, on_text=on_text, params=params, children=args.children)
    if args.json:
        print(json.dumps(gen.as_dict()))
        return 0
    s = gen.stats
    p = pipe.policy
    mode = "autoregressive" if args.no_spec else f"tree {args.tree_spec}" if args.tree_spec != "auto" else (
        f"policy budget {p.budget} depth {p.depth if p.draft and draft else 0} width {p.width}"
        f"{' + suffix' if p.suffix else ''}")
    print(f"\n\n[{mode}] {s.new_tokens} tokens in {s.decode_seconds:.2f}s = {s.tokens_per_second:.1f} tok/s decode "
          f"(prefill {s.prompt_tokens} tokens {s.prefill_seconds:.2f}s) | "
          f"tau {s.tau:.2f} | target passes {s.target_passes} | draft passes {s.draft_passes} | "
          f"finish {gen.finish_reason}", file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from spectrt.runtime.decoding.bench import run_bench, run_multi_turn

    target, draft = _models(args)
    (run_multi_turn if args.multi_turn else run_bench)(target, draft, args)
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    from spectrt.runtime.decoding.profile import run_profile

    target, draft = resolve_models(args.target, "none" if args.no_draft else args.draft, args.artifacts)
    run_profile(target, draft, args.dtype, args.artifacts, args.out, args.repeats)
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from spectrt.build.corpus import HELDOUT_PROMPTS, read_prompts
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.tune import run_tune

    target, draft = _models(args)
    if args.prompts:
        from spectrt.runtime.decoding.bench import read_prompts as read_lines

        prompts = read_lines(args.prompts)
    else:
        prompts = [conv[0]["content"] for conv in read_prompts(HELDOUT_PROMPTS) if len(conv) == 1]
    pipe = Pipeline(target, draft, args.backend, args.dtype, args.max_seq_len, artifacts=args.artifacts)
    pipe.generate(prompts[0], 8, None)  # warm-up: kernel choice
    report = run_tune(pipe, target, draft, args.dtype, args.artifacts, prompts[:args.limit], args.max_new_tokens,
                      args.depth, args.width)
    p = report["policy"]
    print(f"{report['path']}: budget {p['budget']}, depth {p['depth']}, width {p['width']}, draft {p['draft']}, "
          f"suffix {p['suffix']}; expected {report['expected_tokens_per_second']:.1f} tok/s vs AR "
          f"{report['ar_tokens_per_second']:.1f} (costs: {report['cost_source']})")
    return 0


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
        print(f"reusing the draft in {out} (--force rebuilds it)")
        return 0
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
    make_draft(target, out, kind=args.kind, layers=args.layers, budget_minutes=args.budget_minutes,
               vocab_subset=args.vocab_subset)
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
    from spectrt.quant.quantize import quantize_target

    target = resolve_target(args.target, args.artifacts)
    if args.search:
        from spectrt.quant.search import search_recipes

        search_recipes(target, out=args.search_out, calib_prompts=args.calib_prompts, samples=args.calib_samples,
                       force=args.force)
        return 0
    quantize_target(target, args.out, args.qformat, args.calib_prompts, args.calib_samples, force=args.force)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from spectrt.quant.compare import run_compare
    from spectrt.quant.quantize import default_output
    from spectrt.runtime.decoding.bench import PROMPT_SETS, read_prompts

    if args.backend != "torch" or args.engines:
        raise ValueError("compare runs every precision (fp32, bf16, INT8) on the CPU engines in one run: drop "
                         "--backend/--engines (the TensorRT plans are compared by scripts/gpu_check.sh)")
    target, draft = _models(args)
    models = {"fp32": (target, "fp32"), "bf16": (target, "bf16")}
    for qformat in dict.fromkeys((args.qformat, args.weight_only)):
        path = default_output(target, qformat)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"INT8 target {path} does not exist: run `spectrt quantize --qformat {qformat}` "
                                  f"(make quantize QFORMAT={qformat}) first")
        models[qformat] = (path, "fp32")
    sets = {Path(args.prompts).stem: Path(args.prompts)} if args.prompts else PROMPT_SETS
    prompt_sets = {name: read_prompts(path)[:args.limit] for name, path in sets.items()}
    run_compare(target, draft, models, prompt_sets, args.max_new_tokens, args.out, args.batch, args.max_seq_len,
                artifacts=args.artifacts)
    return 0


def cmd_engines(args: argparse.Namespace) -> int:
    from spectrt.build.engines import run

    run(args)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from spectrt.runtime.serving.serve import cmd_serve as serve

    return serve(args)


def cmd_client(args: argparse.Namespace) -> int:
    from spectrt.runtime.serving.client import cmd_client as client

    return client(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with tree speculative decoding")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--tree", dest="tree_spec", default=None,
                   help="a static tree: expansion per depth, e.g. 3,2,2,1,1; none: the target alone (default: auto, "
                        "dynamic trees under the policy from `spectrt tune`)")
    g.add_argument("--max-new-tokens", type=_positive, default=128)
    g.add_argument("--no-spec", action="store_true", help="run the target alone (autoregressive baseline)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="AR vs chain vs tree on a prompt set; writes bench/results")
    _add_model_args(b)
    b.add_argument("--prompts", type=Path, help="one prompt per line (default: bench/prompts.txt)")
    b.add_argument("--trees", default=None, help="semicolon-separated trees to compare, e.g. '1,1,1;2,1'")
    b.add_argument("--max-new-tokens", type=_positive, default=128)
    b.add_argument("--limit", type=_positive, help="use only the first N prompts")
    b.add_argument("--temperatures", default="0", help="comma-separated, e.g. 0,0.7,1.0 (0 = greedy)")
    b.add_argument("--out", type=Path, default=Path("bench/results"))
    b.add_argument("--multi-turn", action="store_true",
                   help="chat conversations with and without the prefix cache: time to first token by turn, "
                   "throughput at --concurrency (--prompts: one user turn a line, a blank line between conversations; "
                   "default bench/prompts_multiturn.txt)")
    b.add_argument("--concurrency", type=_positive, default=8, help="--multi-turn: conversations decoded together")
    b.set_defaults(func=cmd_bench)

    pr = sub.add_parser("profile", help="this machine's cost curve (ms per forward vs tree size) -> cost profile")
    pr.add_argument("--target", help="HF checkpoint dir or .gguf (default: embedded model)")
    pr.add_argument("--draft", help="draft checkpoint dir (default: the target's distilled draft)")
    pr.add_argument("--no-draft", action="store_true", help="profile the target only")
    pr.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS, help="where the cost profile is saved")
    pr.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                    help="auto: bf16 on the native CPU forward, else fp32")
    pr.add_argument("--repeats", type=_positive, default=15, help="timed forwards per shape (median reported)")
    pr.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    pr.set_defaults(func=cmd_profile)

    t = sub.add_parser("tune", help="pick the speculation policy from this machine's costs and measured acceptance")
    _add_model_args(t)
    t.add_argument("--prompts", type=Path, help="one prompt per line (default: build/prompts/heldout.txt)")
    t.add_argument("--limit", type=_positive, default=8, help="prompts used")
    t.add_argument("--max-new-tokens", type=_positive, default=64)
    t.add_argument("--depth", type=_positive, default=4, help="deepest draft level considered")
    t.add_argument("--width", type=_positive, default=3, help="widest draft expansion considered")
    t.set_defaults(func=cmd_tune)

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
    d.add_argument("--force", action="store_true", help="rebuild even if a finished draft exists")
    d.add_argument("--train", action="store_true",
                   help="train a draft here even where the package ships one for this target")
    d.set_defaults(func=cmd_draft)

    from spectrt.quant.quantize import CALIBRATION_PROMPTS, DEFAULT_SAMPLES
    from spectrt.quant.recipes import DEFAULT_QFORMAT, RECIPES

    q = sub.add_parser("quantize", help="calibrate + quantize the target to INT8 with ModelOpt (+ accuracy gates)")
    q.add_argument("--target", help="HF checkpoint dir or .gguf (default: embedded model)")
    q.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS)
    q.add_argument("--qformat", default=DEFAULT_QFORMAT,
                   help=f"the recipe (quant/recipes.py): {', '.join(RECIPES)}; default {DEFAULT_QFORMAT}")
    q.add_argument("--calib-prompts", type=Path, default=CALIBRATION_PROMPTS,
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
    _add_model_args(cmp)
    cmp.add_argument("--qformat", default=DEFAULT_QFORMAT, help="the INT8 W8A8 recipe (`spectrt quantize` output)")
    cmp.add_argument("--weight-only", default="int8_wo", help="the INT8 weight-only recipe compared")
    cmp.add_argument("--prompts", type=Path, help="one prompt per line (default: bench/prompts.txt and "
                     "bench/prompts_repetitive.txt)")
    cmp.add_argument("--limit", type=_positive, help="use only the first N prompts of each set")
    cmp.add_argument("--max-new-tokens", type=_positive, default=128)
    cmp.add_argument("--batch", type=_positive, default=8, help="requests of the batched runs (1 and N concurrent)")
    cmp.add_argument("--out", type=Path, default=Path("bench/results/compare"))
    cmp.set_defaults(func=cmd_compare)

    from spectrt.build.engines import add_arguments as add_engine_arguments

    e = sub.add_parser("engines", help="tree-verify ONNX graphs + TensorRT plans -> engines/<name>/")
    add_engine_arguments(e)
    e.set_defaults(func=cmd_engines)

    from spectrt.runtime.serving.client import add_client_args
    from spectrt.runtime.serving.serve import add_serve_args

    s = sub.add_parser("serve", help="the real tritonserver (nvidia-pytriton) serving triton_repo/ on 127.0.0.1 "
                                      "(--openai-port P: and the OpenAI API)")
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    c = sub.add_parser("client", help="tritonclient gRPC streaming, --http generate, --concurrency load run")
    add_client_args(c)
    c.set_defaults(func=cmd_client)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "tree_spec"):
        if args.tree_spec is None:
            from spectrt.runtime.decoding.pipeline import DEFAULT_TREE

            args.tree_spec = AUTO if args.command == "generate" else DEFAULT_TREE
        try:
            args.tree = parse_tree_arg(args.tree_spec)
        except TreeError as e:
            parser.error(str(e))
    if getattr(args, "dtype", None) == "auto":  # one precision name from here on (file names, reports)
        from spectrt.runtime.engines.engine import resolve_dtype

        args.dtype = resolve_dtype("auto", getattr(args, "backend", "torch"), getattr(args, "target", None))
    try:
        sys.exit(args.func(args))
    except (ValueError, FileNotFoundError) as e:  # CheckpointError, TreeError and input errors
        print(f"spectrt: error: {e}", file=sys.stderr)
        sys.exit(2)
