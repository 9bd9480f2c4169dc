"""INT8 recipes: how a target is calibrated (ModelOpt) and how its engines run the result; pure data.

Every recipe is calibrated by ModelOpt on the same samples and judged on the same held-out positions
(quant/accuracy.py); `spectrt quantize --search` measures them all (bench/results/compare/recipes.md) and
`choose_recipe` picks the default: the fastest verify step among those that clear the accuracy gate (with a
margin). A recipe that misses the gate is reported as failed and is never chosen.

Run-time fields live in the checkpoint's config.json (`spectrt_quant`), so the engines need no recipe table:
- `activations`: "static" quantizes a W8A8 projection's input with one calibrated scale per tensor (ModelOpt's
  SmoothQuant, and what a TensorRT Q/DQ plan runs); "per_token" with each row's own scale 127 / max|x_row|,
  computed at run time (still row invariant: a row's scale depends only on that row). TensorRT cannot express
  the latter for INT8 (Q/DQ scales are build-time constants; its dynamic quantization is FP8/FP4 only), so the
  Q/DQ graph of a per-token checkpoint carries the calibrated static scales of the same calibration.
- `group`: input channels per scale group. Each row's activations get one scale per group and each output
  channel's weights one per group (computed at load from the smoothed weights), so an outlier channel coarsens
  only its group; integer sums per group, fp32 across groups, still row invariant.
- `kept_dtype`: the weights of the projections the recipe leaves unquantized and of the LM head, "fp32" or
  "bf16" (half the bytes; bf16 -> fp32 is exact, so the native forward stays row invariant).
- `tensorrt_keep`: projections the Q/DQ graph leaves unquantized although the CPU engine quantizes them: with
  static per-tensor scales (all TensorRT can express for INT8) they lose too much (the down-projection's input,
  silu(gate) * up, carries the outlier channels).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from spectrt.runtime.engines.int8 import PROJECTIONS  # the engine's projections (fused as build/export.py fuses them)

DEFAULT_SAMPLES = 64  # calibration conversations (here, not in quantize.py: the CLI's parser shows it, light)
ACTIVATIONS = ("static", "per_token")
KEPT_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class Recipe:
    name: str
    weights_only: bool = False  # INT8 weight-only (ModelOpt INT8_WEIGHT_ONLY_CFG), else SmoothQuant W8A8
    alpha: float = 0.8  # SmoothQuant migration strength (W8A8)
    activations: str = "static"
    group: int | None = None  # input channels per scale group (weights and per-token activations); None: whole rows
    keep: tuple[str, ...] = ()  # projections left unquantized
    kept_dtype: str = "fp32"
    tensorrt_keep: tuple[str, ...] = ()  # also unquantized in the Q/DQ graph (static scales lose too much there)
    summary: str = ""

    def __post_init__(self) -> None:
        if self.activations not in ACTIVATIONS or self.kept_dtype not in KEPT_DTYPES:
            raise ValueError(f"recipe {self.name}: activations must be one of {ACTIVATIONS} and kept_dtype one of "
                             f"{KEPT_DTYPES}, got {self.activations!r} / {self.kept_dtype!r}")
        if self.weights_only and self.kept_dtype != "fp32":  # dequantized weights are not bf16 values
            raise ValueError(f"recipe {self.name}: a weight-only recipe keeps fp32 (its dequantized weights)")
        if self.group is not None and (self.group % 4 or self.activations != "per_token" or self.weights_only):
            raise ValueError(f"recipe {self.name}: scale groups need W8A8 per-token activations and a multiple of 4 "
                             f"input channels, got group {self.group}")
        if set(self.keep + self.tensorrt_keep) - set(PROJECTIONS):
            raise ValueError(f"recipe {self.name}: keep {self.keep} names no projection of {PROJECTIONS}")

    def meta(self) -> dict:
        """What config.json's `spectrt_quant` records of the recipe (the engines read the run-time fields)."""
        fields = {k: v for k, v in asdict(self).items() if k not in ("name", "summary")}
        return {"qformat": self.name, **fields, "keep": list(self.keep),  # lists, as JSON reads them back
                "tensorrt_keep": list(self.tensorrt_keep)}


SQ = {"alpha": 0.8, "activations": "per_token", "kept_dtype": "bf16", "tensorrt_keep": ("w2",)}
RECIPES = {r.name: r for r in (
    Recipe("int8_sq", group=32, **SQ, summary="SmoothQuant W8A8 (alpha 0.8), all projections INT8, per-token "
           "activation and per-channel weight scales per group of 32 input channels, LM head bf16"),
    Recipe("int8_sq_g64", group=64, **SQ, summary="as int8_sq with groups of 64"),
    Recipe("int8_sq_g16", group=16, **SQ, summary="as int8_sq with groups of 16"),
    Recipe("int8_sq_token", activations="per_token", keep=("w2",),
           summary="SmoothQuant W8A8 (alpha 0.8), per-token activation scales over whole rows, down-projection fp32"),
    Recipe("int8_sq_static", keep=("w2",), summary="SmoothQuant W8A8 (alpha 0.8), static per-tensor activation "
           "scales, down-projection fp32: ModelOpt's recipe, and what the TensorRT INT8 plan computes"),
    Recipe("int8_wo", weights_only=True, summary="INT8 weight-only, per-channel"),
)}
DEFAULT_QFORMAT = "int8_sq"
# The default must clear the gate by this much: two recipes differing only by bf16 rounding of the LM head and the
# down-projection (mean KL 0.00448 vs 0.00462) measured 0.9707 vs 0.9660 top-1 on the same positions; near-ties
# flip, so a recipe within the margin of the gate can miss it on other prompts.
GATE_MARGIN = 0.005


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"--qformat {name!r} is not supported: choose one of {sorted(RECIPES)} "
                         "(int8_sq = the default SmoothQuant W8A8 recipe, int8_wo = INT8 weight-only)")
    return RECIPES[name]


def choose_recipe(rows: list[dict], gate: float) -> str | None:
    """The recipe to make the default: among rows whose `top1_agreement` clears `gate` by GATE_MARGIN, the one with
    the fastest one-token verify step (`verify_ms` at T=1, then T=8). None when none does."""
    passing = [r for r in rows if r["top1_agreement"] >= gate + GATE_MARGIN]
    if not passing:
        return None
    return min(passing, key=lambda r: (r["verify_ms"]["1"], r["verify_ms"].get("8", 0.0)))["name"]
