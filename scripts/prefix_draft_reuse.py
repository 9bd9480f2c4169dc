"""Does reusing the draft's rows of a cached prefix pay, or should the draft re-read the history? (README, prefix cache)

One 7-turn conversation (bench/prompts_multiturn.txt) through a one-slot decoder with the prefix cache, the draft
either keeping its rows of the prefix (`DraftProposer.reuse`, what ships) or starting empty and catching up a window
per step (the target still reuses its rows). Each mode runs twice, alternating; the best of two per turn is kept.

    flock /tmp/spectrt.lock .venv/bin/python scripts/prefix_draft_reuse.py DRAFT_DIR
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from spectrt.runtime.decoding.bench import read_conversations
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.decoding.pipeline import Pipeline
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.propose import DraftProposer
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.checkpoint import resolve_target

SHIPPED = DraftProposer.reuse


def reread(self, src: int, dst: int, length: int) -> int:
    SHIPPED(self, src, dst, 0)
    return length


def conversation(pipe: Pipeline, tree, policy) -> list[tuple[float, float, int]]:
    """(TTFT s, turn s, draft passes) per turn of the first conversation."""
    decoder = Decoder(pipe.decoder.target, pipe.decoder.draft, pipe.decoder.eos_ids, max_seq_len=2048,
                      policy=policy or pipe.policy)
    messages, rows = [], []
    for turn in read_conversations(None)[0]:
        messages.append({"role": "user", "content": turn})
        ids = pipe.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=True)["input_ids"]
        first: list[float] = []
        start = time.perf_counter()
        result = decoder.generate(list(ids), 128, tree, on_tokens=lambda _, seen=first: seen or seen.append(
            time.perf_counter()), policy=policy)
        rows.append((first[0] - start, time.perf_counter() - start, result.stats.draft_passes))
        messages.append({"role": "assistant", "content": pipe.tokenizer.decode(result.token_ids,
                                                                               skip_special_tokens=True)})
    return rows


def main() -> None:
    pipe = Pipeline(resolve_target(), Path(sys.argv[1]), max_seq_len=2048)
    for name, tree, policy in (("tree 2,1", Tree.parse("2,1"), None), ("auto", None, Policy())):
        runs: dict[str, list] = {"reuse": [], "reread": []}
        for mode in ("reuse", "reread", "reuse", "reread"):
            DraftProposer.reuse = SHIPPED if mode == "reuse" else reread
            runs[mode].append(conversation(pipe, tree, policy))
        DraftProposer.reuse = SHIPPED
        for mode, (a, b) in runs.items():
            ttft = [round(1000 * min(x[0], y[0]), 1) for x, y in zip(a, b, strict=True)]
            total = sum(min(x[1], y[1]) for x, y in zip(a, b, strict=True))
            print(f"{name} {mode}: TTFT ms by turn {ttft}, turns total {total:.2f} s, "
                  f"draft passes {sum(x[2] for x in a)}")


if __name__ == "__main__":
    main()
