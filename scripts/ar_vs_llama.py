"""AR decode of the native forward per (ISA build, dtype), and against llama.cpp on this machine, paired sample by
sample: each round decodes every prompt with each of our configurations (one warm process, greedy, decode time only)
and, with --llama-bench, runs `llama-bench` once per GGUF right after, so both engines see the same state of a host
whose memory bandwidth drifts by 30% within minutes. Prints tok/s per side and the ratio of summed decode times (the
figure issue 29's bar is about). Without --llama-bench it times our builds only (it replaced isa_ar_bench.py):

    .venv/bin/python scripts/ar_vs_llama.py --isas avx512,avx2 --dtypes bf16,fp32

    .venv/bin/python scripts/ar_vs_llama.py --llama-bench /tmp/llama/b-avx2/bin/llama-bench \\
        --gguf bf16=/tmp/llama/smol-bf16.gguf --gguf fp32=/tmp/llama/smol-f32.gguf --isas avx2

llama.cpp: the vendored source of llama-cpp-python 0.3.36 built with plain cmake (`-DGGML_NATIVE=OFF -DGGML_AVX2=ON
-DGGML_AVX512=OFF` for its AVX2 build), the GGUFs from its `convert_hf_to_gguf.py` (bench/results/isa/README.md).
"""
import argparse
import json
import os
import subprocess

import torch
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.engines.checkpoint import resolve_target
from spectrt.runtime.engines.model import Transformer
from transformers import AutoTokenizer

PROMPTS = ["Explain how a hash map works.", "Write a haiku about autumn leaves.", "What causes the seasons on Earth?",
           "Give me three tips for writing clean code."]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def llama_rate(bench: str, gguf: str, tokens: int) -> float:
    """One llama-bench generation run of `tokens` tokens (2 threads): its tok/s."""
    out = subprocess.run([bench, "-m", gguf, "-t", "2", "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--llama-bench", help="llama.cpp's llama-bench binary (omitted: our builds only)")
    p.add_argument("--gguf", action="append", default=[], help="DTYPE=PATH (bf16 or fp32), once per dtype")
    p.add_argument("--dtypes", default="bf16,fp32", help="without --gguf: the dtypes timed")
    p.add_argument("--isas", default="avx2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(2)
    ggufs = dict(g.split("=", 1) for g in args.gguf) if args.llama_bench else {}
    dtypes = list(ggufs) or args.dtypes.split(",")
    target = resolve_target()
    tok = AutoTokenizer.from_pretrained(target)
    ids = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]) for q in PROMPTS]
    decoders = {}
    for isa in args.isas.split(","):
        os.environ["SPECTRT_ISA"] = isa
        for dt in dtypes:
            engine = Transformer.load(target, DTYPES[dt])
            assert engine.native is not None and engine.native.isa == isa, isa
            decoders[isa, dt] = Decoder(engine, None, {-1}, max_seq_len=512)  # no stop token: always `tokens`
            decoders[isa, dt].generate(ids[0], 8)
    ours = {k: [0, 0.0] for k in decoders}
    theirs = {dt: [0, 0.0] for dt in ggufs}
    for _ in range(args.rounds):
        for prompt in ids:
            for key, dec in decoders.items():
                st = dec.generate(prompt, args.tokens).stats
                ours[key][0] += st.new_tokens - 1
                ours[key][1] += st.decode_seconds
            for dt, gguf in ggufs.items():
                rate = llama_rate(args.llama_bench, gguf, args.tokens)
                theirs[dt][0] += args.tokens
                theirs[dt][1] += args.tokens / rate
    for (isa, dt), (n, s) in ours.items():
        line = f"{isa} {dt}: spectrt {n / s:.1f} tok/s"
        if dt in theirs:
            n_l, s_l = theirs[dt]
            line += f", llama.cpp {n_l / s_l:.1f} tok/s: {(n / s) / (n_l / s_l):.2f}x"
        print(line)


if __name__ == "__main__":
    main()
