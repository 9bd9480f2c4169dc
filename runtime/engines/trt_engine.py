"""The `tensorrt` backend: a TensorRT plan of a batched graph behind the one engine interface.

- The plan (build/compile.py) is loaded with the module that built it (`tensorrt` or `tensorrt_rtx`: one code path,
  the same Python API), after its sha256 is checked against the engines manifest and its compute capability
  against this GPU.
- Three graphs (runtime/engines/batch_inputs.py): the batched tree-verify graph (INPUT_NAMES -> OUTPUT_NAMES), the
  same exported for an EAGLE-3 head (+ the `features` output: `forward_features`), and the head's own graph
  (build/export_eagle3.py, `input_names=HEAD_INPUT_NAMES`: + the `target_features`/`hidden_states` inputs and the
  `hidden_out` output, run through `run` by runtime/engines/graph_head.py). Any other plan is refused.
- `forward_many` is ONE plan execution for all segments (B requests, each its own tree; see
  runtime/engines/batch_inputs.py). The KV pool (`KVCache.pool`, [slots, layers, kv_heads, capacity, head_dim])
  lives in device memory in the plan's K/V dtype and is bound by address: no cache crosses the bus. The small
  per-step inputs (and a head's row inputs) go through pinned host buffers into static device buffers sized for the
  profile's max rows; the new K/V are written into the pool slots on the GPU; only the row outputs ([N, width]:
  logits, features, hidden_out) come back to (pinned) host memory, so the decoder, greedy or sampling, works
  unchanged.
- **Static span**: `cache_columns` is the whole capacity (S = C), so only N, B, T and M (and a head's feature/hidden
  row counts) vary between calls. Each shape seen twice gets its own execution context and CUDA graph (captured on
  the second sighting; shapes that occur once run eagerly); contexts share one scratch buffer (they run one after
  another on one stream).
- `execute_async_v3` runs on a private stream ordered after the caller's stream.

Nothing here runs without an NVIDIA GPU (no GPU with TensorRT was lent to the sessions that wrote it; the CPU tests
drive this class with `device="cpu"` and a stand-in TensorRT module that executes the same graph with ONNX Runtime,
which checks buffers, shapes, addresses, inputs and pool writes, not TensorRT itself: tests/test_engines.py for the
target graph, tests/test_trt_head.py for features and the head graph). `scripts/gpu_check.sh` is the prepared check
for a GPU machine.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from spectrt.runtime.engines.batch_inputs import (
    FEATURES,
    HEAD_INPUT_NAMES,
    HEAD_OUTPUT_NAMES,
    INPUT_NAMES,
    OUTPUT_NAMES,
    batch_inputs,
)
from spectrt.runtime.engines.kernels import last_rows
from spectrt.runtime.engines.model import KVCache, ModelConfig
from spectrt.runtime.engines.onnx_engine import EngineDir, EngineDirError, check_features, forward_by_pool

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "int8": torch.int8, "bool": torch.bool}
STEP_INPUTS = INPUT_NAMES[:7]  # copied host -> device every step; cache_columns and the pool are bound as they are
# the plans this engine runs: input names -> the output sets they may come with (module doc)
LAYOUTS = {INPUT_NAMES: (OUTPUT_NAMES, (*OUTPUT_NAMES, FEATURES)), HEAD_INPUT_NAMES: (HEAD_OUTPUT_NAMES,)}
KV_OUTPUTS = ("new_k", "new_v")
_LOGGERS: dict[str, object] = {}


def import_trt(module: str):
    try:
        return importlib.import_module(module)
    except Exception as e:
        raise EngineDirError(
            f"this plan was built with `{module}`, which cannot be imported here ({e}): install it on the GPU "
            f"machine (`pip install {module.replace('_', '-')}`), or run --backend onnxruntime"
        ) from e


def device_arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"sm{major}{minor}"


class TensorRTEngine:
    """Engine interface over a TensorRT plan (see the module doc). `input_names`: INPUT_NAMES for the tree-verify
    graph (with or without `features`), HEAD_INPUT_NAMES for an EAGLE-3 head's graph; `io` and `profile` are the
    manifest's plan entry's (build/compile.py PlanInfo)."""

    def __init__(self, plan: Path, config: ModelConfig, io: dict, profile: dict, module: str = "tensorrt_rtx",
                 device: str = "cuda", cuda_graphs: bool = True, trt=None, log=None,
                 feature_layers: Sequence[int] = (), input_names: tuple[str, ...] = INPUT_NAMES):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda and not torch.cuda.is_available():
            raise EngineDirError("--backend tensorrt runs TensorRT plans on an NVIDIA GPU and none is visible here "
                                 "(torch.cuda.is_available() is False): use --backend onnxruntime on a CPU")
        self.log = log or (lambda msg: print(f"[tensorrt] {msg}", file=sys.stderr))
        self.trt = trt or import_trt(module)
        self.config = config
        name = getattr(self.trt, "__name__", module)
        if name not in _LOGGERS:  # TensorRT keeps the first logger it is given and warns about others
            _LOGGERS[name] = self.trt.Logger(self.trt.Logger.WARNING)
        self.logger = _LOGGERS[name]
        self.runtime = self.trt.Runtime(self.logger)
        self.engine = self.runtime.deserialize_cuda_engine(Path(plan).read_bytes())
        if self.engine is None:
            where = f"{torch.cuda.get_device_name()} ({device_arch()})" if self.cuda else str(self.device)
            raise EngineDirError(f"{module} could not deserialize {plan} on {where} (see TensorRT's error above): "
                                 "rebuild the plan for this GPU (`spectrt engines --arch ...`, or with `tensorrt` "
                                 "on this machine)")
        input_names = tuple(input_names)
        if input_names not in LAYOUTS:
            raise ValueError(f"input_names must be INPUT_NAMES or HEAD_INPUT_NAMES, got {list(input_names)}")
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        layouts = [set(input_names) | set(outputs) for outputs in LAYOUTS[input_names]]
        if names not in layouts:
            what = "an EAGLE-3 head's graph" if input_names == HEAD_INPUT_NAMES else "the batched tree-verify graph"
            raise EngineDirError(f"{plan} has tensors {sorted(names)}, not {what}'s "
                                 f"{' or '.join(str(sorted(w)) for w in layouts)}: rebuild with `spectrt engines "
                                 "--force`")
        if set(io.get("inputs", {})) | set(io.get("outputs", {})) != names:
            raise EngineDirError(f"the manifest's io of {plan} ({sorted(io.get('inputs', {}))} -> "
                                 f"{sorted(io.get('outputs', {}))}) is not the plan's {sorted(names)}: rebuild with "
                                 "`spectrt engines --force`")
        self.plan, self.input_names = Path(plan), input_names
        self.kv_dtype = TORCH_DTYPES[io["inputs"]["pool_k"]["dtype"]]
        # row outputs [N, width] in the graph's order, logits first (new K/V go into the pool instead), and a head's
        # row inputs [rows, width] (target features, hidden states)
        self.widths = {n: int(o["shape"][1]) for n, o in io["outputs"].items() if n not in KV_OUTPUTS}
        self.row_dtypes = {n: TORCH_DTYPES[io["outputs"][n]["dtype"]] for n in self.widths}
        self.row_inputs = {n: int(io["inputs"][n]["shape"][1]) for n in input_names[len(INPUT_NAMES):]}
        self.row_input_dtypes = {n: TORCH_DTYPES[io["inputs"][n]["dtype"]] for n in self.row_inputs}
        self.logits_dtype = self.row_dtypes["logits"]
        self.graph_features = tuple(int(j) for j in feature_layers) if FEATURES in self.widths else ()  # returned
        self.step_names = STEP_INPUTS + tuple(self.row_inputs)  # shapes that key a CUDA graph
        top = {k: v[2] for k, v in profile.items() if k != "name"}  # the profile's max shapes
        self.max_rows, self.max_batch = top["input_ids"][0], top["slot_ids"][0]
        self.max_tokens, self.max_words = top["spec_decoding_packed_mask"][1:]
        self.max_slots, self.max_capacity = top["pool_k"][0], top["pool_k"][3]
        self.cuda_graphs = cuda_graphs and self.cuda
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._eager = self.engine.create_execution_context()
        self._graphs: dict[tuple, tuple] = {}  # (shapes, pool address) -> (context, CUDAGraph)
        self._seen: dict[tuple, int] = {}
        self._scratch = None
        self._capacity = 0
        self.runs = 0  # plan executions (one per forward_many and pool)

    @classmethod
    def load(cls, role_dir: Path, **kwargs) -> TensorRTEngine:
        d = EngineDir(role_dir)
        plans = d.entry.get("plans", {})
        if not plans:
            raise EngineDirError(f"{d.root} has no TensorRT plan for {d.role}: build with `spectrt engines` "
                                 "(without --no-plans), or use --backend onnxruntime")
        precision = d.manifest.get("precision")
        entry = plans.get(precision) or next(iter(plans.values()))
        device = kwargs.get("device", "cuda")
        if torch.device(device).type == "cuda":
            if not torch.cuda.is_available():
                raise EngineDirError("--backend tensorrt runs TensorRT plans on an NVIDIA GPU and none is visible "
                                     "here (torch.cuda.is_available() is False): use --backend onnxruntime on a CPU")
            arch = device_arch()
            if arch not in entry["archs"]:
                hint = (" (TensorRT-RTX has no sm90 target: build with NVIDIA's `tensorrt` on this machine)"
                        if arch == "sm90" and entry["module"] == "tensorrt_rtx" else "")
                raise EngineDirError(f"{d.path(entry['file'])} was built for {','.join(entry['archs'])}, this GPU is "
                                     f"{arch}: rebuild with `spectrt engines --arch {arch}`{hint}")
        d.verify([entry["file"]] + d.support_files())
        return cls(d.path(entry["file"]), d.config, entry["io"], entry["profiles"][0], entry["module"],
                   feature_layers=d.entry.get("feature_layers", ()), **kwargs)

    # -- buffers -------------------------------------------------------------------------------------

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list[KVCache]:
        if capacity > self.max_capacity or max_window > self.max_tokens or slots > self.max_slots:
            raise ValueError(
                f"{slots} caches of {capacity} slots / {max_window}-token window exceed the plan's profile "
                f"({self.max_slots} caches of {self.max_capacity} slots, {self.max_tokens} tokens): rebuild with "
                "`spectrt engines --max-batch/--max-seq-len/--max-tree-tokens`"
            )
        with torch.device(self.device):
            caches = KVCache.pool(self.config, slots, capacity, max_window, self.kv_dtype)
        self._ensure_buffers(capacity)
        return caches

    def new_cache(self, capacity: int, max_window: int) -> KVCache:
        return self.new_caches(1, capacity, max_window)[0]

    def _ensure_buffers(self, capacity: int) -> None:
        """Static host and device buffers for the profile's largest batch (allocated once per capacity)."""
        if capacity == self._capacity:
            return
        c, dev, pin = self.config, self.device, self.cuda
        b, t, m, n = self.max_batch, self.max_tokens, self.max_words, self.max_rows
        sizes = {"input_ids": n, "spec_decoding_generation_lengths": b, "spec_decoding_position_offsets": b * t,
                 "spec_decoding_packed_mask": b * t * m, "past_key_value_lengths": b, "window_offsets": b,
                 "slot_ids": b}
        self.host = {k: torch.zeros(size, dtype=torch.int32, pin_memory=pin) for k, size in sizes.items()}
        self.inputs = {k: torch.zeros(size, dtype=torch.int32, device=dev) for k, size in sizes.items()}
        self.columns = torch.arange(capacity, dtype=torch.int32, device=dev)  # static span: S = C
        self.h_row_inputs = {k: torch.zeros(n * w, dtype=torch.float32, pin_memory=pin)
                             for k, w in self.row_inputs.items()}
        self.row_input_buffers = {k: torch.zeros(n * w, dtype=self.row_input_dtypes[k], device=dev)
                                  for k, w in self.row_inputs.items()}
        self.h_outputs = {k: torch.zeros(n * w, dtype=torch.float32, pin_memory=pin) for k, w in self.widths.items()}
        self.outputs = {k: torch.zeros(n * w, dtype=self.row_dtypes[k], device=dev) for k, w in self.widths.items()}
        kv = c.num_layers * c.num_kv_heads * n * c.head_dim
        self.new_k = torch.zeros(kv, dtype=self.kv_dtype, device=dev)
        self.new_v = torch.zeros(kv, dtype=self.kv_dtype, device=dev)
        self._capacity = capacity
        self._graphs.clear()  # captured graphs point at the old buffers
        self._seen.clear()

    # -- execution -----------------------------------------------------------------------------------

    def _bind(self, ctx, shapes: dict[str, tuple[int, ...]], pool: KVCache) -> None:
        for name in self.input_names:
            if not ctx.set_input_shape(name, shapes[name]):
                raise RuntimeError(f"TensorRT refused shape {shapes[name]} for {name} (outside the plan's profile)")
        addresses = {**self.inputs, **self.row_input_buffers, "cache_columns": self.columns, "pool_k": pool.pool_k,
                     "pool_v": pool.pool_v, **self.outputs, "new_k": self.new_k, "new_v": self.new_v}
        for name, tensor in addresses.items():
            ctx.set_tensor_address(name, tensor.data_ptr())

    def _stream_handle(self) -> int:
        return self.stream.cuda_stream if self.cuda else 0

    def _execute(self, ctx) -> None:
        if not ctx.execute_async_v3(self._stream_handle()):
            raise RuntimeError("TensorRT execute_async_v3 failed (see TensorRT's error above)")

    def _new_context(self):
        """A context for one captured shape; all share one scratch buffer where TensorRT allows it."""
        strategy = getattr(self.trt, "ExecutionContextAllocationStrategy", None)
        size = getattr(self.engine, "device_memory_size_v2", None) or getattr(self.engine, "device_memory_size", 0)
        if strategy is None or not size:
            return self.engine.create_execution_context()
        if self._scratch is None:
            self._scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        ctx = self.engine.create_execution_context(strategy.USER_MANAGED)
        if hasattr(ctx, "set_device_memory"):  # TensorRT >= 10.1
            ctx.set_device_memory(self._scratch.data_ptr(), self._scratch.numel())
        else:
            ctx.device_memory = self._scratch.data_ptr()
        return ctx

    def _execute_shapes(self, shapes: dict[str, tuple[int, ...]], pool: KVCache) -> None:
        key = (tuple(shapes[name] for name in self.step_names), tuple(pool.pool_k.shape), pool.pool_k.data_ptr())
        if self.cuda_graphs:
            entry = self._graphs.get(key)
            if entry is not None:
                entry[1].replay()
                return
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] >= 2:
                try:
                    ctx = self._new_context()
                    self._bind(ctx, shapes, pool)
                    self._execute(ctx)  # warm-up outside capture (lazy initialisation, JIT kernels)
                    self.stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=self.stream):
                        self._execute(ctx)
                    self._graphs[key] = (ctx, graph)
                    graph.replay()
                    return
                except Exception as e:  # capture is an optimisation: fall back to eager execution
                    self.log(f"CUDA graph capture failed for shapes {key[0]} ({e}); running without CUDA graphs")
                    self.cuda_graphs = False
        self._bind(self._eager, shapes, pool)
        self._execute(self._eager)

    def _row_inputs(self, inputs: dict[str, torch.Tensor] | None, n: int) -> dict[str, torch.Tensor]:
        """A head's row inputs, checked: every one the graph has, [rows, width] each, N rows in all."""
        inputs = dict(inputs or {})
        if set(inputs) != set(self.row_inputs):
            raise ValueError(f"{self.plan} takes the extra inputs {sorted(self.row_inputs)}, got {sorted(inputs)}")
        for name, tensor in inputs.items():
            if tensor.dim() != 2 or tensor.shape[1] != self.row_inputs[name]:
                raise ValueError(f"{name} must be [rows, {self.row_inputs[name]}], got {tuple(tensor.shape)}")
        if inputs and sum(t.shape[0] for t in inputs.values()) != n:
            raise ValueError(f"the extra inputs' rows ({ {k: t.shape[0] for k, t in inputs.items()} }) must add up "
                             f"to the batch's {n} rows")
        return inputs

    def run(self, segments: list[tuple], inputs: dict[str, torch.Tensor] | None = None) -> list[tuple]:
        """One plan execution for segments whose caches share one pool: per segment a host tensor of its own for
        each row output (`widths`' order, logits first). `inputs`: the graph's inputs beyond the batch's (a head's
        `target_features` and `hidden_states`, host tensors; their rows add up to the batch's)."""
        c = self.config
        pool = segments[0][3]
        if pool.pool_k.device != self.device or pool.pool_k.dtype != self.kv_dtype:
            raise ValueError("the tensorrt engine needs caches it made with new_caches (device, K/V dtype)")
        if pool.capacity != self._capacity:
            self._ensure_buffers(pool.capacity)
        x = batch_inputs([s[:4] for s in segments], columns=pool.capacity, max_rows=self.max_tokens)
        n, b = x.input_ids.shape[0], len(segments)
        t, m = x.packed_mask.shape[1:]
        if n > self.max_rows or b > self.max_batch or m > self.max_words:
            raise ValueError(f"a batch of {b} requests / {n} rows / {m} mask words exceeds the plan's profile "
                             f"({self.max_batch} / {self.max_rows} / {self.max_words}): rebuild with "
                             "`spectrt engines --max-batch/--max-tree-tokens`")
        rows_in = self._row_inputs(inputs, n)
        step = dict(zip(STEP_INPUTS, x.tensors()[:len(STEP_INPUTS)], strict=True))
        shapes = {name: tuple(tensor.shape) for name, tensor in (step | rows_in).items()}
        shapes |= {"cache_columns": (pool.capacity,), "pool_k": tuple(pool.pool_k.shape),
                   "pool_v": tuple(pool.pool_v.shape)}
        for name, tensor in step.items():
            self.host[name][:tensor.numel()] = tensor.reshape(-1)
        for name, tensor in rows_in.items():
            self.h_row_inputs[name][:tensor.numel()] = tensor.reshape(-1)
        new_shape = (c.num_layers, c.num_kv_heads, n, c.head_dim)
        numel = c.num_layers * c.num_kv_heads * n * c.head_dim

        def execute_and_write() -> None:
            for name, tensor in step.items():
                self.inputs[name][:tensor.numel()].copy_(self.host[name][:tensor.numel()], non_blocking=self.cuda)
            for name, tensor in rows_in.items():
                self.row_input_buffers[name][:tensor.numel()].copy_(self.h_row_inputs[name][:tensor.numel()],
                                                                    non_blocking=self.cuda)
            self._execute_shapes(shapes, pool)
            self.runs += 1
            new_k, new_v = self.new_k[:numel].view(new_shape), self.new_v[:numel].view(new_shape)
            for (r0, r1), (slot, first, end) in zip(x.rows, x.kv_writes, strict=True):
                pool.pool_k[slot, :, :, first:end] = new_k[:, :, r0:r1]
                pool.pool_v[slot, :, :, first:end] = new_v[:, :, r0:r1]
            for name, width in self.widths.items():
                self.h_outputs[name][:n * width].copy_(self.outputs[name][:n * width], non_blocking=self.cuda)

        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                execute_and_write()
            self.stream.synchronize()
        else:
            execute_and_write()
        outputs = [self.h_outputs[name][:n * width].view(n, width) for name, width in self.widths.items()]
        return [tuple(out[r0:r1].clone() for out in outputs) for r0, r1 in x.rows]

    def forward_many(self, segments: list[tuple], logit_rows: Sequence[int | None] | None = None
                     ) -> list[torch.Tensor]:
        """Logits [T_i, V] per (tokens, positions, tree_mask, cache) segment on the host, each a tensor of its own:
        one plan execution for all segments (per KV pool); their K/V go into their caches on the device."""
        results = forward_by_pool(segments, self.run)  # every row's logits: `logit_rows` only cuts them
        return last_rows([r[0] for r in results], logit_rows)

    def forward_features(self, segments: list[tuple], feature_layers: Sequence[int],
                         logit_rows: Sequence[int | None] | None = None
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(logits, features) per segment on the host, as the native engine's: the features [T, 3 H] come out of
        the same plan execution, built for these layers (`spectrt engines` with an EAGLE-3 head as the draft)."""
        check_features(self.graph_features, feature_layers, self.plan)
        results = forward_by_pool(segments, self.run)
        return last_rows([r[0] for r in results], logit_rows), [r[1] for r in results]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Logits [T, V] on the host, a fresh tensor; K/V go into `cache`."""
        return self.forward_many([(tokens, positions, tree_mask, cache)])[0]
