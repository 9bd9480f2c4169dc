"""Forwards: everything that turns token ids, positions and a tree mask into logits, behind one `Engine` contract
(engine.py), on the torch reference, the native CPU kernels, ONNX Runtime or TensorRT.

Owns model weights, KV caches and kernels, and where models are (checkpoint.py: the one resolver of a target and
its draft; onnx_engine.py: an engines folder's manifest). Imports nothing from `decoding` or `serving`, and nothing
of the runtime imports the offline packages (build/, quant/) or the CLI.
"""
