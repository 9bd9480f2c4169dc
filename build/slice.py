"""Slice a target: its embeddings, first K decoder layers, final norm and LM head, bit-identical.

A slice shares the target's tokenizer and vocabulary, so its proposals are target ids; distillation
(build/distill.py) trains its layers and build/draft.py writes the result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
)


def load_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors checkpoint (single file or shards)."""
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(checkpoint).glob("*.safetensors")):
        state.update(load_file(shard))
    return state


def slice_target(target: Path, layers: int, out_dir: Path) -> Path:
    """Write embeddings + the first `layers` decoder layers + final norm + LM head of `target` to `out_dir`."""
    target, out_dir = Path(target), Path(out_dir)
    config = json.loads((target / "config.json").read_text())
    total = config["num_hidden_layers"]
    if not 1 <= layers < total:
        raise ValueError(f"--layers must be between 1 and {total - 1} (the target has {total} layers), got {layers}")
    state = load_state_dict(target)
    if "lm_head.weight" not in state and not config.get("tie_word_embeddings", False):
        raise ValueError(f"{target} has no LM head (lm_head.weight) and does not tie embeddings: cannot slice it")
    keep = {}
    for name, tensor in state.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= layers:
                continue
        keep[name] = tensor.contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(keep, out_dir / "model.safetensors", metadata={"format": "pt"})
    config["num_hidden_layers"] = layers
    if isinstance(config.get("layer_types"), list):  # per-layer attention kinds (Qwen2/3): one per kept layer
        config["layer_types"] = config["layer_types"][:layers]
    config["spectrt_draft"] = {"sliced_from": str(target), "layers": layers}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, out_dir / name)
    return out_dir
