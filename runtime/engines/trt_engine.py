"""The `tensorrt` backend: a TensorRT plan of the batched tree-verify graph behind the one engine interface.

- The plan (build/compile.py) is loaded with the module that built it (`tensorrt` or `tensorrt_rtx`: one code path,
  the same Python API), after its sha256 is checked against the engines manifest and its compute capability
  against this GPU.
- `forward_many` is ONE plan execution for all segments (B requests, each its own tree; runtime/engines/batch_inputs.py).
  The KV pool (`KVCache.pool`, [slots, layers, kv_heads, capacity, head_dim]) lives in device memory in the plan's
  K/V dtype and is bound by address: no cache crosses the bus. The small per-step inputs go through pinned host
  buffers into static device buffers; the new K/V are written into the pool slots on the GPU; only the logits come
  back to (pinned) host memory, so the decoder, greedy or sampling, works unchanged.
- **Static span**: `cache_columns` is the whole capacity (S = C), so only N, B, T and M vary between calls. Each
  shape seen twice gets its own execution context and CUDA graph (captured on the second sighting; shapes that
  occur once run eagerly); contexts share one scratch buffer (they run one after another on one stream).
- `execute_async_v3` runs on a private stream ordered after the caller's stream.

Nothing here runs without an NVIDIA GPU (no GPU with TensorRT was lent to the sessions that wrote it; the CPU tests
drive this class with `device="cpu"` and a stand-in TensorRT module that executes the same graph with ONNX Runtime,
which checks buffers, shapes, addresses, inputs and pool writes, not TensorRT itself). `scripts/gpu_check.sh` is the
prepared check for a GPU machine.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from spectrt.runtime.engines.batch_inputs import INPUT_NAMES, OUTPUT_NAMES, batch_inputs
from spectrt.runtime.engines.kernels import last_rows
from spectrt.runtime.engines.model import KVCache, ModelConfig
from spectrt.runtime.engines.onnx_engine import EngineDir, EngineDirError, forward_by_pool

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "int8": torch.int8, "bool": torch.bool}
STEP_INPUTS = INPUT_NAMES[:7]  # copied host -> device every step; cache_columns and the pool are bound as they are
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
    def __init__(self, plan: Path, config: ModelConfig, io: dict, profile: dict, module: str = "tensorrt_rtx",
                 device: str = "cuda", cuda_graphs: bool = True, trt=None, log=None):
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
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        if names != set(INPUT_NAMES) | set(OUTPUT_NAMES):
            raise EngineDirError(f"{plan} has tensors {sorted(names)}, not the batched tree-verify graph's "
                                 f"{sorted(INPUT_NAMES + OUTPUT_NAMES)}: rebuild with `spectrt engines --force`")
        self.kv_dtype = TORCH_DTYPES[io["inputs"]["pool_k"]["dtype"]]
        self.logits_dtype = TORCH_DTYPES[io["outputs"]["logits"]["dtype"]]
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
        return cls(d.path(entry["file"]), d.config, entry["io"], entry["profiles"][0], entry["module"], **kwargs)

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
        self.h_logits = torch.zeros(n * c.vocab_size, dtype=torch.float32, pin_memory=pin)
        self.logits = torch.zeros(n * c.vocab_size, dtype=self.logits_dtype, device=dev)
        kv = c.num_layers * c.num_kv_heads * n * c.head_dim
        self.new_k = torch.zeros(kv, dtype=self.kv_dtype, device=dev)
        self.new_v = torch.zeros(kv, dtype=self.kv_dtype, device=dev)
        self._capacity = capacity
        self._graphs.clear()  # captured graphs point at the old buffers
        self._seen.clear()

    # -- execution -----------------------------------------------------------------------------------

    def _bind(self, ctx, shapes: dict[str, tuple[int, ...]], pool: KVCache) -> None:
        for name in INPUT_NAMES:
            if not ctx.set_input_shape(name, shapes[name]):
                raise RuntimeError(f"TensorRT refused shape {shapes[name]} for {name} (outside the plan's profile)")
        addresses = {**self.inputs, "cache_columns": self.columns, "pool_k": pool.pool_k, "pool_v": pool.pool_v,
                     "logits": self.logits, "new_k": self.new_k, "new_v": self.new_v}
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
        key = (tuple(shapes[name] for name in STEP_INPUTS), tuple(pool.pool_k.shape), pool.pool_k.data_ptr())
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

    def _run(self, segments: list[tuple]) -> list[torch.Tensor]:
        """One plan execution for segments whose caches share one pool; logits on the host, one tensor each."""
        c = self.config
        pool = segments[0][3]
        if pool.pool_k.device != self.device or pool.pool_k.dtype != self.kv_dtype:
            raise ValueError("the tensorrt engine needs caches it made with new_caches (device, K/V dtype)")
        if pool.capacity != self._capacity:
            self._ensure_buffers(pool.capacity)
        x = batch_inputs(segments, columns=pool.capacity, max_rows=self.max_tokens)
        n, b = x.input_ids.shape[0], len(segments)
        t, m = x.packed_mask.shape[1:]
        if n > self.max_rows or b > self.max_batch or m > self.max_words:
            raise ValueError(f"a batch of {b} requests / {n} rows / {m} mask words exceeds the plan's profile "
                             f"({self.max_batch} / {self.max_rows} / {self.max_words}): rebuild with "
                             "`spectrt engines --max-batch/--max-tree-tokens`")
        step = dict(zip(STEP_INPUTS, x.tensors()[:len(STEP_INPUTS)], strict=True))
        shapes = {name: tuple(tensor.shape) for name, tensor in step.items()}
        shapes |= {"cache_columns": (pool.capacity,), "pool_k": tuple(pool.pool_k.shape),
                   "pool_v": tuple(pool.pool_v.shape)}
        for name, tensor in step.items():
            self.host[name][:tensor.numel()] = tensor.reshape(-1)
        new_shape = (c.num_layers, c.num_kv_heads, n, c.head_dim)
        numel = c.num_layers * c.num_kv_heads * n * c.head_dim
        rows = n * c.vocab_size

        def execute_and_write() -> None:
            for name, tensor in step.items():
                self.inputs[name][:tensor.numel()].copy_(self.host[name][:tensor.numel()], non_blocking=self.cuda)
            self._execute_shapes(shapes, pool)
            self.runs += 1
            new_k, new_v = self.new_k[:numel].view(new_shape), self.new_v[:numel].view(new_shape)
            for (r0, r1), (slot, first, end) in zip(x.rows, x.kv_writes, strict=True):
                pool.pool_k[slot, :, :, first:end] = new_k[:, :, r0:r1]
                pool.pool_v[slot, :, :, first:end] = new_v[:, :, r0:r1]
            self.h_logits[:rows].copy_(self.logits[:rows], non_blocking=self.cuda)

        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                execute_and_write()
            self.stream.synchronize()
        else:
            execute_and_write()
        logits = self.h_logits[:rows].view(n, c.vocab_size)
        return [logits[r0:r1].clone() for r0, r1 in x.rows]

    def forward_many(self, segments: list[tuple], logit_rows: Sequence[int | None] | None = None
                     ) -> list[torch.Tensor]:
        """Logits [T_i, V] per (tokens, positions, tree_mask, cache) segment on the host, each a tensor of its own:
        one plan execution for all segments (per KV pool); their K/V go into their caches on the device."""
        logits = forward_by_pool(segments, self._run)  # every row's: `logit_rows` only cuts them
        return last_rows(logits, logit_rows)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Logits [T, V] on the host, a fresh tensor; K/V go into `cache`."""
        return self.forward_many([(tokens, positions, tree_mask, cache)])[0]
