"""The speculation controller: every decision about how much to speculate, apart from the loop that runs steps.

`Decoder` runs a step (prefill chunks, one target forward, acceptance); this decides what the step verifies. Per
step, `plan` gives each decoding job its candidates: a static tree (cut to the step's tree budget), suffix
candidates, the draft's levels when its pass pays (`_gate`, from each job's learned draft gain), and then the one
budget (`policy.allocate` over scaled scores: `Candidates.scaled_scores`) that picks how many of each trie's best
nodes to verify. After verification `learn` moves the job's own estimates: its score scale (accepted over expected
tree tokens) and its draft gain (tokens only the draft got accepted). Both are per job, so one tenant's hot sampled
requests never shrink another's trees. (A seeded sampled request with dynamic trees draws from the same exact
distribution in any batch, but not the same tokens: the budget sizes its tree at the batch's cost, and the draws
follow the tree's shape. Static trees draw alike in any batch.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from spectrt.runtime.decoding.policy import (
    CONTEXT_BUCKET,
    DraftingCost,
    Policy,
    allocate,
    allocation_gain,
    choose_drafted,
    drafted_rate,
)
from spectrt.runtime.decoding.propose import Candidates, DraftProposer, SuffixProposer
from spectrt.runtime.decoding.tree import AUTO, TokenTrie, Tree, cut_tree, shaped
from spectrt.runtime.engines.engine import Segment

if TYPE_CHECKING:
    from spectrt.runtime.decoding.decoder import Job

SCALE_PRIOR = 4.0  # pseudo-tokens behind a job's score scale's start at 1 (the tuned calibration taken as right)
SCALE_DECAY = 0.98  # per dynamic tree the job verified: its scale follows its last ~50 steps
DRAFT_GAIN_PRIOR_STEPS = 4.0  # pseudo-steps of the policy's expected draft gain behind a job's estimate
DRAFT_GAIN_DECAY = 0.95  # per drafted step: a job's estimate follows its last ~20 drafted steps
DRAFT_GAIN_FORGET = 0.98  # per step not drafted: old evidence fades (half in ~35 steps) back to the prior
IDLE_STEPS = 2  # steps in a row whose candidates the budget left unverified before a job holds (`plan`)
HOLD_STEPS = 4  # steps of a job's first hold: it decodes plainly without proposing, then proposes once again
MAX_HOLD_STEPS = 32  # each further hold in a row doubles, up to this


class Controller:
    """How much each step speculates, for the jobs of one `Decoder` (its policy, proposers and bounds)."""

    def __init__(self, policy: Policy, drafter: DraftProposer | None, suffix: SuffixProposer, max_seq_len: int,
                 max_tree_tokens: int, tree_budget: int):
        self.policy, self.drafter, self.suffix = policy, drafter, suffix
        self.max_seq_len, self.max_tree_tokens, self.tree_budget = max_seq_len, max_tree_tokens, tree_budget
        self._short: tuple[Policy, Policy] | None = None  # (policy, its first level alone): `_first_level`
        self._costs: dict[tuple, tuple[Policy, DraftingCost]] = {}  # `_drafting_cost`'s, once per policy and shape
        self._costs_of: Policy | None = None  # the policy `_costs` were made under (its first level's too)

    def start(self, job: Job) -> None:
        """A new job's speculation state: suffix candidates (the policy's choice for AUTO) and fresh estimates."""
        if job.suffix is None:
            job.suffix = job.tree == AUTO and self.policy.suffix
        job.draft_gain, job.draft_rows = self.policy.expected_draft_gain, self._prior_rows()  # `learn_draft_gain`
        job.draft_evidence = (0.0, 0.0, 0.0)
        job.score_evidence = (SCALE_PRIOR, SCALE_PRIOR)  # `Job.score_scale`
        job.idle, job.hold, job.holds = 0, (0, 0), 0

    def drafts(self, job: Job) -> bool:
        """Whether the job's trees come from the draft (a static tree, or AUTO with the policy's draft on)."""
        if isinstance(job.tree, Tree):
            return len(job.tree) > 1
        return job.tree == AUTO and self.policy.draft and self.policy.depth > 0

    def plan(self, decode: list[Job], draft_prefill: list[Segment], prefilling: int) -> list[Candidates]:
        """This step's candidates for every decoding job: suffix first for dynamic trees, the draft (gated by
        whether it can pay), then the budget: how many of each dynamic trie's best nodes to verify (`cand.chosen`).

        The cost weighed is the batched forward of every active job at their mean context, the `prefilling` ones
        counted as the plain row and token they are about to take, not as their prompt chunks. Why: a chunk is paid
        anyway and emits nothing, so counting it made speculative rows look cheap next to the step's few tokens per
        ms (each new request's prefill at batch 8 drafted and verified more for everyone in that step).

        A job on hold (`_idle`) takes the step plainly: no candidates, no gate, one row and one token in the budget."""
        policy = self.policy
        context = sum(len(j.ids) for j in decode) // max(len(decode), 1)
        verify = policy.verify_at(max(len(decode) + prefilling, 1), context)
        draft_cost = policy.draft_at(context)
        static_jobs = [j for j in decode if isinstance(j.tree, Tree)]
        static_total = sum(len(j.tree) for j in static_jobs)
        share = max(1, self.tree_budget // max(len(decode), 1))
        cands, held = [], []
        for job in decode:
            root = len(job.ids) - 1  # the root is the last accepted token, at position len(ids) - 1
            cand = Candidates(job, TokenTrie(job.ids[-1]), root)
            room = self._room(job)
            if isinstance(job.tree, Tree):
                tree = job.tree if static_total <= self.tree_budget else cut_tree(job.tree, share)
                if tree.max_depth > room:  # the levels within the room: a breadth-first prefix (`cut_tree` keeps
                    # its count of nodes by rank, the top-1 chain to full depth first)
                    tree = shaped(tree.parents[:sum(d <= room for d in tree.depths)])
                cand.static, cand.budget = tree, len(tree)
            elif self._holds(job, len(decode)):  # a plain step: no proposing, no gate, no budget
                held.append(cand)
                continue
            else:
                cand.policy = policy
                spec = job.tree == AUTO or job.suffix
                # `budget` bounds the draft's tree; suffix candidates cost no forward and may add up to suffix_depth
                # nodes when their own scores pay for the larger verify (measured: a 4-node cap held the repetitive
                # set at 1.47x AR while suffix candidates alone reached 1.62x)
                size = max(policy.budget, 1 + policy.suffix_depth) if job.suffix else policy.budget
                cand.budget = min(size, self.max_tree_tokens, room + 1) if spec else 1
                if job.suffix:
                    self.suffix.propose(cand, policy, cand.budget - 1)
            cands.append(cand)
        for cand in held:
            if self.drafts(cand.job):
                self.learn_draft_gain(cand.job, None)  # as a step the gate left undrafted: its evidence fades
        plain = prefilling + len(held)  # rows of one token each, like the requests still prefilling
        static_rows = sum(len(c.static) for c in cands if c.static is not None)
        dynamic = [c for c in cands if c.static is None]
        # the step's tree rows beyond every decoding job's root and the static shapes (`tree_budget`, over all jobs)
        rows_left = self.tree_budget - len(held) - len(dynamic) - static_rows
        sunk = 0.0
        if self.drafter is not None:
            drafting = [c for c in cands if self.drafts(c.job) and (c.static is None or len(c.static) > 1)]
            drafting = self._gate(drafting, dynamic, static_rows, plain, verify, context, len(decode))
            if drafting or draft_prefill:
                sunk = self.drafter.propose(drafting, draft_prefill, verify, draft_cost, static_rows, plain)
        for cand in cands:  # static trees: suffix candidates merged after the shape (trie node i = tree node i)
            if cand.static is not None:
                cand.budget = len(cand.trie)
                if cand.job.suffix:
                    self.suffix.propose(cand, policy, min(self.max_tree_tokens - len(cand.static),
                                                          self._room(cand.job), max(rows_left, 0)))
                    rows_left -= len(cand.trie) - cand.budget
                    cand.budget = len(cand.trie)
        sizes, _ = allocate([c.scaled_scores() for c in dynamic], [c.budget for c in dynamic], sunk, verify,
                            sum(len(c.trie) for c in cands if c.static is not None), plain, max(rows_left, 0))
        for cand, size in zip(dynamic, sizes, strict=True):
            cand.chosen = size
            cand.expected = sum(cand.scores[:size - 1])
            if cand.budget > 1:
                self._idle(cand, len(decode))
        return cands + held

    def _room(self, job: Job) -> int:
        """The deepest node worth verifying for the job: a path of depth d emits d + 1 tokens (its bonus token), and
        the job may emit only what its `max_new_tokens` and `max_seq_len` leave; deeper nodes only waste rows."""
        return min(job.max_new_tokens, self.max_seq_len - len(job.prompt_ids)) - len(job.out) - 1

    @staticmethod
    def _holds(job: Job, batch: int) -> bool:
        """Whether a job decodes this step plainly without proposing (its hold; see `_idle`). A batch smaller than
        when the hold began ends it: rows got cheaper, so its candidates may pay again."""
        left, since = job.hold
        if left > 0 and batch >= since:
            job.hold = (left - 1, since)
            return True
        if left > 0:  # ended early: the next hold starts short again
            job.holds = 0
        job.hold = (0, 0)
        return False

    @staticmethod
    def _idle(cand: Candidates, batch: int) -> None:
        """After the budget: a job whose candidates it left unverified `IDLE_STEPS` steps in a row holds for
        `HOLD_STEPS` steps, proposing nothing, then proposes once again and, still unverified, holds twice as long
        (up to `MAX_HOLD_STEPS`); a verified candidate or a smaller batch starts it over. Only in a batch (alone, a
        row is cheap and a step without candidates proposes little). Why: at batch 8 the budget verified almost
        nothing (7.07 tokens a step against plain decoding's 7.01) while proposing for every request cost +0.16 ms a
        step (the gate, suffix lookups, tries), so speculation lost to plain batched decoding by its host work alone;
        with fixed 4-step holds a job still proposed every fifth step (+0.08 ms a step at batch 8 against plain's
        proposing share, `scripts/batch_vs_plain.py`). Greedy output is unchanged (every tree is verified exactly);
        the suffix index and a head's pending features keep following the tokens while a job holds."""
        job = cand.job
        job.idle = job.idle + 1 if cand.chosen == 1 and not cand.drafted and batch > 1 else 0
        if job.idle == 0:
            job.holds = 0
        elif job.idle >= IDLE_STEPS:
            job.hold = (min(HOLD_STEPS << min(job.holds, 8), MAX_HOLD_STEPS), batch)
            job.holds += 1

    def draft_may_pay(self, active: int, context: int) -> bool:
        """Whether one request's draft, at the policy's expected gain, pays for its pass at this load: else a prompt
        is not fed to the draft while it is prefilled (at batch 8 the draft never ran, but reading the prompts cost
        1.4 ms a step, 5%); a request that later drafts catches up then, a window per step."""
        policy = self.policy
        verify = policy.verify_at(active, context)
        if choose_drafted([policy.expected_draft_gain], [self._prior_rows()], [1 + policy.depth], float(active),
                          active, verify, self._drafting_cost(context, 1)):
            return True
        short = self._first_level()
        return short is not None and bool(choose_drafted([short.expected_draft_gain], [1.0], [2.0], float(active),
                                                         active, verify, self._drafting_cost(context, 1, short)))

    def _first_level(self) -> Policy | None:
        """The policy cut to its draft's first level (its tuned gain `first_level_gain`, a level's share of the host
        work: most of it is per level, children, feeding and tries), for steps where only that pays (`_gate`); None
        for a policy of one level or an untuned one."""
        policy = self.policy
        if policy.depth < 2 or not policy.draft_gain or not policy.first_level_gain:
            return None
        if self._short is None or self._short[0] is not policy:
            more = None if policy.host_more_ms is None else policy.host_more_ms / policy.depth
            self._short = (policy, replace(policy, depth=1, draft_gain=policy.first_level_gain,
                                           host_ms=policy.host_ms / policy.depth, host_more_ms=more))
        return self._short[1]

    def _drafting_cost(self, context: int, segments: int, policy: Policy | None = None) -> DraftingCost:
        """`Policy.drafting_cost` (the gate's price of a drafting step, and why), made once per policy, context bucket
        and batch: building its curves and native twins each step cost more than the arithmetic they serve."""
        if self._costs_of is not self.policy:  # the loop's policy changed (`Decoder.run(policy=...)`, the tuner)
            self._costs.clear()
            self._costs_of = self.policy
        policy = policy or self.policy
        key = (id(policy), -(-context // CONTEXT_BUCKET), segments)
        found = self._costs.get(key)
        if found is None or found[0] is not policy:
            found = self._costs[key] = (policy, policy.drafting_cost(context, segments))
        return found[1]

    def _prior_rows(self) -> float:
        """Verified rows the policy's expected draft gain comes with, before a job's own steps say: a tuned gain
        (`tune`: a tree of the budget's rows) comes mostly from its best path, one row a level, so `depth` rows; an
        untuned policy's sure token is one row. Measured (bf16, Intel Xeon, `scripts/batch_vs_plain.py`, 6 rounds):
        one row (before) drafted every request at batch 8, 0.93x plain; the budget's rows (budget - 1) stopped it
        there but starved batch 4 (0.90x, against 1.02x before); depth rows: batch 4 1.04x, batch 8 0.99x."""
        policy = self.policy
        return float(max(policy.depth, 1)) if policy.draft_gain is not None else 1.0

    def _catch_up(self, job: Job) -> float:
        """Draft rows a drafting step costs the job: a steady step reads its accepted tokens (1 + depth at most); a
        backlog beyond that (the draft was off, or skipped the prompt) is paid once, so it is charged spread over the
        drafting steps the job has left. Why: charging it whole kept a lagging draft off for good (the EAGLE-3 head
        after a long prefill); ignoring it paid 150-token backlogs for the last two steps of a batch (64-row draft
        calls at ~20 ms, bf16)."""
        lag, steady = self.drafter.lag(job.slot, job.ids), 1 + self.policy.depth
        left = self._room(job) + 1  # tokens the job may still emit
        steps = max(left / (1 + job.draft_gain), 1.0)
        return min(lag, steady) + max(lag - steady, 0) / steps

    def _gate(self, drafting: list[Candidates], dynamic: list[Candidates], base_rows: int, plain: int,
              verify: Callable[[int], float], context: int, batch: int) -> list[Candidates]:
        """The dynamic jobs whose draft pays this step for its pass and the rows it adds (`policy.choose_drafted`);
        static trees always draft (their shape is the caller's explicit choice).

        Each job's expected draft gain and the verified rows it comes with (`Job.draft_gain`, `Job.draft_rows`) are
        learned from its own steps (`learn_draft_gain`). Why:
        a bound of "a sure token per request" let the draft run at batch 8 where the budget then verified ~0.3 of its
        nodes per request (0.80x plain batched decoding, bf16). Only the job's own evidence moves it, not what other
        requests did before it. A backlog is charged spread over the steps left (`_catch_up`).

        The step may also draft its jobs' first level alone (`_first_level`: the tuned first-level share of each
        gain, one row a job, no level passes), whichever of the two choices expects more tokens per ms; the
        proposer then stops those jobs after one level. Why: where rows are cheap but every pass and each drafted
        request's host work are not (bf16dot on AMX tiles, Intel Xeon, batch 8), the whole tree's charge kept the
        draft off, 0.99x plain batched decoding, while drafting one level ran 1.05x (four rounds each, 1.03-1.08x
        a round, `scripts/batch_vs_plain.py --alt-policy` with the policy cut to depth 1)."""
        grow = [c for c in drafting if c.static is None]
        if not grow:
            return drafting
        caps = [min(self.policy.budget, c.budget) for c in dynamic]  # the draft's own tree bound
        scores = [c.scaled_scores() for c in dynamic]
        sizes, _ = allocate(scores, caps, 0.0, verify, base_rows, plain)
        gain = allocation_gain(scores, sizes, plain)
        catch_up = [self._catch_up(c.job) for c in grow]
        gains, gain_rows, rows = [c.job.draft_gain for c in grow], [c.job.draft_rows for c in grow], \
            base_rows + sum(sizes) + plain
        full_ms = self._drafting_cost(context, batch)
        picked = choose_drafted(gains, gain_rows, catch_up, gain, rows, verify, full_ms)
        short = self._first_level()
        if short is not None:  # the first level alone: its share of each gain, on a level's row, no level pass
            share, depth = short.draft_gain / self.policy.draft_gain, self.policy.depth
            short_gains, short_rows = [g * share for g in gains], [r / depth for r in gain_rows]
            short_ms = self._drafting_cost(context, batch, short)
            short_picked = choose_drafted(short_gains, short_rows, catch_up, gain, rows, verify, short_ms)
            if (drafted_rate(short_picked, short_gains, short_rows, catch_up, gain, rows, verify, short_ms)
                    > drafted_rate(picked, gains, gain_rows, catch_up, gain, rows, verify, full_ms)):
                picked = short_picked
                for i in picked:
                    grow[i].policy = short  # the proposer reads the step's depth from it
        chosen = set(picked)
        for i, c in enumerate(grow):
            if i not in chosen:  # not drafted: old evidence fades (explore again later)
                self.learn_draft_gain(c.job, None)
        return [c for c in drafting if c.static is not None] + [c for i, c in enumerate(grow) if i in chosen]

    def learn_draft_gain(self, job: Job, realized: tuple[int, int] | None) -> None:
        """Update a job's expected draft gain and its rows: `realized` = (tokens only the draft got accepted, verified
        rows only the draft proposed) on a drafted step, None for a step it did not draft (its evidence fades). Each
        estimate is the decayed mean of the drafted steps with `DRAFT_GAIN_PRIOR_STEPS` pseudo-steps at the policy's
        expectation (`Policy.expected_draft_gain`, tuned, and `_prior_rows`).

        Why a mean with a prior, not a moving average of the last steps: the evidence only comes from drafted steps,
        and a moving average (weight 0.3) of a per-step count this noisy (0 or 1, mean ~0.45 on chat) dipped under the
        pay-off line after two misses, and the refused steps then brought no evidence back: on held-out prompts
        the draft ran on about half the steps, bf16 1.21x AR. Rows too, because the gain per row is what pays: at
        batch 8 the budget verified ~1 draft row a request, not the tuned tree's 3."""
        tokens, rows, steps = job.draft_evidence
        if realized is None:
            tokens, rows, steps = DRAFT_GAIN_FORGET * tokens, DRAFT_GAIN_FORGET * rows, DRAFT_GAIN_FORGET * steps
        else:
            got, verified = realized
            tokens = DRAFT_GAIN_DECAY * tokens + got
            rows, steps = DRAFT_GAIN_DECAY * rows + verified, DRAFT_GAIN_DECAY * steps + 1
        job.draft_evidence = (tokens, rows, steps)
        weight = DRAFT_GAIN_PRIOR_STEPS + steps
        job.draft_gain = (DRAFT_GAIN_PRIOR_STEPS * self.policy.expected_draft_gain + tokens) / weight
        job.draft_rows = (DRAFT_GAIN_PRIOR_STEPS * self._prior_rows() + rows) / weight

    def learn(self, cand: Candidates, accepted: int, realized: tuple[int, int] | None) -> None:
        """After verification: `accepted` tree tokens of the job's trie, `realized` (of them only the draft proposed,
        verified rows only the draft proposed; None: the draft did not run for it). Moves the job's score scale
        (dynamic tries the budget chose from) and its draft gain and rows (drafted steps)."""
        job = cand.job
        if cand.static is None and cand.chosen > 1:
            expected, got = job.score_evidence
            job.score_evidence = (SCALE_DECAY * expected + cand.expected, SCALE_DECAY * got + accepted)
        if realized is not None:
            short = self._first_level()
            if short is not None and cand.policy is short:  # a first-level step, in the whole tree's terms
                realized = (realized[0] * self.policy.draft_gain / short.draft_gain, realized[1] * self.policy.depth)
            self.learn_draft_gain(job, realized)
