"""An EAGLE-3 head's batched graph (build/export_eagle3.py) behind `Eagle3Head`'s interface, so the proposer and the
decode loop do not know which backend runs the head: `forward_many` over (tokens, positions, tree_mask, cache, hidden)
segments, `new_caches`, `feature_layers`, `feature_width`, `head_ids`, `full_rows`.

The graph runs on any engine with `run(segments, inputs)` (OnnxEngine over the head graph, TensorRTEngine over its
plan: `load(..., backend=)`). A call's rows are all committed tokens' target features (a catch-up: the graph's
`target_features`, which its fc reads) or all drafted nodes' parent hidden (`hidden_states`), as
`Eagle3Head.forward_many` takes them; the other input is empty.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from spectrt.runtime.engines.batch_inputs import HEAD_INPUT_NAMES
from spectrt.runtime.engines.eagle3 import Eagle3Config, draft_ids, full_vocab_rows
from spectrt.runtime.engines.kernels import last_rows
from spectrt.runtime.engines.model import KVCache, ModelConfig
from spectrt.runtime.engines.onnx_engine import EngineDir, EngineDirError, OnnxEngine, forward_by_pool

DRAFT_VOCAB = "d2t.safetensors"  # the head's d2t/t2d buffers, next to its graph in engines/<name>/draft/


class GraphHead:
    """`Eagle3Head`'s interface over a graph engine (see the module doc)."""

    def __init__(self, engine, config: Eagle3Config, head_ids: torch.Tensor):
        self.engine, self.config, self.head_ids = engine, config, head_ids
        self.feature_width = 3 * config.target_hidden_size
        self.no_features = torch.zeros(0, self.feature_width)
        self.no_hidden = torch.zeros(0, config.model.hidden_size)

    @classmethod
    def load(cls, role_dir: Path, target_config: ModelConfig, backend: str = "onnxruntime", **kwargs) -> GraphHead:
        """engines/<name>/draft of an engines directory built with an EAGLE-3 head: its fp32 graph on ONNX Runtime
        (`backend="onnxruntime"`) or its TensorRT plan (`"tensorrt"`); `kwargs` go to the engine's constructor."""
        if backend not in ("onnxruntime", "tensorrt"):
            raise ValueError(f"an EAGLE-3 head's graph runs with --backend onnxruntime or tensorrt, not {backend!r}")
        d = EngineDir(role_dir)
        vocab = f"{d.role}/{DRAFT_VOCAB}"
        if backend == "tensorrt":  # TensorRTEngine.load verifies the plan and the support files
            d.verify([vocab])
        else:
            graph, files = d.graph("fp32")
            d.verify(files + d.support_files() + [vocab])
        try:
            config = Eagle3Config.from_dir(d.role_dir, target_config)
            head_ids = draft_ids(load_file(str(d.role_dir / DRAFT_VOCAB)), config)
        except ValueError as e:
            raise EngineDirError(f"{d.role_dir}: {e}") from e
        if backend == "tensorrt":
            from spectrt.runtime.engines.trt_engine import TensorRTEngine

            engine = TensorRTEngine.load(d.role_dir, input_names=HEAD_INPUT_NAMES, **kwargs)
        else:
            engine = OnnxEngine(graph, d.config, input_names=HEAD_INPUT_NAMES, **kwargs)
        return cls(engine, config, head_ids)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    def new_caches(self, slots: int, capacity: int, max_window: int) -> list[KVCache]:
        return self.engine.new_caches(slots, capacity, max_window)

    def new_cache(self, capacity: int, max_window: int) -> KVCache:
        return self.engine.new_cache(capacity, max_window)

    def full_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return full_vocab_rows(logits, self.head_ids, self.config.model.vocab_size)

    def _run(self, segments: list[tuple]) -> list[tuple]:
        """One graph run: the rows' input hidden goes in as features or as hidden states (see the module doc)."""
        rows = torch.cat([s[4] for s in segments]).float() if len(segments) > 1 else segments[0][4].float()
        features = rows.shape[1] == self.feature_width
        inputs = {"target_features": rows if features else self.no_features,
                  "hidden_states": self.no_hidden if features else rows}
        return self.engine.run(segments, {k: v.contiguous() for k, v in inputs.items()})

    def forward_many(self, segments: Sequence[tuple], full_vocab: bool = True,
                     logit_rows: Sequence[int | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(logits, output hidden) per segment, as `Eagle3Head.forward_many` (draft-vocabulary logits with
        `full_vocab=False`)."""
        hidden_size = self.config.model.hidden_size
        width = segments[0][4].shape[-1] if segments else hidden_size
        for _, _, mask, _, hidden in segments:
            if width not in (hidden_size, self.feature_width) or hidden.shape != (mask.shape[0], width):
                raise ValueError(f"hidden must be [{mask.shape[0]}, {hidden_size}] (or target features [{mask.shape[0]}, "
                                 f"{self.feature_width}] in every segment), got {tuple(hidden.shape)}")
        results = forward_by_pool(segments, self._run)
        logits = last_rows([r[0] for r in results], logit_rows)
        return [(self.full_rows(lg) if full_vocab else lg, r[1]) for lg, r in zip(logits, results, strict=True)]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, tree_mask: torch.Tensor, cache: KVCache,
                hidden: torch.Tensor, full_vocab: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_many([(tokens, positions, tree_mask, cache, hidden)], full_vocab)[0]

