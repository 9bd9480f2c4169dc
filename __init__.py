"""spectrt: tree-based speculative decoding, deployable on NVIDIA TensorRT and Triton."""
