"""AR decode tok/s of the native forward per (ISA build, dtype): one warm process, greedy, 128 tokens, decode time
only, configurations interleaved prompt by prompt (bench/results/isa/README.md has the figures and the peer run).

    .venv/bin/python scripts/isa_ar_bench.py
"""
import os

import torch
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.engines.checkpoint import resolve_target
from spectrt.runtime.engines.kernels import runnable_isas
from spectrt.runtime.engines.model import Transformer
from transformers import AutoTokenizer

torch.set_num_threads(2)
target = resolve_target()
tok = AutoTokenizer.from_pretrained(target)
prompts = ["Explain how a hash map works.", "Write a haiku about autumn leaves.", "What causes the seasons on Earth?",
           "Give me three tips for writing clean code."]
ids = [list(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=True)["input_ids"]) for p in prompts]
decs = {}
for isa in [i for i in runnable_isas() if i != "portable"]:  # every vector build this CPU executes
    os.environ["SPECTRT_ISA"] = isa
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        e = Transformer.load(target, dt)
        assert e.native.isa == isa
        decs[isa, name] = Decoder(e, None, {2}, max_seq_len=512)
        decs[isa, name].generate(ids[0], 8)
rates = {k: [0, 0.0] for k in decs}
for _round in range(2):
    for p in ids:
        for k, d in decs.items():
            st = d.generate(p, 128).stats
            rates[k][0] += st.new_tokens - 1
            rates[k][1] += st.decode_seconds
for k, (n, s) in rates.items():
    print(k, f"{n / s:.1f} tok/s decode ({n} tokens)")
