"""Compile a tree-verify graph (ONNX, build/export.py) into a TensorRT plan with the TensorRT Python API.

The module is NVIDIA's `tensorrt` where it is installed (a GPU machine: the plan is built for that GPU),
else `tensorrt_rtx` (`pip install tensorrt-rtx`), whose builder runs on a CPU and writes one plan for
the compute capabilities asked for (ARCH=sm80,sm86,...). Both parse the same ONNX.

Precision comes from the graph, never from a builder flag: networks are created strongly typed (the
only kind TensorRT-RTX builds), so an fp16 graph gives an FP16 plan, a Q/DQ graph an INT8 plan and
the fp32 graph an exact FP32 plan (TF32 off). One optimization profile per entry of `profiles` covers the
batched graph's dimensions: N packed rows, B requests, T rows per request (1..max_tree_tokens: trees, draft
levels and prompt chunks alike), M mask words, S attention columns, P pool slots and C cache capacity; an EAGLE-3
head's graph (build/export_eagle3.py) also takes its rows' input hidden, split into `target_features` and
`hidden_states` rows (0..N each: one of them is empty in every call).
Builds print their phases; `tensorrt` reuses a timing cache file (TensorRT-RTX has no autotuning at build
time: its timing cache is a no-op and is not written).

Measured here (2 CPU cores, quiet, tensorrt_rtx 1.7.1, the batched graph): embedded target (30 layers) FP16 plan
296 MB in 18.9 s, distilled 4-layer draft FP16 101 MB in 2.0 s, for six compute capabilities (the per-request graph
of earlier rounds: one capability took the same size and time as several; FP32 target 558 MB in ~17 s, not
re-measured on the batched graph).
"""

from __future__ import annotations

import importlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TRT_MODULES = ("tensorrt", "tensorrt_rtx")
ROW_INPUTS = ("target_features", "hidden_states")  # an EAGLE-3 head graph's [rows, width] inputs (batch_inputs.py)
RTX_ARCHS = ("sm75", "sm80", "sm86", "sm89", "sm120", "sm121")


class CompileError(ValueError):
    """A plan that cannot be built here; the message says what is needed (a ValueError: the CLI prints it)."""


def trt_module(name: str | None = None):
    """The TensorRT Python module to build with: `name`, $SPECTRT_TRT_MODULE, else tensorrt, else tensorrt_rtx."""
    names = [name] if name else ([os.environ["SPECTRT_TRT_MODULE"]] if os.environ.get("SPECTRT_TRT_MODULE")
                                 else list(TRT_MODULES))
    errors = []
    for n in names:
        if n not in TRT_MODULES:
            raise CompileError(f"unknown TensorRT module {n!r}: choose one of {TRT_MODULES}")
        try:
            return importlib.import_module(n)
        except Exception as e:  # ImportError, or a broken install raising something else
            errors.append(f"{n}: {e}")
    raise CompileError(
        "building TensorRT plans needs the TensorRT Python API: `pip install tensorrt-rtx` (builds on a CPU "
        "for chosen compute capabilities, ARCH=sm80,...) or NVIDIA's `tensorrt` on a GPU machine "
        f"({'; '.join(errors)}). ONNX Runtime needs no plans: `--backend onnxruntime` runs the graph."
    )


_LOGGERS: dict[str, object] = {}


def trt_logger(trt):
    """One logger per module: TensorRT keeps the first one it is given and warns about any other."""
    name = module_name(trt)
    if name not in _LOGGERS:
        _LOGGERS[name] = trt.Logger(trt.Logger.WARNING)
    return _LOGGERS[name]


def module_name(trt) -> str:
    return trt.__name__.split(".")[0]


@dataclass(frozen=True)
class Profile:
    """min/opt/max of the batched graph's dimensions (build/export.py): N packed rows, B requests, T rows per
    request, M mask words, S attention columns, P pool slots, C cache capacity."""

    name: str
    rows: tuple[int, int, int]
    batch: tuple[int, int, int]
    tokens: tuple[int, int, int]
    words: tuple[int, int, int]
    columns: tuple[int, int, int]
    slots: tuple[int, int, int]
    capacity: tuple[int, int, int]

    def shapes(self, config, row_inputs: dict[str, int] | None = None) -> dict[str, list[tuple[int, ...]]]:
        """min/opt/max per input. `row_inputs`: an EAGLE-3 head graph's extra inputs {name: width} (`row_inputs`
        of its network): 0..N rows each, opt all rows from hidden states (a draft level) and none from features."""
        c = config
        per = lambda *dims: [tuple(d[i] for d in dims) for i in range(3)]  # noqa: E731
        pool = [(p, c.num_layers, c.num_kv_heads, cap, c.head_dim) for p, cap in zip(self.slots, self.capacity,
                                                                                       strict=True)]
        return {
            "input_ids": per(self.rows),
            "spec_decoding_generation_lengths": per(self.batch),
            "spec_decoding_position_offsets": per(self.batch, self.tokens),
            "spec_decoding_packed_mask": per(self.batch, self.tokens, self.words),
            "past_key_value_lengths": per(self.batch),
            "window_offsets": per(self.batch),
            "slot_ids": per(self.batch),
            "cache_columns": per(self.columns),
            "pool_k": pool,
            "pool_v": pool,
            **{name: [(0, width), (self.rows[1] if name == "hidden_states" else 0, width), (self.rows[2], width)]
               for name, width in (row_inputs or {}).items()},
        }

    def as_dict(self) -> dict:
        return {"name": self.name, "N": list(self.rows), "B": list(self.batch), "T": list(self.tokens),
                "M": list(self.words), "S": list(self.columns), "P": list(self.slots), "C": list(self.capacity)}


def default_profiles(max_tree_tokens: int, capacity: int, max_batch: int) -> list[Profile]:
    """One profile: up to `max_batch` requests of up to max_tree_tokens rows each (trees, draft levels and prompt
    chunks alike) in a pool of up to `max_batch` slots, any span up to the capacity.

    The runtime drives TensorRT with S = C (static span), so only N, B, T and M vary; opt sits at a full batch of
    small trees (8 nodes per request at most, 4 on average), the sizes this project's trees are tuned to.
    """
    opt_t = min(8, max_tree_tokens)
    words = -(-max_tree_tokens // 32)
    return [Profile("batched-tree", rows=(1, max_batch * min(4, max_tree_tokens), max_batch * max_tree_tokens),
                    batch=(1, max_batch, max_batch), tokens=(1, opt_t, max_tree_tokens), words=(1, 1, words),
                    columns=(1, capacity, capacity), slots=(1, max_batch, max_batch),
                    capacity=(1, capacity, capacity))]


@dataclass
class PlanInfo:
    path: Path
    module: str
    version: str
    archs: list[str]
    bytes: int
    seconds: float
    io: dict = field(default_factory=dict)
    profiles: list[dict] = field(default_factory=list)

    def as_dict(self, root: Path) -> dict:
        return {"file": self.path.relative_to(root).as_posix(), "module": self.module, "version": self.version,
                "archs": self.archs, "bytes": self.bytes, "build_seconds": round(self.seconds, 2), "io": self.io,
                "profiles": self.profiles}


def _dtype_name(dt) -> str:
    return {"FLOAT": "float32", "HALF": "float16", "INT32": "int32", "INT64": "int64", "BOOL": "bool",
            "INT8": "int8", "BF16": "bfloat16"}.get(dt.name, dt.name.lower())


def network_io(network) -> dict:
    """Inputs/outputs of a parsed network: {"inputs": {name: {dtype, shape}}, "outputs": {...}} (-1 = dynamic)."""
    def one(t):
        return {"dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
    return {
        "inputs": {network.get_input(i).name: one(network.get_input(i)) for i in range(network.num_inputs)},
        "outputs": {network.get_output(i).name: one(network.get_output(i)) for i in range(network.num_outputs)},
    }


def row_inputs(network) -> dict[str, int]:
    """{name: width} of a parsed network's EAGLE-3 head row inputs (`target_features`, `hidden_states`), if any."""
    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    found = {t.name: int(t.shape[1]) for t in inputs if t.name in ROW_INPUTS}
    if any(w < 1 for w in found.values()):
        raise CompileError(f"the head inputs {found} need a static width (their dimension 1)")
    return found


class _Progress:
    """Prints the builder's top phases with elapsed time (TensorRT's IProgressMonitor)."""

    def __new__(cls, trt, log: Callable[[str], None], label: str, depth: int = 2):
        class Monitor(trt.IProgressMonitor):
            def __init__(self):
                trt.IProgressMonitor.__init__(self)
                self.start = time.perf_counter()
                self.parents: dict[str, int] = {}

            def phase_start(self, phase_name, parent_phase, num_steps):
                level = self.parents.get(parent_phase, -1) + 1 if parent_phase else 0
                self.parents[phase_name] = level
                if level < depth:
                    log(f"    [{label} {time.perf_counter() - self.start:6.1f}s] {'  ' * level}{phase_name}")

            def step_complete(self, phase_name, step):
                return True

            def phase_finish(self, phase_name):
                pass

        return Monitor()


def parse_onnx(trt, graph: Path, logger=None):
    """(builder, network, parser) for `graph`, strongly typed; raises CompileError with the parser's errors."""
    logger = logger or trt_logger(trt)
    try:
        builder = trt.Builder(logger)
    except Exception as e:  # `tensorrt` without a GPU/driver fails here
        raise CompileError(
            f"{module_name(trt)} cannot create a builder on this machine ({e}): NVIDIA's `tensorrt` builds on an "
            "NVIDIA GPU with its driver; on a CPU-only machine install `tensorrt-rtx` and pass ARCH=sm80,..."
        ) from e
    if builder is None:
        raise CompileError(f"{module_name(trt)} could not create a builder here (no usable GPU/driver?): on a "
                           "CPU-only machine use `tensorrt-rtx` (SPECTRT_TRT_MODULE=tensorrt_rtx)")
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph)):
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise CompileError(f"TensorRT could not parse {graph}: {errors}")
    return builder, network, parser


def check_rtx_archs(trt, archs: list[str]) -> None:
    """TensorRT-RTX targets only some compute capabilities; refuse others before any work is done."""
    if not archs:
        raise CompileError(f"TensorRT-RTX builds for chosen GPUs: pass ARCH=... from {', '.join(RTX_ARCHS)}")
    bad = [a for a in archs if a not in RTX_ARCHS or not hasattr(trt.ComputeCapability, a.upper())]
    if bad:
        raise CompileError(
            f"TensorRT-RTX {trt.__version__} cannot target {', '.join(bad)} (it builds for "
            f"{', '.join(RTX_ARCHS)}; no Hopper sm90 or datacenter Blackwell): pick from those, or build with "
            "NVIDIA's `tensorrt` on the target GPU"
        )


def resolve_archs(trt, archs: list[str] | None) -> list[str]:
    """The compute capabilities a plan will be built for: TensorRT-RTX, the ones asked for (default: all it
    supports); NVIDIA's `tensorrt`, the GPU present (which must match any asked for)."""
    if module_name(trt) == "tensorrt_rtx":
        archs = list(archs) if archs else list(RTX_ARCHS)
        check_rtx_archs(trt, archs)
        return archs
    try:
        import torch

        major, minor = torch.cuda.get_device_capability()
    except Exception as e:
        raise CompileError(f"`tensorrt` builds for the GPU it runs on, and none is visible here ({e}): build on "
                           "the GPU machine, or use `tensorrt-rtx` (SPECTRT_TRT_MODULE=tensorrt_rtx) with ARCH="
                           ) from e
    here = f"sm{major}{minor}"
    if archs and list(archs) != [here]:
        raise CompileError(f"`tensorrt` builds only for the GPU present ({here}), not {','.join(archs)}: "
                           f"pass ARCH={here} or build on each target GPU")
    return [here]


def _set_archs(trt, config, archs: list[str] | None) -> list[str]:
    archs = resolve_archs(trt, archs)
    if module_name(trt) == "tensorrt_rtx":
        config.num_compute_capabilities = len(archs)
        for i, a in enumerate(archs):
            config.set_compute_capability(getattr(trt.ComputeCapability, a.upper()), i)
    return archs


def build_plan(graph: Path, out: Path, config, profiles: list[Profile], archs: list[str], precision: str,
               timing_cache: Path | None = None, module: str | None = None, log: Callable[[str], None] = print,
               workspace_mb: int | None = None) -> PlanInfo:
    """Parse `graph`, build a plan with the given profiles for `archs`, write it to `out`."""
    trt = trt_module(module)
    name = module_name(trt)
    builder, network, _parser = parse_onnx(trt, graph)
    cfg = builder.create_builder_config()
    archs = _set_archs(trt, cfg, archs)
    if precision == "fp32" and hasattr(trt.BuilderFlag, "TF32"):
        try:
            cfg.clear_flag(trt.BuilderFlag.TF32)  # the FP32 plan is the exact one (parity with torch fp32)
        except Exception as e:
            log(f"  note: could not disable TF32 ({e})")
    if workspace_mb:
        cfg.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mb << 20)
    recorded = []
    extra = row_inputs(network)
    for prof in profiles:
        p = builder.create_optimization_profile()
        shapes = prof.shapes(config, extra)
        for tensor, (lo, opt, hi) in shapes.items():
            p.set_shape(tensor, lo, opt, hi)
        cfg.add_optimization_profile(p)
        recorded.append({"name": prof.name, **{t: [list(s) for s in p.get_shape(t)] for t in shapes}})
    cache = None
    if timing_cache is not None and name == "tensorrt":  # a no-op in TensorRT-RTX (deprecated there)
        blob = timing_cache.read_bytes() if timing_cache.is_file() else b""
        cache = cfg.create_timing_cache(blob)
        cfg.set_timing_cache(cache, ignore_mismatch=False)
    cfg.progress_monitor = _Progress(trt, log, out.name)
    log(f"  building {out.name} with {name} {trt.__version__} for {','.join(archs)} ({precision})")
    start = time.perf_counter()
    plan = builder.build_serialized_network(network, cfg)
    seconds = time.perf_counter() - start
    if plan is None:
        raise CompileError(f"{name} failed to build a plan from {graph} (see the builder's errors above)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(memoryview(plan))
    tmp.replace(out)
    if cache is not None:
        timing_cache.write_bytes(bytes(cfg.get_timing_cache().serialize()))
    size = out.stat().st_size
    log(f"  wrote {out.name}: {size / 1e6:.1f} MB in {seconds:.1f}s")
    return PlanInfo(out, name, trt.__version__, archs, size, seconds, network_io(network), recorded)
