#!/usr/bin/env bash
# Prepared device check for a machine with an NVIDIA GPU (not run in CI: CI has no GPU).
#
#   bash scripts/gpu_check.sh [OUT_JSON] [extra args for scripts/gpu_check.py]
#
# Builds (or loads, --engines DIR) TensorRT plans for the embedded pair, runs greedy tree decoding with the
# `tensorrt` backend, asserts the FP32 plan's output equals the torch backend's, checks one batched plan execution
# (prompt chunk, chain, tree, single token, draft level) against ONNX Runtime on the same batched graph, and prints
# verify cost vs T (1..64) and tokens/s, also of the batched decode loop at batch 1 and 8; all results go to
# OUT_JSON (default: $OUT/gpu_check.json, else ./gpu_check.json).
# Without a TensorRT module (e.g. a GPU machine with no registry access: the TensorRT-RTX wheel is 89 MB) it
# says so in the JSON and measures the torch engine on CUDA; without the checkpoint (artifacts/ is not
# shipped) it uses random weights of SmolLM2-135M's real shapes and says so. Finishes in < 8 minutes
# (the helper stops starting new parts after --budget-s, default 420 s; a hard timeout at 470 s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_JSON=${1:-${OUT:-.}/gpu_check.json}
shift || true

# a python whose torch sees a GPU: $PYTHON, else the project's venv, else python3
PY=""
for cand in ${PYTHON:-} .venv/bin/python python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY=$cand; break
    fi
done
if [ -z "$PY" ]; then
    echo "gpu_check: no python with a CUDA-enabled torch that sees a GPU (tried \$PYTHON, .venv/bin/python, python3)" >&2
    mkdir -p "$(dirname "$OUT_JSON")"
    printf '{"status": "no_gpu", "reason": "no python with a CUDA-enabled torch that sees an NVIDIA GPU"}\n' >"$OUT_JSON"
    exit 2
fi

# `import spectrt` without installing: the repository root is the package
if ! "$PY" -c "import spectrt.runtime.engines.model" 2>/dev/null; then
    PKG=$(mktemp -d)
    ln -s "$(pwd)" "$PKG/spectrt"
    export PYTHONPATH="$PKG${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
echo "gpu_check: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)'))"
timeout 470 "$PY" scripts/gpu_check.py --out "$OUT_JSON" "$@"
rc=$?
if [ $rc -eq 124 ]; then
    echo "gpu_check: timed out after 470 s (partial results, if any, are in the log above)" >&2
fi
[ -f "$OUT_JSON" ] && "$PY" - "$OUT_JSON" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"gpu_check: status {r.get('status')} in {r.get('seconds')}s; weights: {r.get('weights')}")
trt = r.get("tensorrt", {})
print(f"gpu_check: tensorrt: {'available ' + trt.get('module', '') if trt.get('available') else trt.get('reason')}")
for engine, parts in (("torch", r.get("torch", {})), ("tensorrt", {k: v for k, v in trt.items() if isinstance(v, dict)})):
    for precision, res in parts.items():
        print(f"  {engine} {precision} verify ms vs T: {res.get('verify_ms')}")
        for name, v in res.items():
            if isinstance(v, dict) and "tokens_per_s" in v:
                print(f"  {engine} {precision} {name}: {v}")
        for tree, b in res.get("batched_decoding", {}).items():
            print(f"  {engine} {precision} batched decoding ({tree}): batch 1 {b['batch 1']['tokens_per_s']} tok/s, "
                  f"batch 8 {b['batch 8']['tokens_per_s']} tok/s ({b.get('speedup')}x)")
        for role, v in res.get("batched_verification_vs_onnxruntime", {}).items():
            print(f"  {engine} {precision} batched verification vs onnxruntime ({role}): {v}")
for c in r.get("checks", []):
    if not c["ok"]:
        print(f"  FAIL {c['name']} {c['detail']}")
PY
exit $rc
