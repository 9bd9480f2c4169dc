"""The `tensorrt` backend: a TensorRT plan of the tree-verify graph behind the one engine interface.

- The plan (build/compile.py) is loaded with the module that built it (`tensorrt` or `tensorrt_rtx`),
  after its sha256 is checked against the engines manifest and its compute capability against this GPU.
- Static device buffers (torch CUDA tensors) are bound once: token ids, positions, the attention mask,
  the logits and the new K/V; the KV cache is the runtime's `KVCache` allocated on the GPU in the plan's
  K/V dtype, bound by address. Nothing is allocated per forward.
- The graph runs in **static span** mode (S = cache capacity, see runtime/onnx_engine.fill_mask): every
  input shape except T is fixed, so each tree size T gets its own execution context and CUDA graph
  (captured the second time a T is seen; prompt-chunk remainders that occur once run eagerly).
  Contexts share one scratch buffer (they run one after another on one stream).
- `execute_async_v3` runs on a private stream ordered after the caller's stream; logits come back to
  pinned host memory (so the decoder, greedy or sampling, works unchanged), K/V stay on the GPU.

Nothing here runs without an NVIDIA GPU (no GPU was lent to the session that wrote it; the CPU tests
drive this class with `device="cpu"` and a stand-in TensorRT module that executes the same graph with
ONNX Runtime, which checks buffers, shapes, addresses, masks and cache writes, not TensorRT itself).
`scripts/gpu_check.sh` is the prepared check for a GPU machine.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from spectrt.runtime.model import KVCache, ModelConfig
from spectrt.runtime.onnx_engine import EngineDir, EngineDirError, fill_mask

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "int32": torch.int32, "int8": torch.int8, "bool": torch.bool}
INPUTS = ("input_ids", "position_ids", "attention_mask", "cache_k", "cache_v")
OUTPUTS = ("logits", "new_k", "new_v")
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
        if names != set(INPUTS) | set(OUTPUTS):
            raise EngineDirError(f"{plan} has tensors {sorted(names)}, not the tree-verify graph's "
                                 f"{sorted(INPUTS + OUTPUTS)}: rebuild with `spectrt engines --force`")
        self.kv_dtype = TORCH_DTYPES[io["inputs"]["cache_k"]["dtype"]]
        self.logits_dtype = TORCH_DTYPES[io["outputs"]["logits"]["dtype"]]
        self.max_tokens = profile["input_ids"][2][0]
        self.max_slots = profile["cache_k"][2][2]
        self.cuda_graphs = cuda_graphs and self.cuda
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._eager = self.engine.create_execution_context()
        self._graphs: dict[tuple[int, int], tuple] = {}  # (T, cache address) -> (context, CUDAGraph)
        self._seen: dict[tuple[int, int], int] = {}
        self._scratch = None
        self._rows = self._columns = 0

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
        if capacity > self.max_slots or max_window > self.max_tokens:
            raise ValueError(
                f"a cache of {capacity} slots / {max_window}-token window exceeds the plan's profile "
                f"({self.max_slots} slots, {self.max_tokens} tokens): rebuild with `spectrt engines "
                "--max-seq-len/--max-tree-tokens`"
            )
        with torch.device(self.device):
            caches = KVCache.pool(self.config, slots, capacity, max_window, self.kv_dtype)
        self._ensure_buffers(max_window, capacity)
        return caches

    def new_cache(self, capacity: int, max_window: int) -> KVCache:
        return self.new_caches(1, capacity, max_window)[0]

    def _ensure_buffers(self, rows: int, columns: int) -> None:
        if rows <= self._rows and columns <= self._columns:
            return
        c = self.config
        self._rows, self._columns = max(rows, self._rows), max(columns, self._columns)
        dev, pin = self.device, self.cuda
        host = lambda n, dt: torch.zeros(n, dtype=dt, pin_memory=pin)  # noqa: E731
        self.h_ids, self.h_pos = host(self._rows, torch.int32), host(self._rows, torch.int32)
        self.h_mask = host(self._rows * self._columns, torch.bool)
        self.h_logits = host(self._rows * c.vocab_size, torch.float32).view(self._rows, c.vocab_size)
        self.ids = torch.zeros(self._rows, dtype=torch.int32, device=dev)
        self.pos = torch.zeros(self._rows, dtype=torch.int32, device=dev)
        self.mask = torch.zeros(self._rows * self._columns, dtype=torch.bool, device=dev)
        self.logits = torch.zeros(self._rows * c.vocab_size, dtype=self.logits_dtype, device=dev)
        kv = c.num_layers * c.num_kv_heads * self._rows * c.head_dim
        self.new_k = torch.zeros(kv, dtype=self.kv_dtype, device=dev)
        self.new_v = torch.zeros(kv, dtype=self.kv_dtype, device=dev)
        self._graphs.clear()  # captured graphs point at the old buffers
        self._seen.clear()

    # -- execution -----------------------------------------------------------------------------------

    def _bind(self, ctx, t: int, s: int, cache: KVCache) -> None:
        shapes = {"input_ids": (t,), "position_ids": (t,), "attention_mask": (t, s),
                  "cache_k": tuple(cache.k.shape), "cache_v": tuple(cache.v.shape)}
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise RuntimeError(f"TensorRT refused shape {shape} for {name} (outside the plan's profile)")
        addresses = {"input_ids": self.ids, "position_ids": self.pos, "attention_mask": self.mask,
                     "cache_k": cache.k, "cache_v": cache.v, "logits": self.logits, "new_k": self.new_k,
                     "new_v": self.new_v}
        for name, tensor in addresses.items():
            ctx.set_tensor_address(name, tensor.data_ptr())

    def _stream_handle(self) -> int:
        return self.stream.cuda_stream if self.cuda else 0

    def _execute(self, ctx) -> None:
        if not ctx.execute_async_v3(self._stream_handle()):
            raise RuntimeError("TensorRT execute_async_v3 failed (see TensorRT's error above)")

    def _new_context(self):
        """A context for one captured T; all share one scratch buffer where TensorRT allows it."""
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

    def _run(self, t: int, s: int, cache: KVCache) -> None:
        key = (t, cache.k.data_ptr())
        if self.cuda_graphs:
            entry = self._graphs.get(key)
            if entry is not None:
                entry[1].replay()
                return
            self._seen[key] = self._seen.get(key, 0) + 1
            if self._seen[key] >= 2:
                try:
                    ctx = self._new_context()
                    self._bind(ctx, t, s, cache)
                    self._execute(ctx)  # warm-up outside capture (lazy initialisation, JIT kernels)
                    self.stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=self.stream):
                        self._execute(ctx)
                    self._graphs[key] = (ctx, graph)
                    graph.replay()
                    return
                except Exception as e:  # capture is an optimisation: fall back to eager execution
                    self.log(f"CUDA graph capture failed for T={t} ({e}); running without CUDA graphs")
                    self.cuda_graphs = False
        self._bind(self._eager, t, s, cache)
        self._execute(self._eager)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Logits [T, V] on the host, a fresh tensor (callers keep several forwards' logits at once)."""
        c = self.config
        t = tree_mask.shape[0]
        n = cache.length
        start, end = cache.new_slots(tokens, tree_mask, self._rows)
        if cache.k.device != self.device or cache.k.dtype != self.kv_dtype:
            raise ValueError("the tensorrt engine needs the cache it made with new_cache (device, K/V dtype)")
        s = cache.capacity  # static span: only T varies between calls
        self.h_ids[:t] = tokens
        self.h_pos[:t] = positions
        fill_mask(self.h_mask[:t * s].view(t, s), tree_mask.cpu(), n, s)
        new_shape = (c.num_layers, c.num_kv_heads, t, c.head_dim)
        numel = c.num_layers * c.num_kv_heads * t * c.head_dim
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self.ids[:t].copy_(self.h_ids[:t], non_blocking=True)
                self.pos[:t].copy_(self.h_pos[:t], non_blocking=True)
                self.mask[:t * s].copy_(self.h_mask[:t * s], non_blocking=True)
                self._run(t, s, cache)
                cache.k[:, :, start:end] = self.new_k[:numel].view(new_shape)
                cache.v[:, :, start:end] = self.new_v[:numel].view(new_shape)
                self.h_logits[:t].copy_(self.logits[:t * c.vocab_size].view(t, -1), non_blocking=True)
            self.stream.synchronize()
        else:
            self.ids[:t] = self.h_ids[:t]
            self.pos[:t] = self.h_pos[:t]
            self.mask[:t * s] = self.h_mask[:t * s]
            self._run(t, s, cache)
            cache.k[:, :, start:end] = self.new_k[:numel].view(new_shape)
            cache.v[:, :, start:end] = self.new_v[:numel].view(new_shape)
            self.h_logits[:t] = self.logits[:t * c.vocab_size].view(t, -1)
        return self.h_logits[:t].clone()

    def forward_many(self, segments: list[tuple]) -> list[torch.Tensor]:
        """Logits per (tokens, positions, tree_mask, cache) segment: one plan run per segment (each its own)."""
        return [self.forward(*segment) for segment in segments]
