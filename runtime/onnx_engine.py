"""The `onnxruntime` backend, and reading of an engines directory (manifest + checksums).

It runs the exported tree-verify graph itself (build/export.py), so CI checks the very graph that
TensorRT compiles. The static KV cache is the runtime's `KVCache` (so compaction stays in one
place); its buffers are bound to the graph's `cache_k`/`cache_v` inputs by address, and the outputs
land in static buffers bound by address too: a forward allocates nothing. The graph returns only the
new tokens' K/V, which are copied into their cache slots.

An engines directory (written by `spectrt engines`, build/engines.py):

    engines/<name>/manifest.json
    engines/<name>/{target,draft}/config.json, tokenizer files, model.fp32.onnx(+.data), plans

`load_engine(engines/<name>/target, backend="onnxruntime")` verifies every file it will use against
the manifest's sha256 and refuses, saying why, when one is missing, corrupted or swapped.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from spectrt.runtime.model import KVCache, ModelConfig

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "spectrt-engines/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "tokenizer.model")


class EngineDirError(ValueError):
    """An engines directory that cannot be used; the message says why and how to fix it."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def config_dict(config: ModelConfig) -> dict:
    return {k: getattr(config, k) for k in config.__dataclass_fields__}


class EngineDir:
    """One model (role) of an engines directory: `engines/<name>/<role>`, checked against the manifest."""

    def __init__(self, role_dir: Path):
        role_dir = Path(role_dir)
        self.role_dir = role_dir
        self.root = role_dir.parent
        manifest_path = self.root / MANIFEST
        if not manifest_path.is_file():
            if (role_dir / MANIFEST).is_file():
                raise EngineDirError(f"{role_dir} is an engines directory: pass its model, {role_dir}/target or "
                                     f"{role_dir}/draft (the CLI does this for --engines DIR)")
            raise EngineDirError(
                f"{role_dir} is not a model of an engines directory (no {manifest_path}): build one with "
                "`spectrt engines` (make engines) and pass --engines engines/<name>"
            )
        try:
            self.manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as e:
            raise EngineDirError(
                f"{manifest_path} is not valid JSON ({e}): rebuild with `spectrt engines --force`") from e
        if self.manifest.get("format") != MANIFEST_FORMAT:
            raise EngineDirError(f"{manifest_path} has format {self.manifest.get('format')!r}, this runtime reads "
                                 f"{MANIFEST_FORMAT!r}: rebuild with `spectrt engines --force`")
        self.role = role_dir.name
        models = self.manifest.get("models", {})
        if self.role not in models:
            raise EngineDirError(f"{manifest_path} has no model {self.role!r} (it has {sorted(models)})")
        self.entry = models[self.role]
        self.config = ModelConfig(**self.entry["config"])

    def path(self, rel: str) -> Path:
        return self.root / rel

    def verify(self, rel_paths: list[str]) -> None:
        """Refuse unless every file exists with the size and sha256 the manifest recorded."""
        files = self.manifest.get("files", {})
        for rel in rel_paths:
            p = self.path(rel)
            want = files.get(rel)
            if want is None:
                raise EngineDirError(f"{p} is not listed in {self.root / MANIFEST}: rebuild with `spectrt engines`")
            if not p.is_file():
                raise EngineDirError(f"{p} is missing (listed in {self.root / MANIFEST}): rebuild with "
                                     "`spectrt engines`")
            size = p.stat().st_size
            if size != want["bytes"] or sha256_file(p) != want["sha256"]:
                raise EngineDirError(
                    f"{p} does not match {self.root / MANIFEST} (sha256/size differ: the file is corrupted or was "
                    f"swapped; {size} bytes, manifest says {want['bytes']}): refusing to load it; rebuild with "
                    "`spectrt engines --force`"
                )
        on_disk = ModelConfig.from_dir(self.role_dir)
        if on_disk != self.config:
            raise EngineDirError(f"{self.role_dir}/config.json differs from the manifest's {self.role} config: "
                                 "rebuild with `spectrt engines --force`")

    def support_files(self) -> list[str]:
        return [f"{self.role}/{n}" for n in ("config.json", *TOKENIZER_FILES) if (self.role_dir / n).is_file()]

    def graph(self, precision: str = "fp32") -> tuple[Path, list[str]]:
        graphs = self.entry.get("graphs", {})
        if precision not in graphs:
            raise EngineDirError(f"{self.root} has no {precision} graph for {self.role} (has {sorted(graphs)}): "
                                 "rebuild with `spectrt engines`")
        g = graphs[precision]
        return self.path(g["file"]), [g["file"], g["data"]]


def fill_mask(out: torch.Tensor, tree_mask: torch.Tensor, length: int, columns: int | None = None) -> None:
    """Write the graph's attention mask into `out` [T, S] for new tokens after a committed prefix of `length`.

    The graph's context is cache slots [0, S-T) followed by the T new tokens. With `columns=None`
    (dynamic span) S = length + W: columns are the used slots. With a fixed S (static span, TensorRT
    and CUDA graphs) the stale slots between the window and the last T columns are masked out.
    """
    t, window = tree_mask.shape
    s = out.shape[1]
    out[:, :length] = True
    if columns is None:
        out[:, length:] = tree_mask
        return
    drafted = window - t  # window slots already in the cache (earlier tree levels)
    out[:, length:length + drafted] = tree_mask[:, :drafted]
    out[:, length + drafted:s - t] = False
    out[:, s - t:] = tree_mask[:, drafted:]


class OnnxEngine:
    """Engine interface over an ONNX Runtime session of the tree-verify graph (fp32, CPU by default)."""

    def __init__(self, graph: Path, config: ModelConfig, threads: int | None = None, optimization: str = "all",
                 span: str = "dynamic", providers: list[str] | None = None):
        import onnxruntime as ort

        if span not in ("dynamic", "static"):
            raise ValueError(f"span must be 'dynamic' or 'static', got {span!r}")
        levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[optimization]
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        self.session = ort.InferenceSession(str(graph), options, providers=providers or ["CPUExecutionProvider"])
        self.config = config
        self.span = span
        self.dtype = torch.float32
        names = [i.name for i in self.session.get_inputs()]
        if names != ["input_ids", "position_ids", "attention_mask", "cache_k", "cache_v"]:
            raise EngineDirError(f"{graph} is not a spectrt tree-verify graph (inputs {names})")
        self.binding = self.session.io_binding()
        self._rows = 0
        self._columns = 0

    @classmethod
    def load(cls, role_dir: Path, **kwargs) -> OnnxEngine:
        d = EngineDir(role_dir)
        graph, files = d.graph("fp32")
        d.verify(files + d.support_files())
        return cls(graph, d.config, **kwargs)

    def _ensure_buffers(self, rows: int, columns: int) -> None:
        """Static scratch for the largest cache created so far (allocated in new_cache, never in forward)."""
        if rows <= self._rows and columns <= self._columns:
            return
        c = self.config
        self._rows, self._columns = max(rows, self._rows), max(columns, self._columns)
        self.ids = torch.zeros(self._rows, dtype=torch.int32)
        self.pos = torch.zeros(self._rows, dtype=torch.int32)
        self.mask = torch.zeros(self._rows * self._columns, dtype=torch.bool)
        self.logits = torch.zeros(self._rows, c.vocab_size, dtype=torch.float32)
        kv = c.num_layers * c.num_kv_heads * self._rows * c.head_dim
        self.new_k = torch.zeros(kv, dtype=self.dtype)
        self.new_v = torch.zeros(kv, dtype=self.dtype)

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list[KVCache]:
        caches = KVCache.pool(self.config, slots, capacity, max_window, self.dtype)
        self._ensure_buffers(max_window, capacity)
        return caches

    def new_cache(self, capacity: int, max_window: int) -> KVCache:
        return self.new_caches(1, capacity, max_window)[0]

    def _bind(self, name: str, tensor: torch.Tensor, shape: tuple[int, ...], output: bool = False) -> None:
        dtype = {torch.float32: np.float32, torch.int32: np.int32, torch.bool: np.bool_,
                 torch.float16: np.float16}[tensor.dtype]
        bind = self.binding.bind_output if output else self.binding.bind_input
        bind(name, "cpu", 0, dtype, shape, tensor.data_ptr())

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Logits [T, V] (a fresh tensor: callers keep several forwards' logits); K/V go into `cache`."""
        c = self.config
        t = tree_mask.shape[0]
        n = cache.length
        start, end = cache.new_slots(tokens, tree_mask, self._rows)
        if not (cache.k.is_contiguous() and cache.k.dtype == self.dtype and cache.k.device.type == "cpu"):
            raise ValueError("the onnxruntime engine needs the cache it made with new_cache (contiguous fp32, CPU)")
        s = end if self.span == "dynamic" else cache.capacity
        self.ids[:t] = tokens
        self.pos[:t] = positions
        mask = self.mask[:t * s].view(t, s)
        fill_mask(mask, tree_mask, n, None if self.span == "dynamic" else s)
        cache_shape = tuple(cache.k.shape)
        new_shape = (c.num_layers, c.num_kv_heads, t, c.head_dim)
        self._bind("input_ids", self.ids, (t,))
        self._bind("position_ids", self.pos, (t,))
        self._bind("attention_mask", self.mask, (t, s))
        self._bind("cache_k", cache.k, cache_shape)
        self._bind("cache_v", cache.v, cache_shape)
        self._bind("logits", self.logits, (t, c.vocab_size), output=True)
        self._bind("new_k", self.new_k, new_shape, output=True)
        self._bind("new_v", self.new_v, new_shape, output=True)
        self.session.run_with_iobinding(self.binding)
        numel = c.num_layers * c.num_kv_heads * t * c.head_dim
        cache.k[:, :, start:end] = self.new_k[:numel].view(new_shape)
        cache.v[:, :, start:end] = self.new_v[:numel].view(new_shape)
        return self.logits[:t].clone()

    def forward_many(self, segments: list[tuple]) -> list[torch.Tensor]:
        """Logits per (tokens, positions, tree_mask, cache) segment: one graph run per segment (each its own)."""
        return [self.forward(*segment) for segment in segments]
