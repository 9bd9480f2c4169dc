"""Forwards: everything that turns token ids, positions and a tree mask into logits, behind one `Engine` contract
(engine.py), on the torch reference, the native CPU kernels, ONNX Runtime or TensorRT.

Owns model weights, KV caches and kernels. Imports nothing from `decoding` or `serving`.
"""
