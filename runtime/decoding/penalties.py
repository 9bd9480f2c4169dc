"""Penalties and logit bias on a verified tree: each row penalized by its own path, so a tree row's logits equal the AR
step's at that position and speculation stays exact (token for token greedy, in distribution sampled).

The definitions are OpenAI's and vLLM's: `presence_penalty` subtracts a constant from every token already in the
output, `frequency_penalty` that many times its count in the output; `repetition_penalty` (CTRL, Hugging Face, vLLM)
divides the positive logits of every token in the prompt or the output by it and multiplies the negative ones;
`logit_bias` adds to the named tokens' logits. Row i of a tree continues the output by the tokens on the path from the
root to node i (the root is the last committed token, already in the output or the prompt), so its counts are the
output's plus that path's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from spectrt.runtime.decoding.tree import path_tokens


@dataclass(frozen=True)
class Penalties:
    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value, low, high in (("presence_penalty", self.presence, -2, 2),
                                       ("frequency_penalty", self.frequency, -2, 2),
                                       ("repetition_penalty", self.repetition, 1e-6, 100)):
            if not low <= value <= high:
                raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
        for token, bias in self.logit_bias.items():
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.logit_bias)


def penalize(logits: torch.Tensor, penalties: Penalties, prompt: Sequence[int], output: Sequence[int],
             parents: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
    """`logits` [n, V] of a tree's rows (node order, `parents`/`tokens` as the Tree's), penalized in place."""
    if not penalties.active:
        return logits
    counts = Counter(int(t) for t in output)
    seen = set(int(t) for t in prompt) | set(counts)
    vocab = logits.shape[1]
    for i, path in enumerate(path_tokens(parents, tokens)):
        row = logits[i]
        here = counts + Counter(path) if path else counts
        if penalties.repetition != 1.0:
            ids = torch.tensor(sorted(t for t in seen.union(path) if 0 <= t < vocab), dtype=torch.long)
            if len(ids):
                values = row[ids]
                row[ids] = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
        if (penalties.presence or penalties.frequency) and here:
            ids = torch.tensor([t for t in here if 0 <= t < vocab], dtype=torch.long)
            n = torch.tensor([float(here[t]) for t in here if 0 <= t < vocab])
            row[ids] -= penalties.frequency * n + penalties.presence
        for token, bias in penalties.logit_bias.items():
            if 0 <= token < vocab:
                row[token] += bias
    return logits
