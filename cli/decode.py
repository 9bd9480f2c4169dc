"""`spectrt generate | bench | profile | tune`: decoding with the one loop, its benchmarks, cost curve and policy."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from spectrt.cli.common import (
    add_dtype_arg,
    add_model_args,
    add_sampling_args,
    model_dirs,
    positive,
    sampling,
    temperatures,
    tree_specs,
)
from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS, resolve_models


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling(args)  # validate before loading models (and before importing transformers: ~2 s)
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: pass some text with --prompt")
    target, draft = model_dirs(args)
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.engines.engine import fallback_notice

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
    from spectrt.runtime.decoding.bench import BenchSettings, run_bench, run_multi_turn

    target, draft = model_dirs(args)
    settings = BenchSettings(prompts=args.prompts, limit=args.limit, trees=args.trees, temperatures=args.temperatures,
                             max_new_tokens=args.max_new_tokens, backend=args.backend, dtype=args.dtype,
                             max_seq_len=args.max_seq_len, out=args.out, artifacts=args.artifacts,
                             concurrency=args.concurrency, rounds=args.rounds)
    (run_multi_turn if args.multi_turn else run_bench)(target, draft, settings)
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

    target, draft = model_dirs(args)
    if args.prompts:
        from spectrt.runtime.decoding.bench import read_prompts as read_lines

        prompts = read_lines(args.prompts)
    else:
        held = [conv[0]["content"] for conv in read_prompts(HELDOUT_PROMPTS) if len(conv) == 1]
        # evenly spaced over the file, which runs by genre: its first 8 are all advice and science questions, where
        # suffix candidates barely occur (46 of 1,435 candidates measured), so code, lists and rewrites went untuned
        prompts = [held[i * len(held) // args.limit] for i in range(args.limit)] if args.limit < len(held) else held
    # no prefix cache: the finalists decode each prompt one after another (`tune.time_finalists`), and a later one
    # would start from an earlier one's KV and draft rows
    pipe = Pipeline(target, draft, args.backend, args.dtype, args.max_seq_len, artifacts=args.artifacts,
                    prefix_cache=False, max_active=args.batch)  # slots for the batched host measurement
    pipe.generate(prompts[0], 8, None)  # warm-up: kernel choice
    report = run_tune(pipe, target, draft, args.dtype, args.artifacts, prompts[:args.limit], args.max_new_tokens,
                      args.depth, args.width)
    p = report["policy"]
    more = "untimed" if p.get("host_more_ms") is None else f"{p['host_more_ms']:.2f}"
    print(f"{report['path']}: budget {p['budget']}, depth {p['depth']}, width {p['width']}, draft {p['draft']}, "
          f"suffix {p['suffix']}, host {p['host_ms']:.2f} ms a drafted request ({more} each further one); expected "
          f"{report['expected_tokens_per_second']:.1f} tok/s vs AR {report['ar_tokens_per_second']:.1f} "
          f"(costs: {report['cost_source']})")
    return 0



def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="generate text with tree speculative decoding")
    add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--tree", dest="tree_spec", default=None,
                   help="a static tree: expansion per depth, e.g. 3,2,2,1,1; none: the target alone (default: auto, "
                        "dynamic trees under the policy from `spectrt tune`)")
    g.add_argument("--max-new-tokens", type=positive, default=128)
    g.add_argument("--no-spec", action="store_true", help="run the target alone (autoregressive baseline)")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object (text, token ids, stats)")
    add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="AR vs chain vs tree on a prompt set; writes bench/results")
    add_model_args(b)
    b.add_argument("--prompts", type=Path, help="one prompt per line (default: bench/prompts.txt)")
    b.add_argument("--trees", type=tree_specs, default=None,
                   help="semicolon-separated trees to compare, e.g. '1,1,1;2,1'")
    b.add_argument("--max-new-tokens", type=positive, default=128)
    b.add_argument("--limit", type=positive, help="use only the first N prompts")
    b.add_argument("--rounds", type=positive, default=2,
                   help="runs of each prompt per configuration, the order reversed each round (a prompt's speedup "
                   "is its tokens over the summed seconds: a shift in this machine's speed cancels)")
    b.add_argument("--temperatures", type=temperatures, default=(0.0,),
                   help="comma-separated, e.g. 0,0.7,1.0 (0 = greedy)")
    b.add_argument("--out", type=Path, default=Path("bench/results"),
                   help="results go to OUT/<cpu class>/ (scripts/bench_tables.py renders the full greedy runs into "
                        "docs/benchmarks.md; a --prompts, --limit or sampled run gets a tagged file of its own)")
    b.add_argument("--multi-turn", action="store_true",
                   help="chat conversations with and without the prefix cache: time to first token by turn, "
                   "throughput at --concurrency (--prompts: one user turn a line, a blank line between conversations; "
                   "default bench/prompts_multiturn.txt)")
    b.add_argument("--concurrency", type=positive, default=8, help="--multi-turn: conversations decoded together")
    b.set_defaults(func=cmd_bench)

    pr = sub.add_parser("profile", help="this machine's cost curve (ms per forward vs tree size) -> cost profile")
    pr.add_argument("--target", help="HF checkpoint dir or .gguf (default: embedded model)")
    pr.add_argument("--draft", help="draft checkpoint dir (default: the target's distilled draft)")
    pr.add_argument("--no-draft", action="store_true", help="profile the target only")
    pr.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS, help="where the cost profile is saved")
    add_dtype_arg(pr)
    pr.add_argument("--repeats", type=positive, default=15, help="timed forwards per shape (median reported)")
    pr.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    pr.set_defaults(func=cmd_profile)

    t = sub.add_parser("tune", help="pick the speculation policy from this machine's costs and measured acceptance, "
                       "its best candidates timed in the decode loop")
    add_model_args(t)
    t.add_argument("--prompts", type=Path, help="one prompt per line (default: --limit prompts spread over "
                   "build/prompts/heldout.txt's genres)")
    t.add_argument("--limit", type=positive, default=8, help="prompts used (of --prompts: the first ones)")
    t.add_argument("--max-new-tokens", type=positive, default=64)
    t.add_argument("--depth", type=positive, default=4, help="deepest draft level considered")
    t.add_argument("--width", type=positive, default=3, help="widest draft expansion considered")
    t.add_argument("--batch", type=positive, default=8,
                   help="requests decoded together to measure the host work a batch's drafted requests share "
                        "(Policy.host_more_ms; needs that many KV slots of --max-seq-len; 1: not measured, each "
                        "drafted request charged a lone one's)")
    t.set_defaults(func=cmd_tune)

