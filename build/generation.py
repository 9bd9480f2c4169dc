"""Offline generation through THE decode loop: many prompts answered by the target alone, batched.

The corpus (build/corpus.py) and the self-synthesized prompts (build/synth.py) are the target's own text, made by
`Decoder` exactly as a served request would be (root-only trees: plain batched decoding, one `forward_many` per step
for every live request, prompts sharing a prefix reuse its KV). Every request carries its own seed, and the native
forward's rows are invariant of the batch, so one output depends only on its prompt and seed: any of them can be
regenerated alone (how the shipped files are tested).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from spectrt.runtime.decoding.decoder import Decoder, Job
from spectrt.runtime.decoding.sampling import SamplingParams
from spectrt.runtime.engines.engine import Engine

# 32 live rows per step: on 2 cores a bf16 step streams the weights once for all of them (T=32 costs ~4x T=1),
# beyond which attention over every row's context grows the step faster than the rows it adds
DEFAULT_BATCH = 32


@dataclass(frozen=True)
class Request:
    """One generation: prompt token ids, sampling (with its own seed) and where it ends."""

    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    tag: object = None


def generate(target: Engine, requests: Sequence[Request], eos_ids: set[int], batch: int = DEFAULT_BATCH,
             admit: Callable[[], bool] = lambda: True) -> Iterator[tuple[Request, list[int], str, int | None]]:
    """Yield (request, output ids, finish reason, the end-of-sequence token that ended it or None) as requests
    finish, admitting them in order as slots free up while `admit()` says so (a deadline: once it says no, what runs
    finishes and nothing new starts, so no generated token is thrown away). The output leaves out the end-of-sequence
    token (finish "stop") as every surface of the loop does; which of several ended it comes apart."""
    if not requests:
        return
    longest = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    decoder = Decoder(target, None, eos_ids, max_seq_len=longest + 1, max_tree_tokens=64,
                      max_active=min(batch, len(requests)))
    waiting = list(requests)[::-1]
    while (waiting and admit()) or decoder.active:
        while waiting and decoder.free and admit():
            r = waiting.pop()
            decoder.add(Job(list(r.prompt_ids), r.max_new_tokens, None, r.params, tag=r))
        info = decoder.step()
        for job in info.finished:
            if job.finish == "error":
                raise RuntimeError(f"generation failed: {job.error}") from job.exception
            yield job.tag, list(job.out), job.finish, job.end_token
