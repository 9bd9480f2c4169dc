"""One table from a genai-perf concurrency sweep (`make perf`): <dir>/c<N>/*/profile_export_genai_perf.json.

Prints markdown (concurrency, output tok/s, its ratio to the lowest concurrency's, requests/s, TTFT p50/p99,
inter-token latency p50) and writes it next to the runs as summary.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(sweep: Path) -> list[dict]:
    out = []
    for run in sweep.glob("c*/*/profile_export_genai_perf.json"):
        data = json.loads(run.read_text(encoding="utf-8"))
        out.append({"concurrency": int(run.parent.parent.name[1:]),
                    "tok_s": data["output_token_throughput"]["avg"],
                    "req_s": data["request_throughput"]["avg"],
                    "ttft_p50": data["time_to_first_token"]["p50"], "ttft_p99": data["time_to_first_token"]["p99"],
                    "itl_p50": data["inter_token_latency"]["p50"],
                    "osl": data["output_sequence_length"]["avg"], "requests": data["request_count"]["avg"]})
    return sorted(out, key=lambda r: r["concurrency"])


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print("usage: perf_table.py <genai-perf sweep dir with c<N>/ runs>", file=sys.stderr)
        return 2
    sweep = Path(argv[0])
    table = rows(sweep)
    if not table:
        print(f"no profile_export_genai_perf.json under {sweep}/c*/: run `make perf` first", file=sys.stderr)
        return 1
    base = table[0]["tok_s"]
    lines = ["| concurrency | output tok/s | × lowest | requests/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
             "output tokens | requests |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r['concurrency']} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f} | {r['req_s']:.3f} | "
                     f"{r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['itl_p50']:.1f} | {r['osl']:.0f} | "
                     f"{r['requests']:.0f} |")
    text = "\n".join(lines) + "\n"
    (sweep / "summary.md").write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
