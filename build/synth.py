"""Self-synthesized prompts (Magpie): the target writes the user turns its own draft will be trained on.

Given only its pre-query template (the chat template's default system turn, then `<|im_start|>user\\n`), an instruct
model writes a user message of the kind it was tuned on; answered by the same target, these give on-distribution
training data at any scale with no download. Follow-up turns the same way: the template up to the next user turn of
a conversation the target already answered. Every message is sampled through the one decode loop
(build/generation.py) with its own seed in bf16 (`DTYPE`), so a seed gives the same prompts on every machine the
native forward runs on, and the set is filtered: finished (not cut by length), 12-400 characters, mostly printable
ASCII (English), not a near-duplicate of another (normalized text, first 12 words) nor of a held-out prompt.

Unsteered, the target writes long "Can you help me..." requests; answers to those agree with the draft ~10 points more
than answers to the short questions people type ("What is...", "How do I...": measured on the shipped head, 62% vs
53%), so a set meant for chat also steers: with `openers`, each message starts with the first words of a written
training prompt (its seed picks which), and the target writes the rest.

`python -m spectrt.cli.ship prompts --count N --seed S` writes `build/prompts/synth-seed<S>.txt` (read by
build/corpus.py like any corpus; `SYNTH_SEEDS` lists the shipped files).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

from spectrt.build.corpus import HELDOUT_PROMPTS, Conversation, read_prompts, synth_prompts_path
from spectrt.build.generation import Request, generate
from spectrt.runtime.decoding.sampling import SamplingParams
from spectrt.runtime.engines.checkpoint import eos_ids

MARK = "\x00"  # a placeholder user message: the template up to it is the pre-query template
TEMPERATURE, TOP_P = 1.0, 0.95  # Magpie samples the user turn at T=1 (top-p keeps the tail from derailing)
MAX_USER_TOKENS = 96
MIN_CHARS, MAX_CHARS = 12, 400
CHUNK = 256  # requests per round of generation
# bf16, not `auto`: the shipped files were made in bf16, which every ISA computes alike; `auto` is bf16dot on AMX CPUs,
# whose sums are the tile unit's own, and sampled there the same seeds gave other prompts (5 of the first 6 of seed 0)
DTYPE = "bf16"


def pre_query_ids(tokenizer, history: Conversation = (), opener: str = "") -> list[int]:
    """Token ids of the chat template up to where the next user message begins (after `history`, if any), followed
    by `opener`, the words the message is to start with."""
    text = tokenizer.apply_chat_template([*history, {"role": "user", "content": MARK}], tokenize=False)
    return tokenizer(text[:text.index(MARK)] + opener, add_special_tokens=False)["input_ids"]


def openers_of(convs: Sequence[Conversation], words: int = 2) -> list[str]:
    """The first `words` words of each conversation's first user message (repeats kept: a seed picks one of them,
    so the openers come out as often as in `convs`)."""
    return [" ".join(first) for conv in convs if (first := conv[0]["content"].split()[:words])]


def normalized(text: str) -> str:
    """What two messages share when one near-duplicates the other: lowercase words, the first 12."""
    return " ".join(re.findall(r"[a-z0-9']+", text.lower())[:12])


def acceptable(text: str) -> bool:
    """A user message worth answering: not empty or runaway, mostly printable ASCII, a few letters."""
    if not MIN_CHARS <= len(text) <= MAX_CHARS or MARK in text or "<|" in text:
        return False
    ascii_share = sum(32 <= ord(c) < 127 or c == "\n" for c in text) / len(text)
    return ascii_share >= 0.95 and sum(c.isalpha() for c in text) >= 8


def message_seed(seed: int, index: int, history: Conversation = ()) -> int:
    """The sampling seed of message `index` (and of its conversation): the same on every machine."""
    digest = hashlib.sha256(f"synth:{seed}:{index}:{json.dumps(history, sort_keys=True)}".encode()).hexdigest()
    return int(digest[:15], 16)


def excluded(seed: int) -> list[Conversation]:
    """What the prompts of `seed` must not repeat: the held-out prompts, every benchmark prompt (one per line) and
    the files of smaller seeds. Why: nobody trains on what measures the draft."""
    from spectrt.runtime.decoding.bench import BENCH_DIR

    earlier = [synth_prompts_path(s) for s in range(seed)]
    out = [c for path in (HELDOUT_PROMPTS, *earlier) if path.is_file() for c in read_prompts(path)]
    return out + [[{"role": "user", "content": line.strip()}] for path in sorted(BENCH_DIR.glob("*.txt"))
                  for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def synthesize(target: Path, count: int, seed: int = 0, histories: Sequence[Conversation] = (),
               dtype: str = DTYPE, progress: bool = True, exclude: Sequence[Conversation] = (),
               openers: Sequence[str] = ()) -> list[Conversation]:
    """`count` new single-turn conversations, or with `histories` a follow-up user turn for each history that yields
    an acceptable one; deduplicated against each other and `exclude`, in the seed's order. With `openers` every
    message starts with one of them (its seed picks which)."""
    from spectrt.runtime.engines.engine import load_engine
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    engine = load_engine(Path(target), "torch", dtype, measure_kernels=False)
    end = eos_ids(target, tokenizer)  # the turn's end: chat models list it as an end-of-sequence id
    seen = {normalized(m["content"]) for conv in exclude for m in conv if m["role"] == "user"}
    wanted = len(histories) if histories else count
    out: list[Conversation] = []
    bar = tqdm(total=wanted, desc="synthesizing user turns", unit="prompt", disable=not progress)
    index = 0
    while (index < len(histories)) if histories else (len(out) < count):
        # single-turn: oversample 1.5x what is missing (about a third is filtered out); follow-ups: one per history;
        # at most CHUNK a round, so the bar moves
        todo = list(histories[index:index + CHUNK]) if histories else [
            () for _ in range(min(CHUNK, max(8, int(1.5 * (count - len(out))))))]
        seeds = [message_seed(seed, index + i, h) for i, h in enumerate(todo)]
        starts = [openers[s % len(openers)] if openers else "" for s in seeds]
        requests = [Request(pre_query_ids(tokenizer, h, start), SamplingParams(TEMPERATURE, top_p=TOP_P, seed=s),
                            MAX_USER_TOKENS, tag=index + i)
                    for i, (h, s, start) in enumerate(zip(todo, seeds, starts, strict=True))]
        done = {request.tag: (ids, finish) for request, ids, finish, _ in generate(engine, requests, end)}
        for i, history in enumerate(todo):  # the seed's order, whatever order they finished in
            ids, finish = done[index + i]
            text = (starts[i] + tokenizer.decode(ids, skip_special_tokens=True)).strip()
            finished, key = finish == "stop", normalized(text)
            if finished and acceptable(text) and key not in seen and (histories or len(out) < count):
                seen.add(key)
                out.append([*history, {"role": "user", "content": text}])
                bar.update(0 if histories else 1)
            bar.update(1 if histories else 0)
        index += len(todo)
    bar.close()
    return out


def write_prompts(path: Path, convs: Sequence[Conversation], header: str) -> None:
    """A corpus file (build/corpus.py's format): a plain line per single-turn prompt without newlines, else JSON."""
    lines = [f"# {h}" for h in header.splitlines()]
    for conv in convs:
        text = conv[0]["content"]
        plain = len(conv) == 1 and "\n" not in text and not text.startswith(("[", "#")) and text == text.strip()
        lines.append(text if plain else json.dumps(conv, ensure_ascii=False))
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
