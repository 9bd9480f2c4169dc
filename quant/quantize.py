"""`spectrt quantize`: calibrate a target with ModelOpt and write an INT8 checkpoint (offline).

    target (HF dir) -> TreeVerifyModel (fused q/k/v and gate/up nn.Linear, build/export.py)
                    -> mtq.quantize(INT8 SmoothQuant W8A8 | INT8 weight-only), calibrated on the target's
                       own answers to a shipped prompt set
                    -> <target>-<qformat>/: quantized.safetensors + modelopt_state.pt + config.json

The quantized module is what every INT8 path derives from, so they agree by construction:
- the torch engine executes it in integers (runtime/engines/int8.py), the CPU path;
- `export_qdq_graph` restores it and traces it to a Q/DQ tree-verify ONNX (the same contract as the FP
  graphs), which `spectrt engines --precision int8` compiles into an INT8 TensorRT plan.

`quantized.safetensors` holds smoothed weights that are only correct together with their quantizers, so
the directory deliberately has no `model.safetensors`: a plain Hugging Face loader refuses it instead of
silently running wrong weights.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from spectrt.build.corpus import (
    DISTILL_PROMPTS,
    HELDOUT_PROMPTS,
    Conversation,
    generate_distill_data,
    read_prompts,
    target_fingerprint,
)
from spectrt.build.distill import DistillConfig
from spectrt.build.export import GRAPH_DTYPES, TreeVerifyModel, export_module, sequence_inputs
from spectrt.build.slice import TOKENIZER_FILES
from spectrt.quant.recipes import DEFAULT_QFORMAT, DEFAULT_SAMPLES, PROJECTIONS, get_recipe
from spectrt.runtime.decoding.bench import DEFAULT_PROMPTS as BENCH_PROMPTS
from spectrt.runtime.engines.int8 import QUANT_WEIGHTS, quant_format, quant_spec, quantize, scale_of
from spectrt.runtime.engines.model import ModelConfig

CALIBRATION_PROMPTS = DISTILL_PROMPTS  # the draft's training prompts: shipped, disjoint from every eval set
EVAL_PROMPTS = (HELDOUT_PROMPTS, BENCH_PROMPTS)
MAX_SAMPLE_TOKENS = 384
STATE_FILE = "modelopt_state.pt"
REPORT_FILE = "quant_report.json"
QDQ_EXPORT_VERSION = 4  # bump when export_qdq_graph's output changes: engines rebuild their INT8 graphs


def _modelopt():
    """(mtq, mto), imported quietly: ModelOpt warns about untested transformers versions and missing CUDA."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.opt as mto
        import modelopt.torch.quantization as mtq
    return mtq, mto


class QuantizeError(ValueError):
    """Input the quantizer cannot use; the message says how to fix it."""


def default_output(target: Path, qformat: str) -> Path:
    return Path(target).parent / f"{Path(target).name}-{qformat}"


def work_dir(target: Path) -> Path:
    """Cache of the target's answers (calibration and held-out), shared by every qformat of one target."""
    return Path(target).parent / f"{Path(target).name}-quant.work"


def modelopt_config(qformat: str) -> dict:
    """ModelOpt's config for the recipe `qformat` (quant/recipes.py): INT8 SmoothQuant at the recipe's alpha or INT8
    weight-only, our LM head (`head`) kept in high precision like `*lm_head*`, the recipe's kept projections too."""
    try:
        recipe = get_recipe(qformat)
    except ValueError as e:
        raise QuantizeError(str(e)) from None
    mtq = _modelopt()[0]
    config = copy.deepcopy(mtq.INT8_WEIGHT_ONLY_CFG if recipe.weights_only else mtq.INT8_SMOOTHQUANT_CFG)
    config["quant_cfg"].append({"quantizer_name": "head.*", "enable": False})
    if not recipe.weights_only:
        config["algorithm"] = {"method": "smoothquant", "alpha": recipe.alpha}
    config["quant_cfg"] += [{"quantizer_name": f"*{name}*", "enable": False} for name in recipe.keep]
    return config


def _user_text(conv: Conversation) -> str:
    return " ".join(conv[-1]["content"].split()).lower()


def check_disjoint(calibration: Sequence[Conversation], evaluations: dict[str, Sequence[Conversation]]) -> None:
    """Refuse calibration prompts that also appear in an evaluation set (it would flatter the gates)."""
    calib = {_user_text(c) for c in calibration}
    for name, convs in evaluations.items():
        shared = [c[-1]["content"] for c in convs if _user_text(c) in calib]
        if shared:
            raise QuantizeError(f"calibration prompts overlap the evaluation set {name}: {len(shared)} shared, e.g. "
                                f"{shared[0]!r}; remove them from the calibration file (--calib-prompts)")


def calibration_samples(target: Path, prompts: Sequence[Conversation], samples: int, progress: bool = True,
                        ) -> tuple[list[torch.Tensor], dict]:
    """Token ids of `samples` conversations with the target's own (sampled, T=0.7) answers, cached."""
    if samples < 1:
        raise QuantizeError(f"--calib-samples {samples}: need at least 1 calibration sample")
    if not prompts:
        raise QuantizeError("the calibration set is empty: pass --calib-prompts FILE with one prompt per line")
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0)).tolist()
    chosen = [prompts[i] for i in order[:samples]]
    records, stats = generate_distill_data(target, chosen, work_dir(target), DistillConfig(samples_per_prompt=1),
                                           progress=progress)
    return [r["input_ids"][-MAX_SAMPLE_TOKENS:].long() for r in records], stats


def forward_sequence(model: TreeVerifyModel, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a whole sequence through the tree-verify module (causal mask, empty cache)."""
    return model(*sequence_inputs(model.config, model.dtype, ids))[0]


def calibrate(model: TreeVerifyModel, qformat: str, samples: Sequence[torch.Tensor], progress: bool = True):
    """Quantize `model` in place with ModelOpt, calibrating on `samples` (token id tensors)."""
    from tqdm.auto import tqdm

    mtq, _ = _modelopt()
    def forward_loop(m) -> None:
        with torch.no_grad():
            for ids in tqdm(samples, desc=f"calibrate {qformat}", unit="sample", disable=not progress):
                forward_sequence(m, ids)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ModelOpt warns about missing CUDA extensions on CPU
        return mtq.quantize(model.eval(), modelopt_config(qformat), forward_loop)


def save_quantized(model: TreeVerifyModel, target: Path, out: Path, meta: dict) -> Path:
    """Write the quantized module's state (weights + quantizer buffers), its ModelOpt state and config."""
    from safetensors.torch import save_file

    _, mto = _modelopt()
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "inv_freq"}
    if model.config.tie_word_embeddings:
        state.pop("head.weight")  # the same tensor as embed.weight
    save_file(state, out / QUANT_WEIGHTS, metadata={"format": "pt"})
    os.chmod(out / QUANT_WEIGHTS, 0o644)  # safetensors writes 0600; servers may run as another user
    torch.save(mto.modelopt_state(model), out / STATE_FILE)
    config = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    config["spectrt_quant"] = meta
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(target) / name).is_file():
            shutil.copy(Path(target) / name, out / name)
    return out


def load_quantized_module(checkpoint: Path, dtype: torch.dtype = torch.float32, run_time: bool = False
                          ) -> TreeVerifyModel:
    """The fake-quantized tree-verify module of a quantized checkpoint (ModelOpt quantizers restored);
    `dtype` is that of its unquantized GEMMs and K/V (fp16 for TensorRT, see build/export.py).

    By default it is ModelOpt's calibrated module (static activation scales) with the recipe's `tensorrt_keep`
    projections unquantized: what the Q/DQ graph is traced from. `run_time=True` gives the numerics the CPU engines
    run instead (runtime/engines/int8.py, `_to_run_time_numerics`)."""
    from safetensors.torch import load_file

    _, mto = _modelopt()
    checkpoint = Path(checkpoint)
    if quant_format(checkpoint) is None:
        raise QuantizeError(f"{checkpoint} is not a quantized checkpoint: make one with `spectrt quantize`")
    model = TreeVerifyModel(ModelConfig.from_dir(checkpoint), None, dtype).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mto.restore_from_modelopt_state(model, torch.load(checkpoint / STATE_FILE, weights_only=False))
    missing, unexpected = model.load_state_dict(load_file(checkpoint / QUANT_WEIGHTS), strict=False)
    allowed = {"inv_freq"} | ({"head.weight"} if model.config.tie_word_embeddings else set())
    if set(missing) - allowed or unexpected:
        raise QuantizeError(f"{checkpoint}: {QUANT_WEIGHTS} does not match its ModelOpt state (missing "
                            f"{sorted(set(missing) - allowed)[:3]}, unexpected {unexpected[:3]}): "
                            "re-run spectrt quantize")
    for name, buf in model.named_buffers():  # the smoothing multiply runs in the GEMMs' dtype (fp16 graphs)
        if name.endswith("_pre_quant_scale"):
            buf.data = buf.data.to(dtype)
    if dtype == torch.float16:  # Q/DQ scales in fp16 too: fp32 ones would turn everything downstream into fp32
        for module in model.modules():
            if hasattr(module, "trt_high_precision_dtype"):
                module.trt_high_precision_dtype = "Half"
    spec = quant_spec(checkpoint)
    if run_time:
        _to_run_time_numerics(model, spec)
        return model
    for name, module in model.named_modules():  # fp16 in the plan; the smoothing multiply stays, exact
        if name.split(".")[-1] in spec.get("tensorrt_keep", []):
            module.input_quantizer.disable()
            module.weight_quantizer.disable()
    return model


def _to_run_time_numerics(model: TreeVerifyModel, spec: dict) -> None:
    """The recipe's run-time numerics (runtime/engines/int8.py) in the
    module: per-token input quantizers (ModelOpt's dynamic
    per-token INT8; with a `group`, a fake quantizer per (row, group) after the smoothing, and the weights fake
    quantized per (channel, group)) and the kept weights in `kept_dtype` values."""
    group = spec.get("group")
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] not in PROJECTIONS:  # the embeddings and the head have quantizers too (disabled)
                continue
            quantizer, weight_quantizer = module.input_quantizer, module.weight_quantizer
            if not weight_quantizer.is_enabled:  # a kept projection
                if spec.get("kept_dtype") == "bf16":
                    module.weight.copy_(module.weight.to(torch.bfloat16))
            elif group and quantizer.is_enabled:  # ModelOpt has no INT8 group quantizers: fake-quantize here
                module.weight.copy_(group_fake_quant(module.weight, group))
                weight_quantizer.disable()
                quantizer.disable()  # still applies pre_quant_scale; the hook quantizes what it returns
                quantizer.register_forward_hook(lambda _m, _inp, out, g=group: group_fake_quant(out, g))
            elif spec.get("activations") == "per_token" and quantizer.is_enabled:
                quantizer.reset_amax()  # an amax buffer would be used as a static one
                quantizer.set_from_attribute_config({"type": "dynamic", "block_sizes": {-1: None}})
        if spec.get("kept_dtype") == "bf16":  # untied: the embeddings stay exact, as in the engine
            model.head.weight = torch.nn.Parameter(model.head.weight.detach().to(torch.bfloat16).float())


def group_fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """x quantized to INT8 and back with one scale 127/max|x| per `group` consecutive values of its last dimension."""
    out = torch.empty_like(x)
    for k0 in range(0, x.shape[-1], group):
        part = x[..., k0:k0 + group].float()
        scale = scale_of(part.abs().amax(-1, keepdim=True))
        out[..., k0:k0 + group] = quantize(part, scale).float() / torch.where(scale == 0, torch.ones_like(scale), scale)
    return out


def quantized_checkpoint(target: Path, qformat: str = DEFAULT_QFORMAT) -> Path:
    """`target` itself if it is quantized, else its default INT8 checkpoint (which must exist)."""
    target = Path(target)
    if quant_format(target) is not None:
        return target
    candidate = default_output(target, qformat)
    if not (candidate / QUANT_WEIGHTS).is_file():
        raise QuantizeError(f"{target} has no INT8 checkpoint ({candidate}): run `spectrt quantize --target {target}` "
                            "(make quantize) first")
    return candidate


def export_qdq_graph(checkpoint: Path, out: Path, precision: str = "fp16", log: Callable[[str], None] = print,
                     feature_layers: Sequence[int] = ()) -> Path:
    """Trace a quantized checkpoint to a Q/DQ tree-verify ONNX: every quantized projection becomes
    QuantizeLinear/DequantizeLinear pairs on its input and weight (TensorRT fuses them into INT8 GEMMs).

    TensorRT's INT8 Q/DQ scales are build-time constants (its dynamic quantization is FP8/FP4 only), so the graph
    carries the calibrated static per-tensor activation scales and ModelOpt's per-channel weight scales even for a
    recipe whose CPU engine runs per-token or per-group scales, and leaves the recipe's `tensorrt_keep` projections
    unquantized (where static scales lose too much): the plan computes what the static recipe computes.

    `precision` is that of everything left unquantized: fp16 for TensorRT plans (an fp32 remainder made the
    INT8 plan larger than the FP16 one: 316 vs 289 MB), fp32 for ONNX Runtime parity checks. `feature_layers`: an
    EAGLE-3 head's, returned as the `features` output (build/export.py)."""
    checkpoint = quantized_checkpoint(checkpoint)
    if precision not in GRAPH_DTYPES:
        raise QuantizeError(f"Q/DQ graph precision {precision!r}: choose one of {sorted(GRAPH_DTYPES)}")
    start = time.perf_counter()
    model = load_quantized_module(checkpoint, GRAPH_DTYPES[precision])
    model.feature_layers = tuple(int(j) for j in feature_layers)  # outputs only: no weight or quantizer changes
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weights = quantized_weights(model)
        export_module(model, model.config, Path(out), GRAPH_DTYPES[precision],
                      transform=lambda proto: fold_weight_quantizers(proto, weights))
    log(f"  exported {Path(out).name} (Q/DQ {quant_format(checkpoint)}, rest {precision}) in "
        f"{time.perf_counter() - start:.1f}s")
    return Path(out)


def _weight_key(array) -> str:
    return hashlib.sha1(array.tobytes()).hexdigest() + str(array.shape) + str(array.dtype)


def quantized_weights(model: TreeVerifyModel) -> dict[str, torch.Tensor]:
    """int8 weights of every quantized projection, by content key, computed with ModelOpt's arithmetic
    (round(w * 127/amax), the same as the fake quantizer and the torch engine)."""
    out = {}
    for module in model.modules():
        quantizer = getattr(module, "weight_quantizer", None)
        if quantizer is not None and quantizer.is_enabled:
            out[_weight_key(module.weight.detach().numpy())] = quantize(module.weight.detach().float(),
                                                                        scale_of(quantizer.amax))
    return out


def fold_weight_quantizers(proto, weights: dict[str, torch.Tensor]) -> int:
    """Replace each weight's QuantizeLinear by an int8 initializer (from `weights`) feeding its DequantizeLinear.

    The exporter writes fp weights -> Q -> DQ. With the int8 values computed once by ModelOpt's arithmetic
    (not QuantizeLinear's w / scale, which rounds a few weights differently), the graph carries exactly the
    weights the torch engine runs, in half the size, and TensorRT keeps them int8 in the plan.
    Returns the number of weights folded.
    """
    from onnx import numpy_helper

    graph = proto.graph
    inits = {i.name: i for i in graph.initializer}
    uses: dict[str, int] = {}
    for n in graph.node:
        for name in n.input:
            uses[name] = uses.get(name, 0) + 1
    folded = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] not in inits:
            continue
        key = _weight_key(numpy_helper.to_array(inits[node.input[0]]))
        if key not in weights:
            raise QuantizeError(f"exported weight {node.input[0]} matches no quantized projection: re-run the export")
        graph.initializer.append(numpy_helper.from_array(weights[key].numpy(), node.output[0]))
        folded.append(node)
        if uses[node.input[0]] == 1:
            graph.initializer.remove(inits[node.input[0]])
    for node in folded:
        graph.node.remove(node)
    return len(folded)


def _calibration_key(target: Path, qformat: str, prompts: Path, samples: int) -> dict:
    return {**get_recipe(qformat).meta(), "target": str(target), "target_fingerprint": target_fingerprint(target),
            "calibration_prompts": str(prompts), "calibration_samples": samples,
            "calibration_sha1": hashlib.sha1(Path(prompts).read_bytes()).hexdigest()}


def quantize_target(target: Path, out: Path | None = None, qformat: str = DEFAULT_QFORMAT,
                    calib_prompts: Path = CALIBRATION_PROMPTS, samples: int = DEFAULT_SAMPLES,
                    eval_prompts: Sequence[Path] = EVAL_PROMPTS, force: bool = False, progress: bool = True,
                    log: Callable[[str], None] = print, records: list[dict] | None = None) -> Path:
    """Calibrate + quantize `target` into `out` (reused when target, recipe and calibration are unchanged); the
    accuracy gates run on `records` (default: the held-out answers)."""
    from spectrt.quant.accuracy import accuracy_report

    target = Path(target)
    modelopt_config(qformat)  # refuses an unknown qformat before any work
    calibration = read_prompts(calib_prompts) if Path(calib_prompts).is_file() and Path(calib_prompts).read_text(
        encoding="utf-8").strip() else []
    if not calibration:
        raise QuantizeError(f"the calibration set {calib_prompts} is empty or missing: pass --calib-prompts FILE with "
                            "one prompt per line (default: build/prompts/distill.txt)")
    check_disjoint(calibration, {str(p): read_prompts(p) for p in eval_prompts})
    out = Path(out) if out else default_output(target, qformat)
    key = _calibration_key(target, qformat, calib_prompts, samples)
    if not force and (out / QUANT_WEIGHTS).is_file() and (out / REPORT_FILE).is_file():
        meta = json.loads((out / "config.json").read_text()).get("spectrt_quant", {})
        if all(meta.get(k) == v for k, v in key.items()):
            log(f"{out}: up to date ({qformat}, {samples} calibration samples); --force re-quantizes")
            return out
    start = time.perf_counter()
    data, stats = calibration_samples(target, calibration, samples, progress)
    model = calibrate(TreeVerifyModel.load(target), qformat, data, progress)
    meta = {**key, "calibration_tokens": int(sum(len(d) for d in data)),
            "modelopt_version": _modelopt_version(), "seconds": round(time.perf_counter() - start, 1)}
    save_quantized(model, target, out, meta)
    log(f"wrote {out} ({qformat}) in {meta['seconds']} s from {len(data)} samples, {meta['calibration_tokens']} tokens")
    report = accuracy_report(target, out, progress=progress, log=log, records=records)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2))
    return out


def _modelopt_version() -> str:
    import modelopt

    return modelopt.__version__

