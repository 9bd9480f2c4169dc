"""THE decode loop: every surface (generate, bench, tune, the corpus generator, Triton) runs `Decoder`.

A single request is a batch of one. Each active request owns a slot (its target and draft KV caches: one pool per
engine, allocated once here). Each `step`:

1. prompts still being prefilled contribute causal chunks (bounded per step, so a long prompt never stalls the
   others); the draft reads the same chunks in its first pass of the step;
2. the speculation controller (controller.py) plans every decoding request's token trie from the proposers
   (propose.py): suffix candidates (free), then the draft (static SpecInfer shapes, or EAGLE-2 expansion of the
   best nodes), all requests' draft levels in one draft forward each; a request drafts only when its learned draft
   gain pays for its pass and the row it adds;
3. one speculation budget across the batch (`policy.allocate`, in the controller): which scored nodes of which
   request to verify, by expected tokens per millisecond of the batched target forward, never worse than plain
   batched decoding; static trees are verified whole (cut by rank when the step's row cap is exceeded);
4. ONE target `forward_many` over the prompt chunks and every request's tree;
5. per request: verification (greedy, or lossless sampling), KV compaction (target and draft), stop conditions
   (end-of-sequence, length, stop words), `min_length` and bad words applied to the distribution verified.

Prefix cache (`prefix_cache`, on by default): a finished request's KV (prompt + output) stays in its slot, indexed
by its tokens (prefix.py); a new request starts from the slot holding its longest cached prefix (taking it
over, or copying the rows into another free slot) and prefills only the rest; the drafts keep their rows of that
prefix too (the EAGLE-3 head its pending target features). Reuse is exact because the engines' rows are invariant
of the batch and chunk they were computed in; an engine whose rows are not (the torch reference path in fp) gets
no reuse (`prefix_refusal` says why).

Autoregressive decoding is the root-only tree, so the baseline runs on exactly the engine, caches and kernels that
speculation uses. A step that fails is rolled back and each request retried alone: only the requests that fail
alone end (finish "error"); the others continue with exactly the arithmetic of the batch (the engines' rows are
invariant of the batch). The decoder does no I/O: `step` returns what each request emitted and which finished.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch
from spectrt.runtime.decoding.controller import Controller
from spectrt.runtime.decoding.grammar import GrammarState, allowed_nodes, banned_rows, forced_token, mask_logits
from spectrt.runtime.decoding.penalties import Penalties, penalize
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.decoding.prefix import PrefixIndex
from spectrt.runtime.decoding.propose import Candidates, DraftProposer, Eagle3Proposer, SuffixProposer
from spectrt.runtime.decoding.sampling import (
    MAX_TOP_LOGPROBS,
    SamplingParams,
    argmax_rows,
    sampling_probs,
    token_logprobs,
    verify_sampled,
)
from spectrt.runtime.decoding.text import stop_token_end
from spectrt.runtime.decoding.tree import AUTO, Tree, greedy_accept, path_tokens  # AUTO: a job's dynamic trees
from spectrt.runtime.engines.engine import Engine, Segment, SegmentBuffers

GREEDY = SamplingParams()
CHILD_MODES = ("sample", "topk")
ROOT_ONLY = Tree((-1,))
FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class DecodeStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache (not prefilled)
    new_tokens: int = 0
    emitted_tokens: int = 0  # new tokens plus the end-of-sequence token, which a target pass also produced
    target_passes: int = 0
    draft_passes: int = 0
    proposed: int = 0  # candidate nodes sent to verification
    prefill_seconds: float = 0.0
    seconds: float = 0.0  # prefill + decode
    accepted: list[int] = field(default_factory=list)  # candidate tokens accepted per target pass
    verified: list[int] = field(default_factory=list)  # tree nodes verified per target pass (1 = plain AR step)
    trace: list[tuple] = field(default_factory=list)  # with Decoder.record: (kind, key, parent ok, accepted)

    @property
    def tau(self) -> float:
        """Mean tokens emitted per target pass (accepted draft tokens + the target's own token)."""
        return self.emitted_tokens / max(self.target_passes, 1)

    @property
    def decode_seconds(self) -> float:
        """Time after the prompt's prefill: what speedups compare (prefill is the same work with or without a tree)."""
        return max(self.seconds - self.prefill_seconds, 0.0)

    @property
    def tokens_per_second(self) -> float:
        """Decode tokens per second (prefill excluded)."""
        return self.new_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def acceptance_per_depth(self, depth: int) -> list[float]:
        """Fraction of target passes whose accepted path reached each depth 1..depth."""
        passes = max(len(self.accepted), 1)
        return [sum(a >= d for a in self.accepted) / passes for d in range(1, depth + 1)]

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "new_tokens": self.new_tokens,
            "target_passes": self.target_passes,
            "draft_passes": self.draft_passes,
            "proposed": self.proposed,
            "accepted": sum(self.accepted),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "decode_seconds": round(self.decode_seconds, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 3),  # decode only
            "tau": round(self.tau, 4),
            "mean_tree_nodes": round(sum(self.verified) / max(len(self.verified), 1), 3),
            "speculative_passes": sum(v > 1 for v in self.verified),
        }


@dataclass
class StepClock:
    """Where the loop's time goes, summed over steps (seconds): the forwards, and the host work around them that a
    speculative step must keep small (`spectrt profile` reports it per step at batch 1 and 8)."""

    steps: int = 0
    rows: int = 0  # active requests, summed over steps
    total: float = 0.0
    target: float = 0.0  # the target forward
    draft: float = 0.0  # draft forwards (inside proposing)
    propose: float = 0.0  # candidates, gate, drafting and the budget, draft forwards included
    accept: float = 0.0  # verification, compaction, stop checks

    def per_step_ms(self) -> dict[str, float]:
        """ms per step: total, forwards, host (total - forwards) split into proposing, acceptance and the rest."""
        n = max(self.steps, 1)
        host = self.total - self.target - self.draft
        parts = {"total": self.total, "target forward": self.target, "draft forwards": self.draft, "host": host,
                 "host: propose": self.propose - self.draft, "host: accept": self.accept,
                 "host: other": host - (self.propose - self.draft) - self.accept}
        out = {k: round(1e3 * v / n, 3) for k, v in parts.items()}
        out["host per request"] = round(1e3 * host / max(self.rows, 1), 3)
        return out


@dataclass
class DecodeResult:
    token_ids: list[int]
    finish_reason: str  # "stop" (end-of-sequence token or stop word) or "length" (max_new_tokens / max_seq_len)
    stats: DecodeStats
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per token, if asked


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class Job:
    """One request: what to decode (checked by `Decoder.check`) and its decode state.

    `tree`: None (the target alone), a static `Tree` (SpecInfer expansion vector, filled by the draft) or `AUTO`
    (dynamic trees under the decoder's policy); `suffix`: merge suffix candidates (None: the policy's choice for
    `AUTO`, off for the others).
    """

    prompt_ids: list[int]
    max_new_tokens: int
    tree: Tree | str | None = None
    params: SamplingParams = GREEDY
    children: str = "sample"  # sampled static trees: children drawn without replacement ("sample") or top-k
    eos_ids: set[int] | None = None  # None: the decoder's
    min_length: int = 0  # end-of-sequence is masked out of the target distribution before this many tokens
    stop_words: list[list[int]] = field(default_factory=list)  # stop after emitting any of these sequences
    bad_words: list[list[int]] = field(default_factory=list)  # never emitted (masked in the target distribution)
    grammar: GrammarState | None = None  # structured output: every verified row masked by its path's grammar state
    penalties: Penalties | None = None  # presence / frequency / repetition penalties, logit bias: per row, by its path
    logprobs: int | None = None  # None: none; k: each emitted token's log-probability and the k best (`logprobs`)
    prompt_logprobs: bool = False  # also the prompt's tokens' (after the first), `logprobs` best each: no prefix reuse
    suffix: bool | None = None
    tag: object = None  # the caller's handle
    # decode state
    out: list[int] = field(default_factory=list)
    logprob_rows: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # per token of out
    prompt_logprob_rows: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)  # prompt[1:]
    finish: str | None = None  # one of FINISH_REASONS once finished
    end_token: int | None = None  # the end-of-sequence token that ended it (finish "stop"), of several the one emitted
    error: str | None = None  # why, for finish "error"
    stats: DecodeStats = field(default_factory=DecodeStats)
    slot: int = -1
    ids: list[int] = field(default_factory=list)
    draft_gen: torch.Generator | None = None
    verify_gen: torch.Generator | None = None
    started: float = 0.0
    decoding: bool = False  # prefill done
    exception: BaseException | None = field(default=None, repr=False)  # what ended it with "error"
    draft_gain: float | None = None  # expected tokens the draft adds per step, learned (set by `Decoder.add`)
    draft_rows: float = 1.0  # verified rows that gain comes with, learned alike
    draft_evidence: tuple[float, float, float] = (0.0, 0.0, 0.0)  # decayed (draft-only tokens, rows, drafted steps)
    score_evidence: tuple[float, float] = (1.0, 1.0)  # decayed (expected, accepted) tree tokens (`Controller`)
    idle: int = 0  # consecutive steps whose candidates the budget left unverified (`Controller.plan`)
    hold: tuple[int, int] = (0, 0)  # (steps left, batch size when set): decode plainly without proposing
    holds: int = 0  # holds in a row without a verified candidate: each twice as long as the last (`Controller`)

    @property
    def score_scale(self) -> float:
        """Accepted over expected tokens of this job's recent dynamic trees, applied to its candidate scores before
        the budget. Why: scores are calibrated on single requests (`spectrt tune`); in a batch the budget verified
        nodes whose calibrated promise was not kept (measured at batch 8, bf16: 0.80x plain batched decoding), and a
        node only pays when its real acceptance beats the batched step's tokens per row. Per job, so one tenant's
        hot sampled requests never shrink another's trees."""
        expected, accepted = self.score_evidence
        return min(max(accepted / expected, 0.2), 1.5)


@dataclass
class Verified:
    """One request's tree after the target forward: what its acceptance reads."""

    cand: Candidates
    tree: Tree  # the verified tree (the trie's chosen nodes), rows in `order`
    order: list[int]  # trie node of each tree row
    tokens: torch.Tensor  # [T] the rows' tokens (a view of the decoder's static buffers: read within the step)
    token_ids: list[int]  # the same, as a list
    masks: object  # the grammar's allowed-token bitmask of each row (runtime/decoding/grammar.py), None without one
    logits: torch.Tensor  # [T, V] the target's
    features: torch.Tensor | None  # the target features an EAGLE-3 head reads next (None without one)


@dataclass
class StepInfo:
    active: int = 0
    prefill_tokens: int = 0
    tree_tokens: int = 0  # target rows spent on decoding trees (roots included)
    emitted: list[tuple[Job, list[int]]] = field(default_factory=list)  # new tokens per job, in order
    finished: list[Job] = field(default_factory=list)
    fallback: str | None = None  # the batched forward failed and every job was retried alone: why

    @property
    def tokens(self) -> int:
        return sum(len(t) for _, t in self.emitted)

    def merge(self, other: StepInfo) -> None:
        self.prefill_tokens += other.prefill_tokens
        self.tree_tokens += other.tree_tokens
        self.emitted += other.emitted
        self.finished += other.finished


def prefix_refusal(target: Engine, draft: Engine | None) -> str | None:
    """Why reused KV rows could differ from recomputed ones with these engines (None: they cannot, reuse is exact).

    A row is reused exactly only if it does not depend on what else its forward computed: the native CPU forward
    and the torch INT8 path are row invariant (`exact_rows`); the torch fp reference path's GEMM and attention
    results change with the rows and chunk they ran in (~1e-7), and exported graphs are not checked for it."""
    for role, engine in (("target", target), ("draft", draft)):
        if engine is not None and not getattr(engine, "exact_rows", False):
            return (f"the {role} ({type(engine).__name__}) is not row invariant: a reused KV row could differ from "
                    "a recomputed one and change the output; prefix reuse needs the native CPU forward")
    return None


class Decoder:
    """Up to `max_active` requests decoded together: `add` between `step`s, `cancel` any time between steps.

    `policy` shapes dynamic trees (`AUTO` jobs) and holds this machine's cost curves that the budget rule weighs;
    `tree_budget` caps the rows a step spends on trees (static trees are cut by rank beyond it, dynamic trees and
    suffix candidates are chosen within it); `prefill_budget`
    the prompt tokens prefilled per step; `prefix_cache`: reuse cached prefixes across requests (where exact).
    """

    def __init__(self, target: Engine, draft: Engine | None, eos_ids: set[int], max_seq_len: int = 2048,
                 max_tree_tokens: int = 64, max_active: int = 1, policy: Policy | None = None,
                 tree_budget: int | None = None, prefill_budget: int | None = None, prefix_cache: bool = True):
        if draft is not None and draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.config.vocab_size}) differs from the target's "
                f"({target.config.vocab_size}): use a draft made from this target"
            )
        if max_active < 1 or max_seq_len < 2 or max_tree_tokens < 1:
            raise ValueError(f"max_active ({max_active}) and max_tree_tokens ({max_tree_tokens}) must be >= 1 and "
                             f"max_seq_len ({max_seq_len}) >= 2")
        self.target, self.draft, self.eos_ids = target, draft, set(eos_ids)
        # read once: why this target's tree decoding would not equal its AR output (an engine that does not say,
        # a test double computing rows from tables, is exact); `check` then refuses every speculative job
        self.inexact = getattr(target, "inexact", None)
        self.argmax_of = getattr(target, "argmax_of", None)  # the forward's own argmax of its logits, where it has one
        self.vocab_size = target.config.vocab_size
        self.max_seq_len, self.max_tree_tokens, self.max_active = max_seq_len, max_tree_tokens, max_active
        self.prefill_budget = prefill_budget or max_tree_tokens
        capacity = max_seq_len + max_tree_tokens
        self.target_caches = target.new_caches(max_active, capacity, max_tree_tokens)
        self.drafter = None
        if getattr(draft, "feature_layers", None) is not None:  # an EAGLE-3 head (Eagle3Head, GraphHead) reads them
            self.drafter = Eagle3Proposer(draft, max_active, capacity, max_tree_tokens, target)
        elif draft is not None:
            self.drafter = DraftProposer(draft, max_active, capacity, max_tree_tokens)
        self.suffix = SuffixProposer(max_active)
        self.buffers = SegmentBuffers(max_active, max_tree_tokens)  # every target segment's tokens and positions
        self.controller = Controller(policy or Policy(), self.drafter, self.suffix, max_seq_len, max_tree_tokens,
                                     tree_budget or max_active * max_tree_tokens)
        self.free = list(range(max_active))[::-1]
        self.prefix_refusal = prefix_refusal(target, draft)
        self.prefix = PrefixIndex() if prefix_cache and self.prefix_refusal is None else None
        self.active: list[Job] = []
        self.record = False  # fill DecodeStats.trace (what `spectrt tune` measures acceptance from)
        self.clock = StepClock()

    # ------------------------------------------------------------------------------------- membership
    def check(self, job: Job) -> None:
        """The decoder's input checks (ValueError naming the fix), before a job takes a slot."""
        if job.children not in CHILD_MODES:
            raise ValueError(f"children must be one of {CHILD_MODES}, got {job.children!r}")
        if not job.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if job.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {job.max_new_tokens}")
        if len(job.prompt_ids) >= self.max_seq_len:
            raise ValueError(f"the prompt has {len(job.prompt_ids)} tokens but max_seq_len is {self.max_seq_len}: "
                             "shorten the prompt or raise max_seq_len (--max-seq-len)")
        bad = [t for t in job.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"the prompt holds token ids outside this model's vocabulary [0, {self.vocab_size}) "
                             f"(e.g. {bad[0]}): a tokenizer with added tokens needs a model that has them")
        if job.eos_ids is not None and not all(0 <= t < self.vocab_size for t in job.eos_ids):
            raise ValueError(f"end_id must be a token id in [0, {self.vocab_size}), got {sorted(job.eos_ids)}")
        for name, words in (("stop_words", job.stop_words), ("bad_words", job.bad_words)):
            if any(not w or not all(0 <= t < self.vocab_size for t in w) for w in words):
                raise ValueError(f"{name} must be non-empty token sequences within the vocabulary "
                                 f"[0, {self.vocab_size})")
        if job.logprobs is not None and not 0 <= job.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {job.logprobs}")
        if isinstance(job.tree, Tree) and len(job.tree) > self.max_tree_tokens:
            raise ValueError(f"the tree has {len(job.tree)} nodes, more than max_tree_tokens={self.max_tree_tokens}")
        if job.tree is not None and not isinstance(job.tree, Tree) and job.tree != AUTO:
            raise ValueError(f"a job's tree is None, a Tree or {AUTO!r}, got {job.tree!r}")
        if self.inexact and self._speculates(job):
            raise ValueError(f"speculative decoding would be lossy on this engine: {self.inexact} (or decode without "
                             "speculation: --no-spec, a request's tree \"0\")")

    def _speculates(self, job: Job) -> bool:
        """Whether the job may verify more than its root: dynamic trees, suffix candidates, a drafted static tree."""
        static = isinstance(job.tree, Tree) and len(job.tree) > 1 and self.draft is not None
        return job.tree == AUTO or bool(job.suffix) or static

    def add(self, job: Job) -> None:
        """Give the job a slot (call only while `self.free`); its prefill starts with the next step."""
        self.check(job)
        if not self.free:
            raise RuntimeError("no free slot: wait for a request to finish")
        if self.draft is None and isinstance(job.tree, Tree):
            job.tree = None  # no draft to fill a static tree: the target alone (suffix candidates stay possible)
        drafts = self.drafter is not None and self.controller.drafts(job)
        # a seeded sampled static tree draws its tokens alike whatever the cache holds: the target reuses only what
        # the draft holds too (a draft catching up decodes plain steps, which draw otherwise)
        seeded = drafts and isinstance(job.tree, Tree) and not job.params.greedy and job.params.seed is not None
        job.slot, cached = self._take_slot(job.prompt_ids, drafts, seeded, reuse=not job.prompt_logprobs)
        self.controller.start(job)
        job.ids = list(job.prompt_ids)
        job.out, job.finish, job.error, job.decoding, job.end_token = [], None, None, False, None
        job.logprob_rows, job.prompt_logprob_rows = [], []
        job.stats = DecodeStats(prompt_tokens=len(job.prompt_ids), cached_tokens=cached)
        seed = job.params.seed if job.params.seed is not None else random.SystemRandom().randrange(2**62)
        job.draft_gen = torch.Generator().manual_seed(2 * seed)  # independent drafting / verifying streams
        job.verify_gen = torch.Generator().manual_seed(2 * seed + 1)
        job.started = time.perf_counter()
        if job.suffix:
            self.suffix.start(job.slot, job.ids)
        self.active.append(job)

    def _take_slot(self, prompt_ids: list[int], drafts: bool, bounded: bool = False,
                   reuse: bool = True) -> tuple[int, int]:
        """(the free slot a new request decodes in, prompt tokens whose KV it already holds), its caches set up;
        `drafts`: the request reads the draft, whose features of the prefix then bound what the target reuses (an
        EAGLE-3 head; a sliced draft catches up lazily unless `bounded`: `DraftProposer.reuse`); a request that never
        drafts reuses the whole match and leaves the slot's draft state of it as it was (a plain turn between two
        drafting ones wiped it: the third re-read the whole conversation). Why: bounded by a draft it never reads, a
        plain request on a server with a draft reused nothing (0 of 43 prompt tokens for a repeated prompt, 42 without
        the draft).

        The cached prefix is matched on all prompt tokens but the last (that one is the first decode step's root, its
        KV written by that step). The slot holding it is taken over when it is free and nothing of its sequence
        beyond the match would be lost (or it is the only free slot); else its rows are copied into the slot the
        index gives up (`PrefixIndex.victim`: empty, else least recently used), so a shared prefix stays for the
        next request and an active request's prompt can serve a concurrent one."""
        free, index = self.free, self.prefix
        found = index.match(prompt_ids[:-1]) if index is not None and reuse else None
        if found is None:
            slot = index.victim(free) if index is not None else free[-1]
            src, length = slot, 0
        else:
            src, length = found.slot, found.length
            take_over = src in free and (found.whole or len(free) == 1)
            slot = src if take_over else index.victim([s for s in free if s != src])
        free.remove(slot)
        if index is not None:
            index.remove(slot)
        cache = self.target_caches[slot]
        try:
            if self.drafter is not None:
                if drafts:
                    length = self.drafter.reuse(src, slot, length, bounded)
                else:  # never read by this request: a slot taken over keeps its draft's prefix, a copy starts empty
                    self.drafter.reuse(src, slot, length if src == slot else 0)
            if length and src != slot:
                cache.copy_prefix(self.target_caches[src], length)
        except BaseException:  # the slot goes back empty: a failed admission must not shrink the decoder for good
            cache.length = 0
            if self.drafter is not None:
                self.drafter.caches[slot].length = 0
            free.append(slot)
            raise
        cache.length = length
        return slot, length

    def _release(self, job: Job, finish: str, exception: BaseException | None = None) -> None:
        job.finish = job.finish or finish
        if exception is not None and job.exception is None:
            job.exception, job.error = exception, f"{type(exception).__name__}: {exception}"
        job.stats.new_tokens = len(job.out)
        job.stats.seconds = time.perf_counter() - job.started
        if not job.decoding:
            job.stats.prefill_seconds = job.stats.seconds
        if job in self.active:
            self.active.remove(job)
            self.free.append(job.slot)
            self.suffix.stop(job.slot)
            if self.prefix is not None:  # its committed rows stay reusable; a failed request's are not trusted
                held = min(self.target_caches[job.slot].length, len(job.ids))
                self.prefix.insert(job.slot, job.ids[:held] if job.finish != "error" else [])

    def cancel(self, job: Job) -> None:
        """Drop a job now (between steps): its slot is free for the next `add`."""
        self._release(job, "cancelled")

    def finish(self, job: Job, reason: str = "stop") -> None:
        """End a job from outside the loop between steps (e.g. a stop string matched on the detokenized text)."""
        self._release(job, reason)

    def run(self, jobs: list[Job]) -> list[Job]:
        """Decode all jobs, admitting them in order as slots free up (in-process use, tools and tests)."""
        waiting = list(jobs)
        while waiting or self.active:
            while waiting and self.free:
                self.add(waiting.pop(0))
            self.step()
        return jobs

    def generate(self, prompt_ids: list[int], max_new_tokens: int, tree: Tree | None = None,
                 on_tokens=None, params: SamplingParams = GREEDY, children: str = "sample",
                 policy: Policy | None = None, grammar: GrammarState | None = None,
                 penalties: Penalties | None = None, logprobs: int | None = None) -> DecodeResult:
        """One request, a batch of one. `tree` (with a draft): that static shape, plus suffix candidates if
        `policy.suffix`; `policy` alone: dynamic trees from the suffix index and (if `policy.draft`) the draft;
        neither: the target alone. `on_tokens(new_ids)` is called as tokens are accepted; `grammar`: a structured
        output the tokens follow (a fresh state: runtime/decoding/grammar.py); `penalties`: per-path penalties and
        logit bias (runtime/decoding/penalties.py); `logprobs`: report each token's log-probability and that many
        best alternatives (`DecodeResult.logprobs`)."""
        if self.active:
            raise RuntimeError("generate() runs one request on an idle decoder: use add/step for batches")
        job = Job(list(prompt_ids), max_new_tokens, tree if tree is not None else (AUTO if policy else None),
                  params, children, suffix=policy is not None and policy.suffix, grammar=grammar,
                  penalties=penalties, logprobs=logprobs)
        served = self.controller.policy
        self.controller.policy = policy or served
        try:
            self.add(job)
            while self.active:
                info = self.step()
                if on_tokens is not None:
                    for _, new in info.emitted:
                        on_tokens(new)
        finally:
            self.controller.policy = served
            for left in list(self.active):  # a callback raised: nothing stays in a slot
                self.cancel(left)
        if job.exception is not None:
            raise job.exception
        return DecodeResult(job.out, job.finish, job.stats, job.logprob_rows)

    # ------------------------------------------------------------------------------------- one step
    def step(self) -> StepInfo:
        """One batched step over all active jobs: what each emitted and which finished (for streaming and metrics)."""
        start = time.perf_counter()
        info = StepInfo(active=len(self.active))
        jobs = list(self.active)
        try:
            return self._step(jobs, info)
        finally:
            clock = self.clock
            clock.steps, clock.rows = clock.steps + 1, clock.rows + len(jobs)
            clock.total += time.perf_counter() - start

    def _step(self, jobs: list[Job], info: StepInfo) -> StepInfo:
        snapshot = self._snapshot(jobs)
        try:
            planned = self._forward(jobs, info)
        except Exception as exc:
            self._restore(snapshot)
            if len(jobs) == 1:
                self._release(jobs[0], "error", exc)
                info.finished.append(jobs[0])
                return info
            # isolate: each job alone; the ones that fail alone end, the rest advance as they would have
            info = StepInfo(active=len(jobs), fallback=f"{type(exc).__name__}: {exc}")
            for job in jobs:
                alone = StepInfo()
                one = self._snapshot([job])
                try:
                    planned = self._forward([job], alone)
                except Exception as failure:
                    self._restore(one)
                    self._release(job, "error", failure)
                    info.finished.append(job)
                    continue
                self._accept_all(planned, alone)
                info.merge(alone)
            return info
        self._accept_all(planned, info)
        return info

    def _snapshot(self, jobs: list[Job]) -> tuple[list[tuple], list[tuple]]:
        """What a failed step must put back so each job's retry alone starts from the state the batch left it (a static
        tree then draws what the batch would have; a dynamic tree is sized at batch 1's cost, exact all the same): the
        caches' lengths, and each job's controller state and draft passes (a hold spent, evidence faded), plus the
        draft generator of a sampled static tree (the one state its children draw from: a seeded request's tokens
        changed when another request's failure made it draw twice). Taken every step: ~1.3 us at batch 1, ~3 at
        batch 8 (warm caches, bf16dot, Intel Xeon)."""
        caches = [self.target_caches[j.slot] for j in jobs]
        if self.drafter is not None:
            caches += [self.drafter.caches[j.slot] for j in jobs]
        states = [(j, j.hold, j.holds, j.idle, j.draft_evidence, j.draft_gain, j.draft_rows, j.stats.draft_passes,
                   j.draft_gen.get_state() if isinstance(j.tree, Tree) and not j.params.greedy else None)
                  for j in jobs]
        return [(c, c.length) for c in caches], states

    @staticmethod
    def _restore(snapshot: tuple[list[tuple], list[tuple]]) -> None:
        lengths, states = snapshot
        for cache, length in lengths:
            cache.length = length
        for job, *state, generator in states:
            job.hold, job.holds, job.idle, job.draft_evidence, job.draft_gain, job.draft_rows, \
                job.stats.draft_passes = state
            if generator is not None:
                job.draft_gen.set_state(generator)

    def _forward(self, jobs: list[Job], info: StepInfo) -> list[Verified]:
        """Everything up to and including the target forward (what it changes of a request, cache lengths and the
        planning state `_snapshot` lists, `_step` restores if this raises). Returns per job what its acceptance
        needs."""
        prefill, decode = [], []
        for job in jobs:
            (decode if job.decoding or self.target_caches[job.slot].length >= len(job.ids) - 1 else prefill).append(job)
        now = time.perf_counter()
        for job in decode:
            if not job.decoding:
                job.decoding = True
                job.stats.prefill_seconds = now - job.started
                if self.prefix is not None:  # its prompt's rows are final: concurrent requests may copy them
                    self.prefix.insert(job.slot, job.ids[:self.target_caches[job.slot].length], pinned=True)
        segments, draft_prefill, chunks = [], [], []
        budget = self.prefill_budget
        draft_pays = self.drafter is not None and bool(prefill) and \
            self.controller.draft_may_pay(len(jobs), sum(len(j.ids) for j in jobs) // len(jobs))
        for job in prefill:  # admission order: the oldest prompt advances first
            if budget <= 0:
                break
            cache = self.target_caches[job.slot]
            n = cache.length
            t = min(len(job.ids) - 1 - n, budget, self.max_tree_tokens)
            segments.append(Segment(*self.buffers.rows(job.slot, job.ids[n:n + t], n), self.buffers.causal[t], cache))
            chunks.append((job, t))
            budget -= t
            info.prefill_tokens += t
            if self.drafter is not None and self.controller.drafts(job) and (isinstance(job.tree, Tree) or draft_pays):
                seg = self.drafter.chunk(job.slot, job.ids, n + t)
                if seg is not None:
                    draft_prefill.append(seg)
        start = time.perf_counter()
        drafted = self.drafter.forward_seconds if self.drafter is not None else 0.0
        cands = self.controller.plan(decode, draft_prefill, len(prefill))
        self.clock.propose += time.perf_counter() - start
        if self.drafter is not None:
            self.clock.draft += self.drafter.forward_seconds - drafted
        plans = []
        for cand in cands:
            trie = cand.trie
            if cand.static is not None:
                nodes = list(range(len(trie)))
            else:
                nodes = trie.best(cand.chosen)
            tree, order, token_ids = (ROOT_ONLY, [0], [cand.job.ids[-1]]) if len(nodes) == 1 else trie.subtree(nodes)
            grammar, masks = cand.job.grammar, None
            if grammar is not None:  # nodes the grammar forbids could never be accepted: they are not verified
                masks = grammar.tree_masks(tree.parents, token_ids)
                sampled = None if cand.job.params.greedy else [trie.sampled[i] for i in order]
                keep = allowed_nodes(masks, tree.parents, token_ids, sampled)
                if len(keep) < len(tree):
                    grammar.pruned += len(tree) - len(keep)
                    tree, order, token_ids = ((ROOT_ONLY, [0], [cand.job.ids[-1]]) if len(keep) == 1 else
                                              trie.subtree([order[i] for i in keep]))
                    masks = grammar.tree_masks(tree.parents, token_ids)
                if cand.job.tree is not None:  # speculating: tokens the grammar forces are verified for free
                    tree, order, token_ids, masks = self._jump_forward(cand, grammar, tree, order, token_ids, masks)
            tokens, positions = self.buffers.rows(cand.job.slot, token_ids, cand.position, tree.depths)
            segments.append(Segment(tokens, positions, tree.mask, self.target_caches[cand.job.slot]))
            plans.append((cand, tree, order, tokens, token_ids, masks))
            info.tree_tokens += len(tree)
        layers = self.drafter.feature_layers if self.drafter is not None else None
        features = [None] * len(segments)
        start = time.perf_counter()
        # no logits for prefill chunks unless the prompt's logprobs were asked (the prompt's last token is the first
        # step's root)
        logit_rows = [None if job.prompt_logprobs else 0 for job, _ in chunks] + [None] * len(plans)
        if layers and segments:  # the head's inputs come out of the same target forward
            logits, features = self.target.forward_features(segments, layers, logit_rows)
        else:
            logits = self.target.forward_many(segments, logit_rows) if segments else []
        self.clock.target += time.perf_counter() - start
        for (job, t), feats, lg in zip(chunks, features[:len(chunks)], logits[:len(chunks)], strict=True):
            cache = self.target_caches[job.slot]
            if job.prompt_logprobs:  # row j of the chunk predicts prompt token n + j + 1
                n = cache.length
                job.prompt_logprob_rows += token_logprobs(lg, list(range(t)), job.ids[n + 1:n + t + 1],
                                                          job.logprobs or 0)
            if feats is not None and self.controller.drafts(job):
                self.drafter.take(job.slot, cache.length, feats)
            cache.commit(t)
        return [Verified(*plan, lg, feats) for plan, lg, feats
                in zip(plans, logits[len(chunks):], features[len(chunks):], strict=True)]

    def _jump_forward(self, cand: Candidates, grammar: GrammarState, tree: Tree, order: list[int],
                      token_ids: list[int], masks):
        """The tree grown by what the grammar forces after a leaf (the best-scored leaf after which it forces anything,
        up to the verify window): the forced text (`", "age": ` after a string value), tokenized as the tokenizer
        writes it, as a chain of point candidates under the leaf, or else the one token its row allows (the
        end-of-sequence after a closed document). The target verifies them like any candidate, so the output stays
        the constrained AR's; it writes the canonical tokenization nearly always, so structured output decodes in
        fewer steps than free text. Not the draft's: the controller does not credit it with them. Why text, not
        single tokens: a forced text has many tokenizations (`{"` or `{` then `"`), so a row rarely allows one token
        (6 JSON extractions, bf16: forced single tokens were 7.7% of the output, forced text 44%; constrained
        speculation 1.40x -> 1.70x constrained AR, scripts/structured_bench.py). One leaf: the others' chains were
        mostly rejected rows (all leaves: 1.74x, the best one: 1.77x)."""
        trie, verified = cand.trie, set(order)
        has_children = set(tree.parents[1:])
        leaves = sorted((i for i in range(len(order)) if i not in has_children), key=lambda i: -trie.scores[order[i]])
        paths, grown = path_tokens(tree.parents, token_ids), []
        for i in leaves:
            room = self.max_tree_tokens - len(order) - len(grown)
            if room <= 0:
                break
            forced = grammar.jump_tokens(paths[i])
            if not forced and (token := forced_token(masks[i])) is not None:
                forced = [token]
            node = order[i]
            for token in forced[:room]:
                node = trie.add(node, token, trie.scores[order[i]])
                if node not in verified:
                    verified.add(node)
                    grown.append(node)
                    cand.suffixed.add(node)
            if grown:
                break
        if not grown:
            return tree, order, token_ids, masks
        grammar.forced += len(grown)
        tree, order, token_ids = trie.subtree(order + grown)
        masks = grammar.tree_masks(tree.parents, token_ids)
        sampled = None if cand.job.params.greedy else [trie.sampled[i] for i in order]
        keep = allowed_nodes(masks, tree.parents, token_ids, sampled)  # a tokenization the grammar refuses goes
        if len(keep) < len(tree):
            tree, order, token_ids = trie.subtree([order[i] for i in keep])
            masks = grammar.tree_masks(tree.parents, token_ids)
        return tree, order, token_ids, masks

    # ------------------------------------------------------------------------------------- acceptance
    def _accept_all(self, planned: list[Verified], info: StepInfo) -> None:
        start = time.perf_counter()
        try:
            self._accept_each(planned, info)
        finally:
            self.clock.accept += time.perf_counter() - start

    def _accept_each(self, planned: list[Verified], info: StepInfo) -> None:
        # the greedy tokens of every greedy request as the native forward's LM head found them (`argmax_of`), masked
        # or not (`_accept` checks them against its masks); without them each request reduces its own rows
        greedy = [v for v in planned if v.cand.job.params.greedy]
        try:
            found = self.argmax_of([v.logits for v in greedy]) if self.argmax_of is not None and greedy else None
        except Exception:  # then each request reduces its own rows below, where a failure ends that request alone
            found = None
        best = dict(zip(map(id, greedy), found, strict=True)) if found is not None else {}
        for v in planned:
            job = v.cand.job
            try:
                self._accept(v, info, best.get(id(v)))
            except Exception as exc:  # this request's verification failed: it ends, the batch goes on
                self._release(job, "error", exc)
                if job not in info.finished:
                    info.finished.append(job)

    def _masked(self, job: Job, tree: Tree, tokens: list[int]) -> tuple[list[int], list[int], list[int]] | None:
        """What the request's target distribution masks this step, None for nothing: (columns masked at every node,
        and the rows and columns of single entries): end-of-sequence before min_length, bad words where their
        prefix matches. Per-node entries only where they differ by node (a scalar write per word and node cost ~0.1
        ms each)."""
        short = job.min_length - len(job.out)  # a node at depth d has emitted len(out) + d tokens before its next
        if not job.bad_words and short <= 0:
            return None
        rows, cols = [], []
        eos = sorted(job.eos_ids if job.eos_ids is not None else self.eos_ids)
        singles = [w[0] for w in job.bad_words if len(w) == 1]
        if short > tree.max_depth:  # every node is short of min_length: one column write, no per-node lists
            singles += eos
        elif short > 0:
            for i, depth in enumerate(tree.depths):
                if depth < short:
                    rows += [i] * len(eos)
                    cols += eos
        longer = [w for w in job.bad_words if len(w) > 1]
        if longer:
            context = job.ids[-max(len(w) for w in longer):]
            for i, path in enumerate(path_tokens(tree.parents, tokens)):
                seq = context + path
                for word in longer:
                    k = len(word) - 1
                    if len(seq) >= k and seq[len(seq) - k:] == word[:-1]:
                        rows.append(i)
                        cols.append(word[-1])
        return singles, rows, cols

    @staticmethod
    def _masks_any(masked: tuple[list[int], list[int], list[int]], best: list[int]) -> bool:
        """Whether a row's argmax is an entry `masked` masks: if none is, each row's argmax with the masks applied is
        the same token (masking only lowers entries, and a lower index than an unmasked first maximum holds a
        smaller value), so a greedy request keeps the forward's own argmax and writes nothing. Why: masking the
        rows and reducing them again in numpy cost 0.08 ms a step at batch 1 and 0.2 ms at batch 8 with `min_length`
        (bf16dot, Intel Xeon AMX; a benchmark's fixed-length requests)."""
        singles, rows, cols = masked
        return bool(set(singles).intersection(best)) or any(best[r] == c for r, c in zip(rows, cols, strict=True))

    @staticmethod
    def _constrain(logits: torch.Tensor, masked: tuple[list[int], list[int], list[int]]) -> torch.Tensor:
        """The logits with `masked`'s entries at -inf: verification uses this same distribution, so it stays
        lossless. In place: the rows are this request's share of the step's logits, read by nothing else (a copy of
        a batch-8 step's rows cost ~30 us a request)."""
        singles, rows, cols = masked
        # numpy's indexed writes: a torch one cost ~0.1 ms in the loop, on the caches a forward had just flushed
        out = logits.numpy() if logits.dtype == torch.float32 else logits
        if singles:
            out[:, singles] = float("-inf")
        if rows:
            out[rows, cols] = float("-inf")
        return logits

    def _accept(self, v: Verified, info: StepInfo, best: list[int] | None = None) -> None:
        """Verify one request's tree against the target's logits (`best`: their argmax per row before any mask,
        computed already for a greedy request), then commit, learn and check its stop conditions."""
        cand, tree, order, tokens, token_list, features = v.cand, v.tree, v.order, v.tokens, v.token_ids, v.features
        job, trie, stats = cand.job, cand.trie, cand.job.stats
        logits, masked = v.logits, self._masked(job, tree, token_list)
        if job.logprobs is not None:  # the reported distribution is the masked one: every mask is written
            best = None
        if job.penalties is not None and job.penalties.active:  # before the masks: a masked entry stays -inf
            logits, best = penalize(logits, job.penalties, job.prompt_ids, job.out, tree.parents, token_list), None
        if masked is not None and (best is None or self._masks_any(masked, best)):
            logits, best = self._constrain(logits, masked), None
        if v.masks is not None and (best is None or banned_rows(v.masks, best)):  # else each argmax is allowed
            logits, best = mask_logits(logits, v.masks), None
        stats.target_passes += 1
        stats.proposed += len(tree) - 1
        stats.verified.append(len(tree))
        if job.params.greedy:
            path, bonus = greedy_accept(tree, token_list, best if best is not None else argmax_rows(logits))
        else:
            q = None
            if cand.q:  # sampled static children: each node's draft distribution (rows never read: any valid one)
                fallback = next(iter(cand.q.values()))
                q = torch.stack([cand.q.get(i, fallback) for i in order])
            point = [trie.point[i] for i in order] if cand.q else None
            sampled = [trie.sampled[i] for i in order] if cand.q else None
            path, bonus = verify_sampled(tree, tokens, sampling_probs(logits, job.params), q, job.verify_gen,
                                         point, sampled)
        realized = None
        if cand.drafted:  # what the draft alone brought this step and the rows it took: nodes only it offered (in a
            # drafted dynamic trie every node but the root is the draft's or the suffix index's). Why a set: a set of
            # proposer kinds per node cost ~4 us a request a step (line_profiler, batch 8)
            suffixed = cand.suffixed
            realized = (sum(order[i] not in suffixed for i in path[1:]), sum(i not in suffixed for i in order[1:]))
        self.controller.learn(cand, len(path) - 1, realized)
        if self.record:
            on_path = set(path)
            for i in range(1, len(tree)):
                for kind, key in cand.keys.get(order[i], ()):
                    stats.trace.append((kind, key, tree.parents[i] in on_path, i in on_path))
        self.target_caches[job.slot].compact(path)
        if self.drafter is not None and self.controller.drafts(job):
            self.drafter.accept(job.slot, trie, order, path)
            if features is not None:  # the accepted rows' target features: the head's next inputs. A path of the
                # first rows (every plain step, every chain) is a view; else numpy's take: torch's index op opened an
                # OpenMP team for 3 rows (py-spy, batch 1 bf16: ~60 us a step)
                if path[-1] != len(path) - 1:
                    rows = torch.from_numpy(features.numpy()[path])
                else:  # all rows (a plain step: no slicing op) or the first ones
                    rows = features if len(path) == features.shape[0] else features[:len(path)]
                self.drafter.take(job.slot, cand.position, rows)
        limit = min(job.max_new_tokens, self.max_seq_len - len(job.prompt_ids))
        new = ([token_list[i] for i in path[1:]] + [bonus])[:limit - len(job.out)]
        eos = job.eos_ids if job.eos_ids is not None else self.eos_ids
        finish, emitted = None, len(new)  # emitted counts an end-of-sequence token too (a target pass made it)
        eos_at = next((j for j, tok in enumerate(new) if tok in eos), None)
        stop_end = None
        if job.stop_words:  # a stop sequence completed before any end-of-sequence token ends the output after it
            longest = max(len(w) for w in job.stop_words)
            # max(.., 0): with fewer output tokens than the word minus one, a negative start kept too few of them
            tail = job.out[max(len(job.out) - longest + 1, 0):] if longest > 1 else []
            stop_end = stop_token_end(tail, new if eos_at is None else new[:eos_at], job.stop_words)
        if stop_end is not None:
            new, finish, emitted = new[:stop_end], "stop", stop_end
        elif eos_at is not None:
            job.end_token = new[eos_at]
            new, finish, emitted = new[:eos_at], "stop", eos_at + 1
        stats.emitted_tokens += emitted
        # accepted tokens it kept: a path past its end-of-sequence token, stop word or length limit is cut (what the
        # draft got right, the controller learned from the whole path above)
        stats.accepted.append(min(len(path) - 1, emitted))
        if job.logprobs is not None and new:  # token j of `new` came from row path[j]
            job.logprob_rows.extend(token_logprobs(logits, path[:len(new)], new, job.logprobs))
        job.out.extend(new)
        job.ids.extend(new)
        if job.grammar is not None and finish is None:
            job.grammar.advance(new)
        if job.suffix:
            self.suffix.accept(job.slot, new)
        if finish is None and len(job.out) >= limit:
            finish = "length"
        if new:
            info.emitted.append((job, new))
        if finish is not None:
            self._release(job, finish)
            info.finished.append(job)
