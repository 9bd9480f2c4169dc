"""The `onnxruntime` backend, and reading of an engines directory (manifest + checksums).

It runs the exported batched tree-verify graph itself (build/export.py), so CI checks the very graph that
TensorRT compiles. `forward_many` is ONE session run for all segments (B requests, each its own tree; see
runtime/engines/batch_inputs.py). The KV pool is the runtime's (`KVCache.pool`, so compaction stays in one place); its
`pool_k`/`pool_v` tensors are bound to the graph's inputs by address, so no cache is copied per step, and the
outputs land in static buffers bound by address too. The graph returns only the new tokens' K/V, which are
copied into their pool slots; each segment's logits are copied out of the static buffer (a tensor of its own).

An engines directory (written by `spectrt engines`, build/engines.py):

    engines/<name>/manifest.json
    engines/<name>/{target,draft}/config.json, tokenizer files, model.fp32.onnx(+.data), plans

`load_engine(engines/<name>/target, backend="onnxruntime")` verifies every file it will use against
the manifest's sha256 and refuses, saying why, when one is missing, corrupted or swapped.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from spectrt.runtime.engines.batch_inputs import FEATURES, INPUT_NAMES, batch_inputs
from spectrt.runtime.engines.kernels import last_rows
from spectrt.runtime.engines.model import KVCache, ModelConfig

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "spectrt-engines/1"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "tokenizer.model")


class EngineDirError(ValueError):
    """An engines directory that cannot be used; the message says why and how to fix it."""


def engine_models(engines: Path, backend: str) -> tuple[Path, Path]:
    """(target, draft) paths for `--engines DIR --backend B`: the role dirs, or for torch the source checkpoints."""
    engines = Path(engines)
    manifest_path = engines / MANIFEST
    if not manifest_path.is_file():
        raise EngineDirError(f"{engines} is not an engines directory (no {MANIFEST}): build one with "
                               "`spectrt engines` (make engines)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("precision") == "int8" and backend != "tensorrt":
        print(f"spectrt: note: {engines} is an INT8 build whose Q/DQ graph is for TensorRT; --backend {backend} runs "
              "the FP target. For INT8 on the CPU pass --target <the `spectrt quantize` checkpoint> (torch backend).",
              file=sys.stderr)
    if backend != "torch":
        return engines / "target", engines / "draft"
    models = manifest["models"]
    paths = []
    for role in ("target", "draft"):
        src = Path(models[role]["source"]["path"])
        if not (src / "config.json").is_file():
            raise EngineDirError(f"--backend torch runs the source checkpoint {src} recorded in {manifest_path}, "
                                   "which is gone: pass --target/--draft, or use --backend onnxruntime|tensorrt")
        paths.append(src)
    return paths[0], paths[1]


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


def forward_by_pool(segments: Sequence[tuple], run: Callable[[list[tuple]], list]) -> list:
    """`run` once per KV pool over that pool's segments (normally all of them), its results in segment order."""
    groups: dict[int, list[int]] = {}
    for i, seg in enumerate(segments):
        groups.setdefault(id(seg[3].pool_k), []).append(i)
    out: list = [None] * len(segments)
    for group in groups.values():
        for i, result in zip(group, run([segments[i] for i in group]), strict=True):
            out[i] = result
    return out


def check_features(graph_layers: Sequence[int], wanted: Sequence[int], where: object) -> None:
    """Refuse features the graph does not return (an engines dir exported for another head, or for none)."""
    if tuple(int(j) for j in wanted) != tuple(graph_layers):
        have = f"layers {list(graph_layers)}" if graph_layers else "none"
        raise EngineDirError(f"{where} returns target features of {have}, the EAGLE-3 head reads layers "
                             f"{list(wanted)}: rebuild the engines with this head as the draft (`spectrt engines "
                             "--draft HEAD`)")


class OnnxEngine:
    """Engine interface over an ONNX Runtime session of the batched tree-verify graph (fp32, CPU by default); a
    target graph exported for an EAGLE-3 head also gives `forward_features`, and an EAGLE-3 head's graph runs through
    `run` (runtime/engines/graph_head.py)."""

    def __init__(self, graph: Path, config: ModelConfig, threads: int | None = None, optimization: str = "all",
                 providers: list[str] | None = None, feature_layers: Sequence[int] = (),
                 input_names: tuple[str, ...] = INPUT_NAMES):
        import onnxruntime as ort

        levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
                  "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
                  "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
        options = ort.SessionOptions()
        options.graph_optimization_level = levels[optimization]
        options.intra_op_num_threads = threads or torch.get_num_threads()
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # workers sleep between runs instead of spinning. Why: an idle session's spinning workers take the cores the
        # other session (target <-> EAGLE-3 head, level after level) runs on. Measured (Zen 3, 2 cores, 6 chat
        # prompts x 64 tokens, two rounds): tree 2,1 with the shipped head 25.2-28.8 tok/s spinning, 43.3-48.5 not;
        # the head's passes 11.9-14.1 ms a step vs 6.5-7.3, the T=5 verify 62-70 ms vs 39-43; AR 26.9-27.9 vs 28.8
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(graph), options, providers=providers or ["CPUExecutionProvider"])
        self.config = config
        self.dtype = torch.float32
        names = tuple(i.name for i in self.session.get_inputs())
        if names != input_names:
            raise EngineDirError(f"{graph} is not a spectrt batched tree-verify graph (inputs {list(names)}): rebuild "
                                 "it with `spectrt engines --force`")
        self.graph = graph
        # row outputs [N, width] in the graph's order, logits first (new K/V go into the pool instead)
        self.widths = {o.name: o.shape[1] for o in self.session.get_outputs() if o.name not in ("new_k", "new_v")}
        self.graph_features = tuple(int(j) for j in feature_layers) if FEATURES in self.widths else ()  # returned
        self.binding = self.session.io_binding()
        self.runs = 0  # session runs (one per forward_many and pool)
        self._rows = 0

    @classmethod
    def load(cls, role_dir: Path, **kwargs) -> OnnxEngine:
        d = EngineDir(role_dir)
        graph, files = d.graph("fp32")
        d.verify(files + d.support_files())
        return cls(graph, d.config, feature_layers=d.entry.get("feature_layers", ()), **kwargs)

    def _ensure_buffers(self, rows: int) -> None:
        """Static outputs for `rows` packed rows (sized in new_caches for a whole pool's windows, never in forward)."""
        if rows <= self._rows:
            return
        c = self.config
        self._rows = rows
        self.outputs = {name: torch.zeros(rows, width, dtype=torch.float32) for name, width in self.widths.items()}
        kv = c.num_layers * c.num_kv_heads * rows * c.head_dim
        self.new_k = torch.zeros(kv, dtype=self.dtype)
        self.new_v = torch.zeros(kv, dtype=self.dtype)

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list[KVCache]:
        caches = KVCache.pool(self.config, slots, capacity, max_window, self.dtype)
        self._ensure_buffers(slots * max_window)
        return caches

    def new_cache(self, capacity: int, max_window: int) -> KVCache:
        return self.new_caches(1, capacity, max_window)[0]

    def _bind(self, name: str, tensor: torch.Tensor, output: bool = False, shape: tuple[int, ...] | None = None):
        dtype = {torch.float32: np.float32, torch.int32: np.int32, torch.float16: np.float16}[tensor.dtype]
        bind = self.binding.bind_output if output else self.binding.bind_input
        bind(name, "cpu", 0, dtype, shape or tuple(tensor.shape), tensor.data_ptr())

    def run(self, segments: list[tuple], inputs: dict[str, torch.Tensor] | None = None) -> list[tuple]:
        """One session run for segments whose caches share one pool: per segment a tensor of its own for each row
        output (`widths`' order, logits first). `inputs`: the graph's inputs beyond the batch's (a head's rows)."""
        c = self.config
        pool = segments[0][3]
        if not (pool.pool_k.is_contiguous() and pool.pool_k.dtype == self.dtype and pool.pool_k.device.type == "cpu"):
            raise ValueError("the onnxruntime engine needs caches it made with new_caches (contiguous fp32, CPU)")
        x = batch_inputs([s[:4] for s in segments], max_rows=self._rows)
        n = x.input_ids.shape[0]
        if n > self._rows:
            raise ValueError(f"{n} rows in one batched forward exceed the engine's buffers ({self._rows} rows, "
                             "sized by new_caches: slots x max_window)")
        for name, tensor in zip(INPUT_NAMES, (*x.tensors(), pool.pool_k, pool.pool_v), strict=True):
            self._bind(name, tensor)
        for name, tensor in (inputs or {}).items():
            self._bind(name, tensor)
        new_shape = (c.num_layers, c.num_kv_heads, n, c.head_dim)
        for name, width in self.widths.items():
            self._bind(name, self.outputs[name], output=True, shape=(n, width))
        self._bind("new_k", self.new_k, output=True, shape=new_shape)
        self._bind("new_v", self.new_v, output=True, shape=new_shape)
        self.session.run_with_iobinding(self.binding)
        self.runs += 1
        numel = c.num_layers * c.num_kv_heads * n * c.head_dim
        new_k, new_v = self.new_k[:numel].view(new_shape), self.new_v[:numel].view(new_shape)
        for (r0, r1), (slot, first, end) in zip(x.rows, x.kv_writes, strict=True):
            pool.pool_k[slot, :, :, first:end] = new_k[:, :, r0:r1]
            pool.pool_v[slot, :, :, first:end] = new_v[:, :, r0:r1]
        outputs = [self.outputs[name] for name in self.widths]
        return [tuple(out[r0:r1].clone() for out in outputs) for r0, r1 in x.rows]

    def forward_many(self, segments: list[tuple], logit_rows: Sequence[int | None] | None = None
                     ) -> list[torch.Tensor]:
        """Logits [T_i, V] per (tokens, positions, tree_mask, cache) segment, each a tensor of its own: one graph run
        for all segments (per KV pool); their K/V go into their caches."""
        results = forward_by_pool(segments, self.run)  # every row's logits: `logit_rows` only cuts them
        return last_rows([r[0] for r in results], logit_rows)

    def forward_features(self, segments: list[tuple], feature_layers: Sequence[int],
                         logit_rows: Sequence[int | None] | None = None
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(logits, features) per segment, as the native engine's: the features [T, 3 H] come out of the same graph
        run, exported for these layers (`spectrt engines` with an EAGLE-3 head as the draft)."""
        check_features(self.graph_features, feature_layers, self.graph)
        results = forward_by_pool(segments, self.run)
        return last_rows([r[0] for r in results], logit_rows), [r[1] for r in results]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor,
                cache: KVCache) -> torch.Tensor:
        """Logits [T, V] (a fresh tensor); K/V go into `cache`."""
        return self.forward_many([(tokens, positions, tree_mask, cache)])[0]
