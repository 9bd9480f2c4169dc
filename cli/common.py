"""What several subcommands share: the model flags, the sampling flags, and reading them."""

from __future__ import annotations

import argparse
from pathlib import Path

from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS, CheckpointError, resolve_models


def positive(value: str) -> int:
    if not value.lstrip("-").isdigit() or int(value) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return int(value)


def share(value: str) -> float:
    """argparse type: a fraction strictly between 0 and 1."""
    v = float(value)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a share of the budget: pass a number between 0 and 1")
    return v


def tree_specs(value: str) -> tuple[str, ...]:
    """`--trees '1,1,1;2,1'`: static tree specs, each checked as `Tree.parse` reads it."""
    from spectrt.runtime.decoding.tree import Tree, TreeError

    specs = tuple(spec.strip() for spec in value.split(";") if spec.strip())
    try:
        for spec in specs:
            Tree.parse(spec)
    except TreeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not specs:
        raise argparse.ArgumentTypeError(f"no tree in {value!r}: give semicolon-separated trees, e.g. '1,1,1;2,1'")
    return specs


def temperatures(value: str) -> tuple[float, ...]:
    """`--temperatures 0,0.7`: comma-separated, each >= 0."""
    try:
        values = tuple(float(t) for t in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not comma-separated numbers, e.g. 0,0.7,1.0") from None
    if any(t < 0 for t in values):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0 (0 = greedy), got {value!r}")
    return values


def model_dirs(args: argparse.Namespace) -> tuple[Path, Path | None]:
    """(target, draft) checkpoint or engine dirs for the chosen backend; draft None for --no-spec."""
    if args.engines:
        from spectrt.runtime.engines.onnx_engine import engine_models

        target, draft = engine_models(args.engines, args.backend)
        return target, None if getattr(args, "no_spec", False) else draft
    if args.backend != "torch":
        raise CheckpointError(f"--backend {args.backend} runs built engines: pass --engines engines/<name> "
                              "(make engines)")
    return resolve_models(args.target, "none" if getattr(args, "no_spec", False) else args.draft, args.artifacts)


def add_dtype_arg(p: argparse.ArgumentParser) -> None:
    """--dtype, as every subcommand that loads a model takes it."""
    p.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "bf16dot"],
                   help="auto: on the native CPU forward bf16dot where AMX runs it, else bf16 (exact, 2x fp32's "
                        "speed), elsewhere fp32; bf16dot: bf16 GEMM inputs too, an exact mode of its own (native "
                        "only; on AMX tiles where the CPU has AMX-BF16: far cheaper verify rows and batches)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="HF checkpoint dir or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="draft checkpoint dir (default: the target's distilled draft in --artifacts); "
                   "none: draft-less speculation with suffix candidates")
    p.add_argument("--artifacts", type=Path, default=DEFAULT_ARTIFACTS, help="where converted models live")
    add_dtype_arg(p)
    p.add_argument("--backend", default="torch", choices=["torch", "onnxruntime", "tensorrt"])
    p.add_argument("--engines", type=Path, help="engines dir from `spectrt engines` (onnxruntime/tensorrt)")
    p.add_argument("--max-seq-len", type=positive, default=2048)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = disabled")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = disabled")
    p.add_argument("--seed", type=int, default=None, help="same seed + same engine -> same output")
    p.add_argument("--children", default="sample", choices=["sample", "topk"],
                   help="with sampling: draft children drawn without replacement, or the draft's top-k")


def sampling(args: argparse.Namespace):
    from spectrt.runtime.decoding.sampling import SamplingParams

    return SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)


