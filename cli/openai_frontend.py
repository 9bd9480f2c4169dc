"""`python -m spectrt.cli.openai_frontend`: the OpenAI-compatible endpoint over a spectrt deployment's gRPC stream.

`spectrt serve --openai-port P` starts it next to tritonserver; alone it fronts any deployment:
`python -m spectrt.cli.openai_frontend --grpc-url HOST:8001 --tokenizer DIR --port 9000`.
What it serves and how: runtime/serving/openai_frontend.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spectrt.cli.openai_frontend", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--grpc-url", default="127.0.0.1:8001", help="Triton's gRPC endpoint")
    p.add_argument("--model", default="spectrt", help="the served model's name (Triton's, and the API's `model`)")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="the target's tokenizer dir (chat template); without it only /v1/completions works")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--timeout", type=float, default=600.0, help="deadline of one request, seconds (then 504)")
    p.add_argument("--drain-seconds", type=float, default=5.0,
                   help="at SIGTERM/SIGINT open answers get this long to finish; one still open then ends with a 503 "
                        "error (a stream: an error event and [DONE])")
    p.add_argument("--api-key", default=os.environ.get("SPECTRT_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every route but /health (default: $SPECTRT_API_KEY; "
                        "a flag's value is visible in the process list, the variable or --api-key-file is not)")
    p.add_argument("--api-key-file", type=Path, default=None, help="read the API key from this file")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated web origins (e.g. http://localhost:3000, or *) whose pages may call the API "
                        "from a browser (CORS); default none")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from spectrt.runtime.serving.openai_frontend import run

    api_key = args.api_key_file.read_text().strip() if args.api_key_file else args.api_key
    run(args.grpc_url, args.model, args.tokenizer, args.host, args.port, args.timeout, args.drain_seconds, api_key,
        tuple(args.allowed_origins.split(",")))
    sys.exit(0)


if __name__ == "__main__":
    main()
