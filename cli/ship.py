"""`python -m spectrt.cli.ship prompts | answers | draft`: remake what the package ships for the embedded target.

`make ship-draft` runs the three in order: the self-synthesized prompts (build/synth.py), the target's answers to
them (build/corpus.py; resumable, each call adds to the shipped file) and the trained draft (build/draft.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from spectrt.build.corpus import TRAIN_PROMPTS
    from spectrt.build.distill import DistillConfig

    p = argparse.ArgumentParser(prog="python -m spectrt.cli.ship", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("prompts", help="self-synthesize user prompts with the target (Magpie)")
    s.add_argument("--count", type=int, default=2000, help="single-turn prompts")
    s.add_argument("--seed", type=int, default=0, help="its file: build/prompts/synth-seed<SEED>.txt, deduplicated "
                   "against the held-out prompts and the files of smaller seeds")
    s.add_argument("--force", action="store_true", help="synthesize again although this command made the file")
    s.add_argument("--openers", type=Path, help="a prompt file: every message starts with the first two words of one "
                   "of its prompts (e.g. build/prompts/distill.txt: questions as people type them)")
    a = sub.add_parser("answers", help="generate the target's answers to the held-out and training prompts for a "
                       "while and write every answer made so far as shipped package data (run it again to add more)")
    a.add_argument("--work-dir", type=Path, default=Path("artifacts/ship-answers.work"))
    a.add_argument("--out", type=Path, help="output stem (default: build/answers/<target name>)")
    a.add_argument("--minutes", type=float, default=8.0, help="generation time for this call")
    a.add_argument("--rounds", type=int, default=DistillConfig.samples_per_prompt,
                   help="sampled answers per training prompt")
    a.add_argument("--prompts", type=Path, nargs="+", default=list(TRAIN_PROMPTS),
                   help="training prompt files")
    a.add_argument("--greedy", action="store_true", help="one greedy answer per training prompt (what `spectrt draft "
                   "--greedy-answers` trains on), written to build/answers/<target name>-greedy")
    d = sub.add_parser("draft", help="write a trained draft as the package's shipped draft for its target")
    d.add_argument("draft", type=Path, help="a draft made by `spectrt draft` (its dir with draft_report.json)")
    d.add_argument("--command", default="make ship-draft", help="the command that remade it (recorded)")
    d.add_argument("--force", action="store_true",
                   help="ship it even with a lower held-out top-1 than the draft shipped now")
    for q in (s, a, d):
        q.add_argument("--target", help="HF checkpoint dir or .gguf (default: the embedded model)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    from spectrt.runtime.engines.checkpoint import resolve_target

    args = build_parser().parse_args(argv)
    target = resolve_target(args.target)
    if args.what == "prompts":
        from spectrt.build.corpus import read_prompts, synth_prompts_path
        from spectrt.build.synth import excluded, openers_of, synthesize, write_prompts

        out = synth_prompts_path(args.seed)
        steer = f" --openers {args.openers}" if args.openers else ""
        header = (f"Self-synthesized user prompts (Magpie) of {Path(target).name}, seed {args.seed}:\n"
                  f"python -m spectrt.cli.ship prompts --count {args.count} --seed {args.seed}{steer} (build/synth.py)")
        made = "".join(f"# {line}\n" for line in header.splitlines())
        if out.is_file() and out.read_text(encoding="utf-8").startswith(made) and not args.force:
            print(f"{out} was made by this command: kept (--force makes it again; a seed gives the same prompts)")
            return 0
        openers = openers_of(read_prompts(args.openers)) if args.openers else ()
        convs = synthesize(target, args.count, args.seed, exclude=excluded(args.seed), openers=openers)
        write_prompts(out, convs, header)
        print(f"wrote {len(convs)} prompts to {out}")
    elif args.what == "answers":
        from spectrt.build.corpus import ship_answers

        out = ship_answers(target, args.work_dir, args.out, args.minutes, args.rounds, args.prompts, args.greedy)
        print(f"wrote {out}.json and {out}.tokens.xz")
    else:
        from spectrt.build.draft import DRAFTS_DIR, SHIPPED_FILES, ship_draft

        out = ship_draft(args.draft, target, DRAFTS_DIR / Path(target).name, args.command, args.force)
        size = sum((out / n).stat().st_size for n in SHIPPED_FILES) / 2**20
        print(f"shipped {args.draft} as {out} ({size:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
