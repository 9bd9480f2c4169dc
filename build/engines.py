"""`spectrt engines` / `make engines`: draft + target -> engines/<name>/ (graphs, plans, tokenizer, manifest).

    engines/<name>/manifest.json          model configs, precision, profiles, max lengths and batch, tree
                                          defaults, tool versions, sha256 + size of every file below
    engines/<name>/<role>/                role = target | draft
        config.json, tokenizer files      (so the runtime and the tokenizer load from here alone)
        model.fp32.onnx(.data)            batched tree-verify graph (build/export.py), fp32: the onnxruntime
                                          backend and parity tests; with an EAGLE-3 head as the draft the
                                          target's also returns the head's feature rows and the draft's is the
                                          head graph (build/export_eagle3.py)
        d2t.safetensors                   the head's draft-vocabulary map (an EAGLE-3 draft only)
        model.fp16.onnx(.data)            fp16 graph (PRECISION=fp16): what the FP16 plan is built from
        model.<precision>.plan            TensorRT plan (one file for all ARCH compute capabilities)

Re-running with unchanged inputs reuses every file whose recorded inputs (source weights' sha256, exporter
version, precision, profiles, archs, TensorRT module/version) and checksum are unchanged; `--force`
rebuilds everything. Draft/target pairs whose vocabulary or config do not fit together are refused
before anything is built. The draft is the target's default one (the shipped EAGLE-3 head for the embedded target:
nothing is trained here), a SpecForge-layout EAGLE-3 head, or any LLaMA-family draft checkpoint (a slice); the
manifest records its `kind` and, for a head, the target's `feature_layers`.

Measured on this project's 2-core CPU (quiet: under the team's CPU lock), `spectrt engines` for the embedded
SmolLM2-135M target + its distilled draft (4 layers, 8k subset head), batched graphs, plans for the six TensorRT-RTX
compute capabilities: 47 s in all; export fp32 target 12.8 s (538 MB), fp16 7.2 s, draft 2.4 s / 1.2 s;
TensorRT-RTX plans: target FP16 18.9 s (296 MB), draft FP16 2.0 s (101 MB).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from spectrt.build.compile import (
    CompileError,
    Profile,
    build_plan,
    default_profiles,
    resolve_archs,
    trt_module,
)
from spectrt.build.export import EXPORT_VERSION, FEATURES, adopt_graph, export_graph, graph_files, graph_io
from spectrt.build.export_eagle3 import HEAD_EXPORT_VERSION, export_head_graph, save_draft_vocab
from spectrt.runtime.engines.eagle3 import Eagle3Config, is_eagle3
from spectrt.runtime.engines.graph_head import DRAFT_VOCAB
from spectrt.runtime.engines.model import ModelConfig
from spectrt.runtime.engines.onnx_engine import (
    MANIFEST,
    MANIFEST_FORMAT,
    TOKENIZER_FILES,
    config_dict,
    sha256_file,
)

PRECISIONS = ("fp16", "int8", "fp32")
ROLES = ("target", "draft")
DEFAULT_ENGINES = Path("engines")
DEFAULT_MAX_SEQ_LEN = 2048
DEFAULT_MAX_TREE_TOKENS = 64
DEFAULT_MAX_BATCH = 8  # requests per batched forward in a TensorRT plan (the Triton model's max_active)


class EngineBuildError(ValueError):
    """Inputs that cannot make an engines directory; the message says why and what to do."""


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def source_sha256(checkpoint: Path) -> str:
    """One digest over a checkpoint's config and weights (what an export depends on)."""
    h = hashlib.sha256()
    for p in [checkpoint / "config.json", *sorted(checkpoint.glob("*.safetensors"))]:
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def _id_set(ids) -> set:
    return set(ids) if isinstance(ids, list) else {ids}


def _special_ids(checkpoint: Path) -> dict:
    """bos/eos ids as each of config.json and generation_config.json states them."""
    ids = {}
    for name in ("config.json", "generation_config.json"):
        p = checkpoint / name
        if p.is_file():
            raw = json.loads(p.read_text())
            for k in ("bos_token_id", "eos_token_id"):
                if raw.get(k) is not None:
                    ids[f"{k} ({name})"] = raw[k]
    return ids


def check_pair(target: Path, draft: Path, max_seq_len: int, max_tree_tokens: int
               ) -> tuple[ModelConfig, ModelConfig, Eagle3Config | None]:
    """Refuse, with the reason, a draft whose vocabulary/config does not fit the target, or lengths that don't fit;
    (target config, draft config, the head's config when the draft is an EAGLE-3 head)."""
    from spectrt.runtime.engines.engine import check_draft_matches

    head = None
    try:
        t_cfg, d_cfg = ModelConfig.from_dir(target), ModelConfig.from_dir(draft)
        if is_eagle3(draft):  # checked against the target it reads: vocabulary, feature width, layers
            head = Eagle3Config.from_dir(draft, t_cfg)
        else:
            check_draft_matches(target, draft)
    except (ValueError, FileNotFoundError, KeyError) as e:
        raise EngineBuildError(f"refusing to build engines: {e}") from e
    t_ids, d_ids = _special_ids(target), _special_ids(draft)
    for k in sorted(t_ids.keys() & d_ids.keys()):
        if k.startswith("eos") and _id_set(d_ids[k]) <= _id_set(t_ids[k]):
            continue  # ends where the target does (a target's later-added end-of-generation ids: a GGUF's)
        if t_ids[k] != d_ids[k]:
            raise EngineBuildError(f"refusing to build engines: draft {k} {d_ids[k]} differs from the target's "
                                   f"{t_ids[k]}: use a draft made from this target (`spectrt draft`)")
    for role, path, cfg in (("target", target, t_cfg), ("draft", draft, d_cfg)):
        if cfg.head_dim % 2:
            raise EngineBuildError(f"{role} {path}: head_dim {cfg.head_dim} is odd; RoPE needs an even head_dim")
        limit = json.loads((path / "config.json").read_text()).get("max_position_embeddings")
        if limit and max_seq_len + max_tree_tokens > limit:
            raise EngineBuildError(
                f"{role} {path} supports {limit} positions, fewer than max_seq_len + max_tree_tokens = "
                f"{max_seq_len + max_tree_tokens}: lower --max-seq-len"
            )
    return t_cfg, d_cfg, head


def tool_versions(module: str | None = None) -> dict:
    versions = {"python": platform.python_version()}
    for name in ("torch", "onnx", "onnxruntime", "transformers"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:
            versions[name] = None
    try:
        trt = trt_module(module)
        versions["tensorrt_module"] = trt.__name__
        versions["tensorrt"] = trt.__version__
    except CompileError:
        versions["tensorrt_module"] = versions["tensorrt"] = None
    try:
        from importlib.metadata import version

        versions["spectrt"] = version("spectrt")
    except Exception:
        versions["spectrt"] = None
    return versions


def _copy_if_changed(src: Path, dst: Path) -> None:
    if dst.is_file() and dst.stat().st_size == src.stat().st_size and dst.read_bytes() == src.read_bytes():
        return
    shutil.copyfile(src, dst)


def _file_entry(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def _still_valid(root: Path, old_files: dict, rels: list[str]) -> bool:
    """Every file exists and matches its previously recorded checksum."""
    for rel in rels:
        want, p = old_files.get(rel), root / rel
        if want is None or not p.is_file() or p.stat().st_size != want["bytes"] or sha256_file(p) != want["sha256"]:
            return False
    return True


def _int8_checkpoint(target: Path, qformat: str) -> Path:
    """The target's INT8 checkpoint from `spectrt quantize` (what its Q/DQ graph is exported from)."""
    from spectrt.quant.quantize import QuantizeError, quantized_checkpoint

    try:
        return quantized_checkpoint(target, qformat)
    except QuantizeError as e:
        raise EngineBuildError(f"PRECISION=int8: {e}; or pass --int8-graph target=PATH (Q/DQ ONNX)") from e


def _check_int8_inputs(target: Path, int8_graphs: dict[str, Path] | None, qformat: str) -> None:
    given = int8_graphs or {}
    for role, path in given.items():
        if role not in ROLES or not Path(path).is_file():
            raise EngineBuildError(f"--int8-graph {role}={path}: expected target=PATH or draft=PATH to an existing "
                                   "Q/DQ tree-verify ONNX")
    if "target" not in given:
        _int8_checkpoint(target, qformat)  # fails before any export if the target was never quantized


def _int8_graph(role: str, checkpoint: Path, out: Path, given: dict[str, Path] | None, qformat: str,
                feature_layers: tuple[int, ...], log) -> Path | None:
    """The Q/DQ graph for INT8: a given file, else the target's INT8 checkpoint exported (the draft stays FP16)."""
    if given and role in given:
        log(f"  taking {given[role]} as the {role}'s INT8 graph")
        if role == "target" and feature_layers and FEATURES not in graph_io(Path(given[role]))["outputs"]:
            raise EngineBuildError(f"--int8-graph target={given[role]} has no `{FEATURES}` output, which the "
                                   f"EAGLE-3 draft reads (layers {list(feature_layers)}): export it with "
                                   "those feature layers, or leave --int8-graph out")
        try:
            return adopt_graph(Path(given[role]), out)
        except ValueError as e:
            raise EngineBuildError(str(e)) from e
    if role == "draft":
        return None
    from spectrt.quant.quantize import export_qdq_graph

    log(f"  exporting the {role}'s INT8 Q/DQ graph")
    return Path(export_qdq_graph(_int8_checkpoint(checkpoint, qformat), out, log=log, feature_layers=feature_layers))


def make_engines(target: Path, draft: Path, out: Path | None = None, precision: str = "fp16",
                 archs: list[str] | None = None, max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
                 max_tree_tokens: int = DEFAULT_MAX_TREE_TOKENS, plans: bool = True, module: str | None = None,
                 force: bool = False, int8_graphs: dict[str, Path] | None = None,
                 profiles: list[Profile] | None = None, qformat: str = "int8_sq",
                 max_batch: int = DEFAULT_MAX_BATCH, log: Callable[[str], None] = print) -> Path:
    """Build (or reuse) engines/<name>/ for a target/draft pair; returns the directory.

    precision int8: the target's plan is compiled from the Q/DQ graph of its `spectrt quantize --qformat`
    checkpoint (or a given --int8-graph); the draft's stays FP16."""
    target, draft = Path(target), Path(draft)
    if precision not in PRECISIONS:
        raise EngineBuildError(f"PRECISION={precision!r} is not supported: choose one of {', '.join(PRECISIONS)}")
    if max_tree_tokens < 1 or max_seq_len < 1 or max_batch < 1:
        raise EngineBuildError("max_seq_len, max_tree_tokens and max_batch must be positive")
    t_cfg, d_cfg, head = check_pair(target, draft, max_seq_len, max_tree_tokens)
    layers = tuple(head.feature_layers) if head else ()
    if precision == "int8":
        _check_int8_inputs(target, int8_graphs, qformat)
    out = Path(out) if out else DEFAULT_ENGINES / f"{target.name}-{precision}"
    capacity = max_seq_len + max_tree_tokens
    profiles = profiles or default_profiles(max_tree_tokens, capacity, max_batch)
    trt = None
    if plans:
        trt = trt_module(module)  # fails here, before any export, with what is needed
        archs = resolve_archs(trt, archs)
    out.mkdir(parents=True, exist_ok=True)
    old = {}
    manifest_path = out / MANIFEST
    if manifest_path.is_file() and not force:
        try:
            old = json.loads(manifest_path.read_text())
        except json.JSONDecodeError:
            old = {}
    if old.get("format") != MANIFEST_FORMAT:
        old = {}
    old_files = old.get("files", {})
    files: dict[str, dict] = {}
    models: dict[str, dict] = {}
    started = time.perf_counter()
    log(f"engines -> {out} (precision {precision}, max_seq_len {max_seq_len}, max_tree_tokens {max_tree_tokens}, "
        f"max_batch {max_batch})")

    for role, src, cfg in (("target", target, t_cfg), ("draft", draft, d_cfg)):
        role_dir = out / role
        role_dir.mkdir(exist_ok=True)
        log(f"[{role}] {src}")
        support = []
        for name in ("config.json", *TOKENIZER_FILES):
            if (src / name).is_file():
                _copy_if_changed(src / name, role_dir / name)
                support.append(f"{role}/{name}")
        src_sha = source_sha256(src)
        old_model = old.get("models", {}).get(role, {})
        entry = {"dir": role, "config": config_dict(cfg), "source": {"path": str(src.resolve()), "sha256": src_sha},
                 "graphs": {}, "plans": {}}
        is_head = role == "draft" and head is not None
        if role == "target" and layers:
            entry["feature_layers"] = list(layers)
        if role == "draft":
            entry["kind"] = "eagle3" if is_head else "llama"
        if is_head:  # which target id each logits column is: data beside the graph
            os.chmod(save_draft_vocab(src, role_dir / DRAFT_VOCAB), 0o644)
            support.append(f"{role}/{DRAFT_VOCAB}")

        # fp32 always (onnxruntime, parity); the plan's graph: fp16, or int8 where a Q/DQ graph exists for this
        # role (the target; a draft without one gets an FP16 plan in an INT8 build)
        has_int8 = precision == "int8" and (role in (int8_graphs or {}) or role == "target")
        graph_precisions = ["fp32"]
        if plans and (precision == "fp16" or (precision == "int8" and not has_int8)):
            graph_precisions.append("fp16")
        if has_int8:
            graph_precisions.append("int8")
        for gp in graph_precisions:
            rel = f"{role}/model.{gp}.onnx"
            rels = [rel, rel + ".data"]
            given = (int8_graphs or {}).get(role) if gp == "int8" else None
            given_sha = [sha256_file(f) for f in graph_files(Path(given))] if given else None
            if gp == "int8" and not given:  # exported from the INT8 checkpoint: rebuilt when it is re-quantized
                from spectrt.quant.quantize import QDQ_EXPORT_VERSION

                given_sha = [source_sha256(_int8_checkpoint(src, qformat)), QDQ_EXPORT_VERSION]
            # the head graph depends on the target too (its embedding): both sources are in its key
            key = (_key(src_sha, source_sha256(target), HEAD_EXPORT_VERSION, gp) if is_head
                   else _key(src_sha, EXPORT_VERSION, gp, given_sha, list(layers) if role == "target" else []))
            prev = old_model.get("graphs", {}).get(gp)
            reused = bool(prev and prev.get("key") == key and _still_valid(out, old_files, rels))
            if reused:
                log(f"  reusing {rel}")
            elif gp == "int8":
                if _int8_graph(role, src, out / rel, int8_graphs, qformat, layers, log) is None:
                    continue
            elif is_head:
                export_head_graph(src, target, out / rel, gp, log=log)
            else:
                export_graph(src, out / rel, gp, layers if role == "target" else (), log=log)
            for r in rels:
                if (out / r).is_file():
                    os.chmod(out / r, 0o644)
                    files[r] = old_files[r] if reused else _file_entry(out / r)
            entry["graphs"][gp] = {"file": rel, "data": rel + ".data", "io": graph_io(out / rel), "key": key}

        if plans:
            plan_graph = "int8" if precision == "int8" and "int8" in entry["graphs"] else (
                "fp32" if precision == "fp32" else "fp16")
            plan_precision = plan_graph
            graph_rel = entry["graphs"][plan_graph]["file"]
            rel = f"{role}/model.{plan_precision}.plan"
            key = _key(files[graph_rel]["sha256"], files[graph_rel + ".data"]["sha256"], trt.__name__,
                       trt.__version__, archs, [p.as_dict() for p in profiles], plan_precision)
            prev = old_model.get("plans", {}).get(plan_precision)
            if prev and prev.get("key") == key and _still_valid(out, old_files, [rel]):
                log(f"  reusing {rel}")
                entry["plans"][plan_precision] = prev
                files[rel] = old_files[rel]
            else:
                info = build_plan(out / graph_rel, out / rel, cfg, profiles, archs, plan_precision,
                                  timing_cache=out / "timing.cache", module=trt.__name__, log=log)
                entry["plans"][plan_precision] = {**info.as_dict(out), "graph": plan_graph, "key": key}
                files[rel] = _file_entry(out / rel)
        for r in support:
            files[r] = _file_entry(out / r)
        models[role] = entry

    from spectrt.runtime.decoding.tree import DEFAULT_TREE

    manifest = {
        "format": MANIFEST_FORMAT,
        "name": out.name,
        "precision": precision,
        "max_seq_len": max_seq_len,
        "max_tree_tokens": max_tree_tokens,
        "max_batch": max_batch,
        "capacity": capacity,
        "tree_defaults": {"tree": DEFAULT_TREE, "max_tree_tokens": max_tree_tokens},
        "profiles": [p.as_dict() for p in profiles],
        "archs": archs if plans else [],
        "tools": tool_versions(trt.__name__ if trt else module),
        "models": models,
        "files": dict(sorted(files.items())),
    }
    if old.get("created") and old.get("models") == json.loads(json.dumps(models)):  # as stored (tuples -> lists)
        manifest["created"] = old["created"]
    else:
        manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    tmp = manifest_path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(manifest_path)
    log(f"engines ready in {out} ({time.perf_counter() - started:.1f}s)")
    return out


def engine_sources(target: str | None, draft: str | None, artifacts: Path) -> tuple[Path, Path]:
    """The (target, draft) checkpoints `spectrt engines` compiles: a draft is required (by default the target's
    default draft, for the embedded target the shipped EAGLE-3 head)."""
    from spectrt.runtime.engines.checkpoint import resolve_models

    target_dir, draft_dir = resolve_models(target, draft, artifacts)
    if draft_dir is None:
        raise EngineBuildError("the engines need a draft model (--draft none has none): pass --draft DIR or build "
                               f"the default one with `spectrt draft --target {target_dir}`")
    return target_dir, draft_dir
