"""Structured outputs under speculation vs constrained AR, in one warm process (runtime/decoding/grammar.py).

Each prompt asks for a JSON object a schema describes; per prompt, interleaved, the same pipeline decodes it
constrained without speculation (`tree` None), constrained with the default policy, and unconstrained with the default
policy (what the constraint costs speculation). Decode time only; greedy outputs of the two constrained runs must be
equal. Writes bench/results/<cpu class>/structured_<dtype>.json and prints a table.

    .venv/bin/python scripts/structured_bench.py [--dtype auto] [--tokens 96] [--rounds 2] [--served]

`--served`: the same through `spectrt serve`'s OpenAI endpoint (the SDK, `response_format` json_schema, the `tree`
extension "none" for AR), streamed: decode time from the first content chunk to the last, tokens from usage;
structured_served_<dtype>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SCHEMAS = {
    "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                "city": {"type": "string"}},
               "required": ["name", "age", "city"], "additionalProperties": False},
    "product": {"type": "object", "properties": {"title": {"type": "string"}, "price": {"type": "number"},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["title", "price", "tags"], "additionalProperties": False},
    "event": {"type": "object", "properties": {"event": {"type": "string"}, "date": {"type": "string"},
                                               "attendees": {"type": "integer"}},
              "required": ["event", "date", "attendees"], "additionalProperties": False},
}
PROMPTS = [  # (schema, prompt): extraction requests nobody tuned on
    ("person", "Extract the person as JSON: Maria Lopez, 42, moved to Lisbon last spring."),
    ("person", "Return JSON for this customer: Ken Sato is 29 and lives in Osaka."),
    ("product", "Describe this listing as JSON: a blue ceramic mug, $12.50, handmade, dishwasher safe."),
    ("product", "Give the product as JSON: noise-cancelling headphones for 199 dollars, wireless, black."),
    ("event", "Turn this into JSON: the annual science fair on 2027-03-14 with about 300 visitors."),
    ("event", "As JSON: team offsite, June 3rd 2027, twelve people attending."),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "bench" / "results")
    p.add_argument("--served", action="store_true", help="through spectrt serve's OpenAI endpoint")
    args = p.parse_args()
    if args.served:
        return served(args)
    from spectrt.runtime.decoding.bench import machine_record, results_dir
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.engines.checkpoint import default_draft, resolve_target
    from spectrt.runtime.engines.engine import resolve_dtype

    target = resolve_target()
    dtype = resolve_dtype(args.dtype, "torch", target)
    pipe = Pipeline(target, default_draft(target), dtype=dtype, max_seq_len=1024, prefix_cache=False)
    configs = {"constrained AR": (None, True), "constrained, default policy": ("auto", True),
               "unconstrained, default policy": ("auto", False)}
    totals = {name: [0, 0.0] for name in configs}
    forced = {name: 0 for name in configs}  # tokens the grammar forced (verified for free)
    equal = 0
    worst = float("inf")
    pipe.generate(PROMPTS[0][1], 8, None, structured_output=json.dumps({"type": "json_object"}))  # warm-up
    for r in range(args.rounds):
        for schema, prompt in PROMPTS:
            spec = json.dumps({"type": "json_schema", "schema": SCHEMAS[schema]})
            outs = {}
            names = list(configs) if r % 2 == 0 else list(configs)[::-1]  # alternate which runs first
            for name in names:
                tree, constrained = configs[name]
                state = pipe.grammar(spec) if constrained else None
                g = pipe.generate(prompt, args.tokens, tree, structured_output=state)
                forced[name] += state.forced if state is not None else 0
                outs[name] = (g.token_ids, g.stats.decode_seconds)
                totals[name][0] += g.stats.new_tokens
                totals[name][1] += g.stats.decode_seconds
            equal += outs["constrained AR"][0] == outs["constrained, default policy"][0]
            ar, spec_run = outs["constrained AR"], outs["constrained, default policy"]
            worst = min(worst, (len(spec_run[0]) / spec_run[1]) / (len(ar[0]) / ar[1]))
    rate = {name: t / s for name, (t, s) in totals.items()}
    rows = [{"config": name, "tokens_per_second": round(rate[name], 1),
             "vs_constrained_ar": round(rate[name] / rate["constrained AR"], 2),
             "forced_share": round(forced[name] / totals[name][0], 3)} for name in configs]
    report = {"dtype": dtype, "prompts": len(PROMPTS), "rounds": args.rounds, "max_new_tokens": args.tokens,
              "outputs_equal": f"{equal}/{len(PROMPTS) * args.rounds}", "worst_prompt": round(worst, 2),
              **machine_record(), "results": rows}
    out = results_dir(args.out) / f"structured_{dtype}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"| config | {dtype} tok/s | vs constrained AR | forced tokens |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['tokens_per_second']} | {row['vs_constrained_ar']:.2f}× | "
              f"{row['forced_share']:.1%} |")
    print(f"constrained outputs equal: {report['outputs_equal']}; worst prompt {report['worst_prompt']}×; -> {out}")


def served(args: argparse.Namespace) -> None:
    """The benchmark through a real server: one tritonserver + the OpenAI frontend, requests one at a time."""
    import time

    import openai
    from spectrt.runtime.decoding.bench import machine_record, results_dir
    from spectrt.runtime.engines.checkpoint import default_draft, resolve_target
    from spectrt.runtime.engines.engine import resolve_dtype
    from spectrt.runtime.serving.serve import TritonServer

    target = resolve_target()
    dtype = resolve_dtype(args.dtype, "torch", target)
    params = {"target_dir": target, "draft_dir": default_draft(target), "dtype": dtype, "max_seq_len": 1024,
              "prefix_cache": "false"}
    configs = {"constrained AR": ("none", True), "constrained, default policy": (None, True),
               "unconstrained, default policy": (None, False)}
    totals = {name: [0, 0.0] for name in configs}
    equal, worst = 0, float("inf")
    with TritonServer(params, instances=1, openai_port=0, ready_timeout=600) as server:
        client = openai.OpenAI(base_url=server.openai_url, api_key="unused", timeout=600)

        def run(prompt: str, tree: str | None, schema: dict | None) -> tuple[str, int, float]:
            extra = {"tree": tree} if tree else {}
            fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}} \
                if schema else {}
            first = last = None
            text, tokens = "", 0
            for chunk in client.chat.completions.create(
                    model=server.served_name, messages=[{"role": "user", "content": prompt}], max_tokens=args.tokens,
                    stream=True, stream_options={"include_usage": True}, extra_body=extra, **fmt):
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if choice.delta.content:
                        last = time.perf_counter()
                        first = first or last
                        text += choice.delta.content
            return text, tokens, (last - first) if first is not None else 0.0

        run(PROMPTS[0][1], None, SCHEMAS[PROMPTS[0][0]])  # warm-up
        for r in range(args.rounds):
            for schema, prompt in PROMPTS:
                outs = {}
                for name in (list(configs) if r % 2 == 0 else list(configs)[::-1]):
                    tree, constrained = configs[name]
                    text, tokens, seconds = run(prompt, tree, SCHEMAS[schema] if constrained else None)
                    outs[name] = (text, tokens - 1, seconds)  # decode: the tokens after the first one
                    totals[name][0] += tokens - 1
                    totals[name][1] += seconds
                ar, spec = outs["constrained AR"], outs["constrained, default policy"]
                equal += ar[0] == spec[0]
                worst = min(worst, (spec[1] / spec[2]) / (ar[1] / ar[2]))
    rate = {name: t / s for name, (t, s) in totals.items()}
    rows = [{"config": name, "tokens_per_second": round(rate[name], 1),
             "vs_constrained_ar": round(rate[name] / rate["constrained AR"], 2)} for name in configs]
    report = {"dtype": dtype, "served": "spectrt serve, OpenAI endpoint, streamed, one request at a time",
              "prompts": len(PROMPTS), "rounds": args.rounds, "max_new_tokens": args.tokens,
              "outputs_equal": f"{equal}/{len(PROMPTS) * args.rounds}", "worst_prompt": round(worst, 2),
              **machine_record(), "results": rows}
    out = results_dir(args.out) / f"structured_served_{dtype}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"| config (served) | {dtype} tok/s | vs constrained AR |\n|---|---|---|")
    for row in rows:
        print(f"| {row['config']} | {row['tokens_per_second']} | {row['vs_constrained_ar']:.2f}× |")
    print(f"constrained outputs equal: {report['outputs_equal']}; worst prompt {report['worst_prompt']}×; -> {out}")


if __name__ == "__main__":
    main()
