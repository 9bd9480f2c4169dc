"""Forward ms of the native kernels by T (tree rows) at a context (default 128), per ISA build and dtype, for this
checkout's kernel source and, with --against REV[,REV...], git revisions': every build in one process, rounds
interleaved, the best of the rounds' medians (bench/results/isa/README.md has the figures). It also checks that every
revision computes bitwise the same logits as this checkout (a kernel change that claims "logits unchanged" is held to
it). A kernel change is kept only where it wins on the CPU it is measured on; run this on every CPU class it may touch.
Revisions before the bound forward arguments (`Bound` in cpu_kernels.cpp) take other arguments and cannot be compared.

    .venv/bin/python scripts/isa_tcurve.py --against HEAD~1 --dtypes bf16,fp32 --rows 1,2,4,8,16 --context 1024
"""
import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import spectrt.runtime.engines.kernels as kernels
import torch
from spectrt.runtime.engines.checkpoint import resolve_target
from spectrt.runtime.engines.engine import load_transformer


def binary_tree_mask(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask [T, T], depths [T]) of a binary tree of T nodes in breadth-first order."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, rows)]
    mask, depth = torch.zeros(rows, rows, dtype=torch.bool), [0] * rows
    for i in range(rows):
        j = i
        while j >= 0:
            mask[i, j], j = True, parents[j]
        depth[i] = depth[parents[i]] + 1 if i else 0
    return mask, torch.tensor(depth)


def sources_at(rev: str, into: Path) -> tuple[Path, tuple[Path, ...]]:
    """The kernel source and headers of a git revision, written into `into` (headers it did not have yet left out)."""
    written = []
    for path in (kernels.SOURCE, *kernels.HEADERS):
        rel = path.relative_to(Path(__file__).resolve().parents[1])
        shown = subprocess.run(["git", "show", f"{rev}:{rel}"], capture_output=True, text=True)
        if shown.returncode and path != kernels.SOURCE:
            continue
        shown.check_returncode()
        (into / path.name).write_text(shown.stdout)
        written.append(into / path.name)
    return written[0], tuple(written[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", help="git revisions (comma-separated) whose kernels to time next to this checkout's")
    p.add_argument("--isas", default=",".join(i for i in kernels.runnable_isas() if i != "portable"))
    p.add_argument("--dtypes", default="bf16,fp32",
                   help="precisions; '+amx' or '+fma' after one picks its GEMM (default: kernels.amx_enabled)")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--context", type=int, default=128, help="committed tokens the rows attend to")
    args = p.parse_args()
    torch.set_num_threads(2)
    target = resolve_target()
    variants = {"this checkout": (kernels.SOURCE, kernels.HEADERS)}
    for rev in filter(None, (args.against or "").split(",")):
        tmp = Path(tempfile.mkdtemp())
        variants[rev] = sources_at(rev, tmp)
    # One model per ISA and dtype, its weights shared by every kernel revision (only the module is swapped): the
    # speed of streaming a weight depends on the memory it sits in (2 MB pages or not, and how the VM's host backs
    # them: the same kernels ran 35 or 59 GB/s in two processes), so revisions are compared on the same memory.
    modules = {}
    for name, (source, headers) in variants.items():
        kernels.SOURCE, kernels.HEADERS = source, headers
        for isa in args.isas.split(","):
            os.environ["SPECTRT_ISA"] = isa
            kernels._build.cache_clear()  # another source: another build (cached by its content)
            modules[name, isa] = kernels.load_kernels()
    shared = {}
    for isa in args.isas.split(","):
        os.environ["SPECTRT_ISA"] = isa
        for dt in args.dtypes.split(","):
            precision, _, gemm = dt.partition("+")  # "+amx" / "+fma": that GEMM, else the precision's default
            os.environ["SPECTRT_AMX"] = {"amx": "1", "fma": "0", "": ""}[gemm]
            model = load_transformer(target, precision, measure_kernels=False)
            assert model.native is not None and model.native.isa == isa, isa
            cache = model.new_cache(args.context + 64, 64)
            gen = torch.Generator().manual_seed(0)  # a context of random keys and values: real scores to compare
            for kv in (cache.k, cache.v):
                kv.copy_(torch.randn(kv.shape, generator=gen))
            shared[isa, dt] = (model, cache)
    models = {(name, isa, dt): shared[isa, dt] + (modules[name, isa],)
              for name in variants for isa in args.isas.split(",") for dt in args.dtypes.split(",")}
    rows = [int(t) for t in args.rows.split(",")]
    best: dict = {}
    logits: dict = {}
    for _ in range(args.rounds):
        for t in rows:
            mask, depth = binary_tree_mask(t)
            tokens = torch.randint(0, 49152, (t,), generator=torch.Generator().manual_seed(t))
            for key, (model, cache, module) in models.items():
                model.native.kernels = module
                cache.length = args.context
                segment = [(tokens, depth + args.context, mask, cache)]
                out = model.forward_many(segment)[0].clone()
                reference = logits.setdefault((key[1:], t), out)  # this checkout's, the first variant
                if not torch.equal(out, reference):
                    raise SystemExit(f"{key[0]} ({key[1]} {key[2]}, T={t}) computes other logits than this checkout")
                times = []
                for _ in range(10):
                    start = time.perf_counter()
                    model.forward_many(segment)
                    times.append(time.perf_counter() - start)
                best[key, t] = min(best.get((key, t), float("inf")), sorted(times)[len(times) // 2])
    print("| kernels | ISA | dtype | " + " | ".join(f"T={t}" for t in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    for key in models:
        print("| " + " | ".join(key) + " | " + " | ".join(f"{1e3 * best[key, t]:.1f}" for t in rows) + " |")


if __name__ == "__main__":
    main()
