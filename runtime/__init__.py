"""Online: the rooms of the runtime, one job each, imported one way only (serving -> decoding -> engines).

- `engines`: forwards. One `Engine` contract (engine.py) and its implementations: the torch reference and the
  native CPU forward (model.py, kernels.py over cpu_kernels.cpp/simd.h), INT8 weights (int8.py), ONNX Runtime and
  TensorRT graphs (onnx_engine.py, trt_engine.py, batch_inputs.py), the EAGLE-3 head (eagle3.py); model families
  as data (families.py).
- `decoding`: the one decode loop (decoder.py) and what it decides with: proposers (propose.py, suffix.py), the
  speculation policy and budget (policy.py), token trees and greedy acceptance (tree.py), sampling and lossless
  verification (sampling.py), the prefix cache (prefix.py), stops and incremental text (text.py); the library front
  door (pipeline.py) and the offline measurements that tune it (profile.py, tune.py, bench.py).
- `serving`: requests from the outside: one validator (requests.py), the scheduler thread that owns the batch
  (scheduler.py), the Triton launcher and its supervisor (serve.py, supervise.py), the OpenAI endpoint
  (openai_api.py rules, openai_frontend.py server), the gRPC/HTTP client (client.py).

`resources.py` (files shipped inside the package) is below all three.
"""
