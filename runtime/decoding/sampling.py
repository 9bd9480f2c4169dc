"""Request sampling distributions and lossless verification of a sampled draft tree (pure tensor functions).

The target decides: every emitted token is distributed exactly as if the target had sampled it from
`sampling_probs(target_logits, params)` one token at a time, whatever the draft proposed. Two ways of
choosing a node's children are supported, and the verifier must be told which one was used:

- deterministic children (`torch.topk(q, k).indices`, EAGLE style): verify with `q=None`;
- children drawn without replacement from the draft distribution q (`draw_children`, Sequoia style):
  verify with that same q.

Verification randomness comes only from the generator handed to the verifier; drafting must use a
different generator, otherwise the draft tokens and the accept tests share random numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from .tree import Tree

MIN_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily: logits / T overflows float32 for tiny T (1e-40 gives +-inf and NaN
probabilities), and at T = 1e-5 a token 1e-3 logits below the top one already has probability e^-100."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings; temperature 0 (or below MIN_TEMPERATURE, stored as 0) means greedy decoding.

    Validated here, so the CLI, the decoder and the Triton model all refuse the same bad values.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)  # frozen dataclass: normalized once, here
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = disabled), got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@cache
def host_kernels():
    """The native module (its host helpers: `top_tokens`, the suffix index, the budget's arithmetic) where it builds
    here, else None (the Python references). Resolved once a process: `load_kernels` re-reads the environment and the
    CPU's flags (~7 us warm)."""
    from spectrt.runtime.engines.kernels import load_kernels

    return load_kernels()


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first index on ties, as `torch.argmax`). numpy's reduction is ~12x faster than torch's
    on 49k-wide fp32 rows here (0.02 vs 0.25 ms for 4 rows, 2 threads): a cost every decode step pays. (A native
    one was no faster in the loop: it reads the rows from memory as numpy does.)"""
    return host_array(logits).argmax(-1).tolist()


def host_array(t: torch.Tensor) -> np.ndarray:
    """An fp32 tensor's numpy view without a torch op where it is one already (the engines' logits are plain fp32
    tensors: `detach().float()` dispatched two ops on cold caches for nothing), else a converted copy."""
    if t.dtype == torch.float32 and not t.requires_grad:
        return t.numpy()
    return t.detach().float().numpy()


def top_tokens(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The k best tokens per row of logits [M, V] (ties to the lower id) and their softmax probabilities: the native
    helper where it builds (the same ids, probabilities within ~1e-6), else `top_tokens_reference`. Why native: in
    the loop, on the caches a forward has just flushed, the numpy reference took ~0.18 ms a draft level at batch 1
    (bf16, one 8,192-wide row of the EAGLE-3 head; 0.03 ms warm)."""
    native = host_kernels()
    if native is not None:
        rows = logits if logits.dtype == torch.float32 and not logits.requires_grad and logits.is_contiguous() \
            else logits.detach().float().contiguous()
        return native.top_tokens(rows, k)
    return top_tokens_reference(logits, k)


def top_tokens_reference(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """k rounds of numpy argmax on a copy: 0.04 ms for k = 3 on two 49k-wide rows, against 0.18 ms for `torch.topk`.
    The normalizer is numpy's too, shifted by the row maximum the first round found: `torch.logsumexp` cost 0.31 ms
    a draft level at batch 1 (bf16, the EAGLE-3 head: a fifth of the step's host work), this ~0.1 ms.
    """
    rows = host_array(logits)
    work, ids = rows.copy(), []
    index = np.arange(len(rows))
    for _ in range(k):
        best = work.argmax(-1)
        ids.append(best)
        work[index, best] = -np.inf
    top = np.stack(ids, -1)
    peak = rows[index, top[:, 0]][:, None]
    np.subtract(rows, peak, out=work)  # exp(row - max) in the scratch copy: no second allocation
    np.exp(work, out=work)
    lse = peak + np.log(work.sum(-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    probs = np.exp(np.take_along_axis(rows, top, -1) - lse)
    return top.tolist(), probs.tolist()


MAX_TOP_LOGPROBS = 20  # the OpenAI API's bound on top_logprobs


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], top: int
                   ) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per emitted token: its log-probability under the row of `logits` that produced it and that row's `top` most
    likely tokens (log-probability descending, ties to the lower id). `logits` are the target's after logit bias,
    penalties and constraints, before temperature: the distribution the OpenAI API's `logprobs` report. Each row is
    normalized alone, in fp32, so a row's values do not depend on how many rows its step verified: speculation
    reports what the target alone reports."""
    out = []
    for row, token in zip(rows, tokens, strict=True):
        lp = torch.log_softmax(logits[row].float(), -1)
        entries = []
        if top:
            values, ids = torch.topk(lp, min(top + 8, lp.shape[0]))  # a margin for ties at the k-th value
            entries = sorted(zip(ids.tolist(), values.tolist(), strict=True), key=lambda e: (-e[1], e[0]))[:top]
        out.append((float(lp[token]), entries))
    return out


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from, [..., V] -> [..., V]: temperature, then top-k, then top-p.

    Temperature 0 gives the one-hot argmax (first index on ties, like `torch.argmax`), so the sampled
    path degenerates to greedy decoding exactly. Top-k keeps every token tied with the k-th logit; top-p
    keeps the smallest prefix of the sorted distribution reaching `top_p`, always at least the top token.
    """
    dtype = torch.promote_types(logits.dtype, torch.float32)
    logits = logits.to(dtype)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(dtype)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1:
        probs = _nucleus(probs, params.top_p)
    return probs


NUCLEUS_CANDIDATES = 1024  # a nucleus is almost always among a row's top 1,024 tokens


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [..., V] kept on the smallest prefix of its sorted distribution reaching `top_p`, renormalized.

    The prefix is found among the top `NUCLEUS_CANDIDATES` (then 8x as many) tokens when they already hold `top_p`
    (a partial top-k: ~0.3 ms against 4 ms for sorting a 49k-wide row on this CPU, a cost every sampled token paid),
    else by the full sort; all give the same prefix (same tokens in the same order, so the same running sums)."""
    for k in (NUCLEUS_CANDIDATES, 8 * NUCLEUS_CANDIDATES, probs.shape[-1]):
        if k >= probs.shape[-1]:
            top, order = probs.sort(dim=-1, descending=True)
            break
        top, order = probs.topk(k, dim=-1)
        if bool((top.sum(-1) >= top_p).all()):
            break
    keep_sorted = top.cumsum(-1) - top < top_p  # the mass before it does not suffice yet
    kept = torch.zeros_like(probs).scatter(-1, order, torch.where(keep_sorted, top, 0.0))
    return kept / kept.sum(-1, keepdim=True)


def draw_children(q: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """k distinct tokens per row of q [M, V], drawn without replacement in draw order -> [M, k].

    Gumbel-top-k on log q, which is sequential sampling without replacement. A row with fewer than k
    tokens of positive mass first yields all of those, then fills the remaining slots with untried
    zero-mass tokens drawn uniformly without replacement: that is exactly the "uniform over untried
    tokens once the draft mass is used up" rule `verify_sampled` applies, so the tree keeps its fixed
    shape, every slot holds a real token, and verification stays exact (the filler tokens are accepted
    only through the target's own residual mass).
    """
    vocab = q.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k={k} children per node must be in [1, {vocab}] (the vocabulary size)")
    dtype = torch.promote_types(q.dtype, torch.float32)
    u = torch.rand(q.shape, generator=generator, device=q.device, dtype=dtype)
    gumbel = -(-u.clamp(min=torch.finfo(dtype).tiny).log()).log()
    has_mass = q > 0
    neg_inf = torch.tensor(float("-inf"), device=q.device, dtype=dtype)
    by_mass = torch.where(has_mass, q.to(dtype).log() + gumbel, neg_inf).topk(k, dim=-1).indices
    filler = torch.where(has_mass, neg_inf, gumbel).topk(k, dim=-1).indices
    slot = torch.arange(k, device=q.device)
    n_mass = has_mass.sum(-1, keepdim=True)
    filler = filler.gather(-1, (slot - n_mass).clamp(min=0))
    return torch.where(slot < n_mass, by_mass, filler)


def verify_sampled(
    tree: Tree,
    tokens: list[int] | torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    point: list[bool] | torch.Tensor | None = None,
    sampled: list[bool] | torch.Tensor | None = None,
) -> tuple[list[int], int]:
    """Lossless verification of one draft tree: accepted node indices (root first) and the emitted token.

    `tokens[i]` is node i's token, `p[i]` [N, V] the target's `sampling_probs` after node i and `q[i]`
    the draft distribution node i's children were drawn from without replacement (`None` for
    deterministic top-k children); `point` / `sampled` [N] flag a merged tree's mixed children (see
    `verify_sampled_batch`). Same return convention as `greedy_accept`; a thin wrapper around
    `verify_sampled_batch`.
    """
    tokens = torch.as_tensor(tokens, device=p.device)
    flags = [None if f is None else torch.as_tensor(f, dtype=torch.bool)[None] for f in (point, sampled)]
    path, token = verify_sampled_batch(tree, tokens[None], p[None], None if q is None else q[None], generator, *flags)
    return [i for i in path[0].tolist() if i >= 0], int(token[0])


def verify_sampled_batch(
    tree: Tree,
    tokens: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    point: torch.Tensor | None = None,
    sampled: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify B trees of one topology at once: tokens [B, N], p and q [B, N, V].

    Returns the accepted paths [B, max_depth + 1] (node indices, root first, padded with -1) and the
    emitted tokens [B] (the residual sample after a rejection, or the bonus token after a leaf).
    Walks down one depth at a time, trying the children of each row's current node in order:
    - `q` given (children drawn without replacement from q): accept x if r < R[x] / D[x]; on rejection
      R <- normalize(max(R - D, 0)) and D <- q without the tried tokens, renormalized (uniform over the
      untried tokens once that mass is gone);
    - `q is None` (deterministic children): accept x with probability R[x]; on rejection R[x] <- 0,
      renormalized; repeated tokens are skipped. This is "sample y ~ p, follow the child holding y".
    A row whose children are all rejected, or which reaches a leaf, emits y ~ R. The residual arithmetic
    runs in float64. Raises ValueError if a child could not have been drawn from q (zero draft mass).

    Mixed children (a merged tree): bool flags `point` and `sampled` [B, N] say which nodes are point-mass
    candidates (suffix matches, top-k) and which were drawn without replacement from their parent's q
    (default: all point when q is None, all sampled otherwise). At each node the point children are tried
    first with the point-mass rule, then the sampled children by recursive rejection against the residual
    left by the point phase, with D = q (the draw did not depend on the point candidates). Each phase
    turns a correct residual into a correct residual, so the emitted token is exactly ~ p. A node that is
    both (a suffix token the draft also drew) is tried in both phases: in the second its R is 0, so it is
    rejected and D drops its mass, as the draw order requires.
    """
    batch, n_nodes, vocab = p.shape
    if (
        len(tree) != n_nodes
        or tuple(tokens.shape) != (batch, n_nodes)
        or (q is not None and q.shape != p.shape)
    ):
        raise ValueError(
            f"tokens {tuple(tokens.shape)}, p {tuple(p.shape)} and q must be [B, N], [B, N, V] and "
            f"[B, N, V] (or None) with N={len(tree)} tree nodes"
        )
    device = p.device
    if n_nodes == 1:  # a root alone (plain sampled decoding): the walk below reduces to one draw from p
        # Why a shortcut: with the walk's per-depth buffers (residual, tried masks, emit row) verification took 14%
        # of a batch-32 sampled generation (py-spy, bf16, Zen 4: ~0.5 ms a row). Same arithmetic, one uniform a row.
        path = torch.zeros(batch, 1, dtype=torch.long, device=device)
        return path, draw(_normalize(p[:, 0].double()), generator)
    rows = torch.arange(batch, device=device)
    tokens = tokens.to(device=device, dtype=torch.long)
    full = torch.ones(batch, n_nodes, dtype=torch.bool, device=device)
    point = (full if q is None else ~full) if point is None else point.to(device)
    sampled = (~full if q is None else full) if sampled is None else sampled.to(device)
    if q is None and sampled.any():
        raise ValueError("nodes flagged as sampled need the draft distribution q they were drawn from")
    width = max(len(c) for c in tree.children)
    kids = torch.tensor([c + (-1,) * (width - len(c)) for c in tree.children], device=device)
    node = torch.zeros(batch, dtype=torch.long, device=device)
    live = torch.ones(batch, dtype=torch.bool, device=device)
    path = torch.full((batch, tree.max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    emit_from = torch.zeros(batch, vocab, dtype=torch.float64, device=device)
    impossible = torch.zeros(batch, dtype=torch.bool, device=device)
    vocab_ids = torch.arange(vocab, device=device)
    phases = [(is_point, flags) for is_point, flags in ((True, point), (False, sampled)) if flags.any()]
    for depth, level in enumerate(tree.levels):
        resid = _normalize(p[rows, node].double())
        if q is not None:
            q_node = _normalize(q[rows, node].double())
            draft = q_node
        tried_point = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        tried = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        nxt = node
        for is_point, flags in phases:
            for slot in range(max(len(tree.children[i]) for i in level)):
                child = kids[node, slot]
                x = tokens[rows, child.clamp(min=0)]
                try_it = live & ~moved & (child >= 0) & flags[rows, child.clamp(min=0)]
                r = torch.rand(batch, generator=generator, device=device, dtype=torch.float64)
                r_x = resid[rows, x]
                if is_point:
                    try_it &= ~tried_point[rows, x]
                    accept = try_it & (r < r_x)
                    new_resid = _renormalize_or_keep(resid.scatter(1, x[:, None], 0.0), resid)
                else:
                    d_x = draft[rows, x]
                    impossible |= try_it & (d_x <= 0)
                    accept = try_it & (r * d_x < r_x)  # r < R[x] / D[x] without dividing by zero
                    new_resid = _renormalize_or_keep(_residual(resid, draft), resid)
                reject = (try_it & ~accept)[:, None]
                resid = torch.where(reject, new_resid, resid)
                if is_point:
                    tried_point = tried_point | (reject & (vocab_ids == x[:, None]))
                else:
                    tried = tried | (reject & (vocab_ids == x[:, None]))
                    draft = torch.where(reject, _untried(q_node, tried), draft)
                moved |= accept
                nxt = torch.where(accept, child, nxt)
        stop = live & ~moved
        emit_from = torch.where(stop[:, None], resid, emit_from)
        if depth < tree.max_depth:
            path[:, depth + 1] = torch.where(moved, nxt, -1)
        node, live = nxt, moved
    if impossible.any():
        raise ValueError(
            "a child token has zero draft probability: with q given, children must be drawn "
            "from q without replacement (draw_children); pass q=None for top-k children"
        )
    return path, draw(emit_from, generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of `probs` [B, V] (nonnegative, any scale), by the inverse CDF of one uniform each: exact,
    and ~50 us a 49k-wide float64 row against 1.2 ms for `torch.multinomial` (every sampled token pays it). A
    zero-mass token is never drawn: its running sum equals its predecessor's."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(len(probs), 1, generator=generator, device=probs.device, dtype=torch.float64)
    token = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp(max=probs.shape[-1] - 1)
    if not bool((probs.gather(1, token[:, None]) > 0).all()):  # u * sum rounded up to the total: the last with mass
        token = torch.minimum(token, probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1))
    return token


def _normalize(probs: torch.Tensor) -> torch.Tensor:
    return probs / probs.sum(-1, keepdim=True)


def _renormalize_or_keep(mass: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Normalize rows of `mass`; a row with no mass left only arises from a rejection whose probability
    was at rounding level, so it keeps its previous distribution instead of becoming NaN."""
    total = mass.sum(-1, keepdim=True)
    return torch.where(total > 0, mass / torch.where(total > 0, total, 1.0), fallback)


def _residual(resid: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """What the target still owes after a draft token was rejected (unnormalized)."""
    return (resid - draft).clamp(min=0)


def _untried(q_node: torch.Tensor, tried: torch.Tensor) -> torch.Tensor:
    """The draft distribution of the next sibling: q without the tried tokens, or uniform over the
    untried tokens once q's mass is used up (matching `draw_children`)."""
    rest = q_node.masked_fill(tried, 0.0)
    total = rest.sum(-1, keepdim=True)
    uniform = (~tried).double()
    uniform = uniform / uniform.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(total > 0, rest / torch.where(total > 0, total, 1.0), uniform)
