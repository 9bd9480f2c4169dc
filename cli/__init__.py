"""`spectrt` command line: generate, bench, profile, tune, draft, quantize, compare, engines, serve, client.

The only place that parses flags (argparse): each module here reads a group of subcommands' flags and calls the
libraries in build/, quant/ and runtime/ with plain values.
    decode.py   generate, bench, profile, tune
    offline.py  draft, quantize, compare, engines
    serving.py  serve, client
    common.py   the model and sampling flags they share
Developer entry points beside `spectrt`: `python -m spectrt.cli.openai_frontend` (the OpenAI frontend process that
`spectrt serve --openai-port` starts) and `python -m spectrt.cli.ship` (remaking the shipped prompts, answers and
draft: `make ship-draft`).
"""

from __future__ import annotations

import argparse
import sys

from spectrt.cli import decode, offline, serving
from spectrt.runtime.decoding.tree import AUTO, DEFAULT_TREE, TreeError, parse_tree_arg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectrt", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (decode, offline, serving):
        group.add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "tree_spec"):
        if args.tree_spec is None:
            args.tree_spec = AUTO if args.command == "generate" else DEFAULT_TREE
        try:
            args.tree = parse_tree_arg(args.tree_spec)
        except TreeError as e:
            parser.error(str(e))
    if args.command != "serve":  # a served instance sets its own (the `threads` model parameter)
        from spectrt.runtime.engines.cpus import apply_threads

        apply_threads()
    if getattr(args, "dtype", None) == "auto":  # one precision name from here on (file names, reports)
        from spectrt.runtime.engines.engine import resolve_dtype

        args.dtype = resolve_dtype("auto", getattr(args, "backend", "torch"), getattr(args, "target", None))
    try:
        sys.exit(args.func(args))
    except (ValueError, FileNotFoundError) as e:  # CheckpointError, TreeError and input errors
        print(f"spectrt: error: {e}", file=sys.stderr)
        sys.exit(2)
