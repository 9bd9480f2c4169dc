"""The serving scheduler in process (no tritonserver): exactly one final response per request whatever happens,
failure isolation, deadlines, cancellation, fairness, overload, drain, text stop strings; asserted on counters and
state, never on the clock."""

from __future__ import annotations

import re
import threading

import pytest
import torch
from spectrt.runtime.decoding.decoder import AUTO, Decoder, Job, StepClock, StepInfo
from spectrt.runtime.decoding.policy import Policy
from spectrt.runtime.serving.requests import Limits, RequestError, Row, make_row
from spectrt.runtime.serving.scheduler import CounterMetrics, Overloaded, Request, Scheduler, logged_now

FLAT = Policy(budget=6, depth=2, width=2, verify_ms=((1, 1.0), (64, 1.0)), draft_ms=((1, 1e-6),))


class Sink:
    """Records every response; `events` in order, `finals` counts final responses (must end at exactly 1)."""

    def __init__(self, rows: int = 1, gone: bool = False):
        self.events, self.finals, self.gone, self.rows = [], 0, gone, rows
        self.texts = [""] * rows
        self.logprobs = [[] for _ in range(rows)]
        self.done = threading.Event()

    def cancelled(self) -> bool:
        return self.gone

    def text(self, row, delta, tokens, logprobs):
        self.events.append(("text", row, delta))
        self.logprobs[row] += logprobs
        self.texts[row] += delta

    def row_done(self, row, result, last):
        self.events.append(("row", row, result))
        if last:
            self._final()

    def fail(self, message, code):
        self.events.append(("fail", code, message))
        self._final()

    def close(self):
        self.events.append(("close",))
        self._final()

    def _final(self):
        self.finals += 1
        self.done.set()

    def result(self, row=0):
        return next(e[2] for e in self.events if e[0] == "row" and e[1] == row)


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def encode(tokenizer):
    def encode(prompt: str, chat: bool = True) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"] if chat else \
            tokenizer.encode(prompt)
        return list(ids)
    return encode


def _row(encode, tokenizer, limits=None, **fields):
    fields = {"text_input": b"Name three colors.", **fields}
    return make_row(fields, limits or Limits(), encode, lambda w: tokenizer.encode(w, add_special_tokens=False))


def _scheduler(target, draft, tokenizer, max_active=2, **kw) -> Scheduler:
    decoder = Decoder(target, draft, {tokenizer.eos_token_id}, max_seq_len=256, max_active=max_active, policy=FLAT)
    return Scheduler(decoder, tokenizer, CounterMetrics(), **kw)


def _drive(scheduler: Scheduler, sinks, limit=2000):
    """Tick in this thread until every sink got its final response."""
    for _ in range(limit):
        if all(s.finals for s in sinks):
            return
        scheduler.tick()
    raise AssertionError("requests did not finish")


def _submit(scheduler, rows, sink):
    scheduler.reserve(len(rows))
    scheduler.submit(Request(rows, sink))


def test_streamed_text_equals_the_tokens_and_every_request_ends_once(target, draft, tokenizer, encode):
    sched = _scheduler(target, draft, tokenizer, max_active=2)
    sinks = [Sink(), Sink(2), Sink()]
    rows = [[_row(encode, tokenizer, max_tokens=24, tree=b"auto")],
            [_row(encode, tokenizer, text_input=b"Write a haiku about rain.", max_tokens=16),
             _row(encode, tokenizer, text_input=b"What is 2+2?", max_tokens=12, tree=b"none")],
            [_row(encode, tokenizer, text_input=b"Count from one to five.", max_tokens=20, tree=b"2,1")]]
    for r, s in zip(rows, sinks, strict=True):
        _submit(sched, r, s)
    _drive(sched, sinks)
    assert [s.finals for s in sinks] == [1, 1, 1]
    for r, s in zip(rows, sinks, strict=True):
        for i, row in enumerate(r):
            result = s.result(i)
            assert s.texts[i] == result.text == tokenizer.decode(row.job.out, skip_special_tokens=True)
            assert result.output_tokens == len(row.job.out) and result.finish_reason in ("stop", "length")
    assert sched.metrics.counts["requests"] == 4 and sched.reserved == 0
    clock = sched.decoder.clock  # step time and target forward time, as the decoder's own clock counted them
    assert sched.metrics.counts["step_seconds"] == pytest.approx(clock.total)
    assert sched.metrics.counts["target_forward_seconds"] == pytest.approx(clock.target)
    assert 0 < clock.target < clock.total
    assert not sched.decoder.active and len(sched.decoder.free) == 2
    # one tau observation per finished request (not one per target pass: each is a round trip to tritonserver)
    assert sorted(sched.metrics.observations["tau"]) == sorted(len(row.job.out) / row.job.stats.target_passes
                                                               for r in rows for row in r)


def test_logprobs_go_out_with_the_tokens_they_belong_to_once_each(target, draft, tokenizer, encode):
    """A row asking for logprobs gets one entry per output token, in order, sent with the text they made, none past a
    stop string; a row that did not ask gets none; a count past 20 is refused naming the field."""
    sched = _scheduler(target, draft, tokenizer, max_active=2, stream_interval=4)
    sinks = [Sink(), Sink()]
    rows = [[_row(encode, tokenizer, max_tokens=30, tree=b"auto", logprobs=2, stop_words=[b"blue"])],
            [_row(encode, tokenizer, max_tokens=12, tree=b"auto")]]
    for r, s in zip(rows, sinks, strict=True):
        _submit(sched, r, s)
    _drive(sched, sinks)
    result, job = sinks[0].result(), rows[0][0].job
    assert [e[0] for e in sinks[0].logprobs[0]] == job.out[:result.output_tokens]
    assert [e[1:] for e in sinks[0].logprobs[0]] == job.logprob_rows[:result.output_tokens]
    assert all(len(e[2]) == 2 for e in sinks[0].logprobs[0]) and sinks[1].logprobs[0] == []
    with pytest.raises(RequestError, match="logprobs must be in"):
        _row(encode, tokenizer, logprobs=21)


def test_stream_interval_sends_the_same_text_in_fewer_responses(target, draft, tokenizer, encode):
    """With stream_interval 4 a row's first text goes out alone (time to first token), every later response but
    its last covers >= 4 tokens, and the texts and token counts add up to what interval 1 streams, in fewer
    responses."""
    streamed = {}
    for interval in (1, 4):
        sched = _scheduler(target, draft, tokenizer, max_active=2, stream_interval=interval)
        sinks = [Sink(), Sink()]
        counts = [[], []]
        for sink, got in zip(sinks, counts, strict=True):
            def text(row, delta, tokens, logprobs, sink=sink, got=got):
                Sink.text(sink, row, delta, tokens, logprobs)
                got.append(tokens)
            sink.text = text
        rows = [[_row(encode, tokenizer, max_tokens=30, tree=b"auto")],
                [_row(encode, tokenizer, text_input=b"Count from one to five.", max_tokens=25, tree=b"none")]]
        for r, s in zip(rows, sinks, strict=True):
            _submit(sched, r, s)
        _drive(sched, sinks)
        streamed[interval] = [(s.texts[0], sum(c), len(c)) for s, c in zip(sinks, counts, strict=True)]
        for r, s, c in zip(rows, sinks, counts, strict=True):
            assert s.finals == 1 and s.texts[0] == s.result().text and s.events[-1][0] == "row"
            assert sum(c) <= len(r[0].job.out)  # text held back to the end (a partial character) counts 0 there
            if interval > 1:
                assert all(n >= interval for n in c[1:-1]), c
    for one, four in zip(streamed[1], streamed[4], strict=True):
        assert one[:2] == four[:2] and four[2] < one[2]
    with pytest.raises(ValueError, match="stream_interval"):
        _scheduler(target, draft, tokenizer, stream_interval=0)


def test_a_failing_row_gets_one_error_and_the_others_finish(target, draft, tokenizer, encode, monkeypatch, caplog):
    """One job's forward raises: its request ends with one error response; the other requests get their normal
    final responses; the scheduler keeps serving and answers the same request the same way afterwards."""
    sched = _scheduler(target, draft, tokenizer, max_active=3)
    good, short, bad = (_row(encode, tokenizer, max_tokens=12), _row(encode, tokenizer, max_tokens=1),
                        _row(encode, tokenizer, text_input=b"Say something.", max_tokens=12))
    sinks = [Sink(), Sink(), Sink()]
    for row, sink in zip((good, short, bad), sinks, strict=True):
        _submit(sched, [row], sink)
    real = target.forward_many
    poisoned = []

    def forward_many(segments, logit_rows=None):
        if any(s[3] is sched.decoder.target_caches[bad.job.slot] for s in segments) and bad.job.out:
            poisoned.append(True)
            raise RuntimeError("a broken row")
        return real(segments, logit_rows)

    monkeypatch.setattr(target, "forward_many", forward_many)
    _drive(sched, sinks)
    assert poisoned and [s.finals for s in sinks] == [1, 1, 1]
    assert sinks[2].events[-1][:2] == ("fail", "internal") and "a broken row" in sinks[2].events[-1][2]
    assert sinks[0].result().finish_reason in ("stop", "length") and sinks[1].result().output_tokens == 1
    assert sched.metrics.counts["failed"] == 1
    fallbacks = sched.metrics.counts["step_fallbacks"]  # counted (and logged) for each batched step that failed
    assert fallbacks >= 1
    warned = [r for r in caplog.records if "batched step" in r.getMessage()]
    assert len(warned) == sum(1 for n in range(1, fallbacks + 1) if logged_now(n))  # not one per failed step
    monkeypatch.setattr(target, "forward_many", real)
    again = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=12)], again)
    _drive(sched, [again])
    assert sched.metrics.counts["step_fallbacks"] == fallbacks  # batched again: no fallback is permanent
    assert again.result().text == sinks[0].result().text  # the same request, the same answer afterwards


def test_a_warm_up_whose_forward_fails_raises_with_the_reason(target, draft, tokenizer, encode, monkeypatch):
    """The served model warms up before it loads READY: a failing forward must fail the load, not end the warm-up
    jobs with finish "error" and leave a READY model whose every request fails."""
    from spectrt.runtime.serving.scheduler import warm_up

    sched = _scheduler(target, draft, tokenizer)
    warm_up(sched.decoder, [encode("Hi"), encode("Hello")], None)  # a working model warms up silently

    def broken(segments, logit_rows=None):
        raise RuntimeError("no kernel for this CPU")

    monkeypatch.setattr(target, "forward_many", broken)
    with pytest.raises(RuntimeError, match="warm-up request failed: RuntimeError: no kernel for this CPU"):
        warm_up(sched.decoder, [encode("Hi"), encode("Hello")], None)
    assert not sched.decoder.active and len(sched.decoder.free) == 2


def test_cancelled_and_expired_requests_free_their_slots(target, draft, tokenizer, encode):
    sched = _scheduler(target, draft, tokenizer, max_active=1)
    long = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=200, min_length=200, timeout_seconds=60.0)], long)
    sched.tick()
    sched.tick()
    long.gone = True  # the client went away mid-stream
    sched.requests[0].checked = 0.0  # due for its next cancellation check (no waiting on the clock)
    sched.tick()
    assert long.finals == 1 and long.events[-1] == ("close",) and len(sched.decoder.free) == 1
    expiring = Sink()
    row = _row(encode, tokenizer, max_tokens=200, min_length=200, timeout_seconds=60.0)
    _submit(sched, [row], expiring)
    sched.tick()
    sched.requests[0].arrived -= 61  # its deadline passed (no waiting on the clock)
    sched.tick()
    assert expiring.finals == 1 and expiring.events[-1][:2] == ("fail", "deadline")
    assert len(sched.decoder.free) == 1 and sched.metrics.counts["deadline_exceeded"] == 1
    assert sched.metrics.counts["cancelled"] == 1


def test_fair_admission_and_overload(target, draft, tokenizer, encode):
    """A 4-row request and a 1-row request arriving after it share 2 slots: the single row is admitted before the
    big request's second row. A full queue refuses before any parsing."""
    sched = _scheduler(target, draft, tokenizer, max_active=2, max_queue=5)
    big, small = Sink(4), Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=8) for _ in range(4)], big)
    _submit(sched, [_row(encode, tokenizer, max_tokens=8)], small)
    sched.tick()
    assert {req.sink for req in sched.requests if req.active} == {big, small}
    with pytest.raises(Overloaded, match="max_queue_size=5"):
        sched.reserve(3)
    _drive(sched, [big, small])
    assert big.finals == small.finals == 1 and sched.metrics.counts["overloaded"] == 3


def test_requests_arriving_before_admission_take_the_free_slots_first(target, draft, tokenizer, encode):
    """Two slots, a queue of one: three requests reserved before the scheduler thread admits any are all accepted
    (two slots and the queue), the fourth is refused. Counting unadmitted rows against the queue alone refused the
    second whenever the thread was in a forward (the served overload test failed so on a busy machine)."""
    sched = _scheduler(target, draft, tokenizer, max_active=2, max_queue=1)
    sinks = [Sink() for _ in range(3)]
    for sink in sinks:
        _submit(sched, [_row(encode, tokenizer, max_tokens=4)], sink)
    with pytest.raises(Overloaded, match="max_queue_size=1"):
        sched.reserve(1)
    sched.tick()
    assert len(sched.decoder.active) == 2 and sched.reserved == 1
    with pytest.raises(Overloaded):
        sched.reserve(1)
    _drive(sched, sinks)
    assert all(s.finals == 1 for s in sinks) and sched.reserved == 0 and sched.metrics.counts["overloaded"] == 2


def test_text_stop_string_ends_the_row_where_tokens_do_not_match(target, draft, tokenizer, encode):
    """A stop string found in the detokenized text (here: the answer's own second word) ends the row there, with the
    stop string included, whether or not its tokens appear as such."""
    sched = _scheduler(target, draft, tokenizer, max_active=1)
    free = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=24)], free)
    _drive(sched, [free])
    text = free.result().text
    stop = next(w for w in text.split()[1:] if len(w) >= 4 and w.isalpha())[1:]
    stopped = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=24, stop_words=[stop.encode()])], stopped)
    _drive(sched, [stopped])
    cut = text[:text.index(stop) + len(stop)]
    assert stopped.result().text == cut == stopped.texts[0] and stopped.result().finish_reason == "stop"


@pytest.mark.parametrize("tree", [b"none", b"auto"])
def test_a_stop_string_ending_inside_a_token_cuts_the_answer_there(target, draft, tokenizer, encode, tree):
    """The stop string is the start of a later word: it ends inside that word's token. The answer (streamed and
    whole) ends right after it and counts the tokens up to the one that completes it, nothing decoded later."""
    sched = _scheduler(target, draft, tokenizer, max_active=1)
    free, row = Sink(), _row(encode, tokenizer, max_tokens=24, tree=tree)
    _submit(sched, [row], free)
    _drive(sched, [free])
    out, text = row.job.out, free.result().text
    stop = next(w for w in text.split()[2:] if len(w) >= 4 and w.isalpha())[:2]
    cut = text[:text.index(stop) + len(stop)]
    tokens = next(k for k in range(1, len(out) + 1) if stop in tokenizer.decode(out[:k]))
    assert tokenizer.decode(out[:tokens]) != cut  # the stop string ends inside a token
    stopped = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=24, tree=tree, stop_words=[stop.encode()])], stopped)
    _drive(sched, [stopped])
    result = stopped.result()
    assert stopped.texts[0] == result.text == cut and result.finish_reason == "stop"
    assert result.output_tokens == tokens


def test_drain_finishes_or_ends_in_flight_requests_and_refuses_new_ones(target, draft, tokenizer, encode):
    sched = _scheduler(target, draft, tokenizer, max_active=2)
    sched.start()
    quick, endless = Sink(), Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=4)], quick)
    _submit(sched, [_row(encode, tokenizer, max_tokens=1000, min_length=1000)], endless)
    assert quick.done.wait(60)
    sched.stop(drain_seconds=0.5)
    assert not sched.alive and quick.finals == endless.finals == 1
    assert endless.events[-1][:2] == ("fail", "unavailable") and "stopping" in endless.events[-1][2]
    with pytest.raises(Overloaded, match="stopping"):
        sched.reserve(1)


def test_a_dead_scheduler_thread_is_restarted_and_its_requests_answered(target, draft, tokenizer, encode,
                                                                       monkeypatch):
    sched = _scheduler(target, draft, tokenizer, max_active=1)
    orphan = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=8)], orphan)
    sched.tick()  # taken in and admitted, then the thread "dies" (start was never called: simulate a dead one)
    sched.thread = threading.Thread(target=lambda: None)
    sched.thread.start()
    sched.thread.join()
    assert "thread died" in sched.health()  # at once, not after max_stall_seconds
    sched.start()
    assert sched.alive and sched.restarts == 1 and orphan.finals == 1 and orphan.events[-1][1] == "internal"
    assert sched.health() is None
    fresh = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=4)], fresh)
    assert fresh.done.wait(60) and fresh.finals == 1
    sched.stop()


def test_an_empty_request_or_a_failed_admission_ends_that_request_alone(target, draft, tokenizer, encode,
                                                                       monkeypatch):
    """A request without rows gets one "invalid" error (its deadline, a min over no rows, raised in `tick` and failed
    every request in flight); a row whose admission raises (the draft's prefix reuse here) ends its own request with
    one error, its slot goes back, and the other request finishes."""
    sched = _scheduler(target, draft, tokenizer, max_active=2)
    empty, bad, good = Sink(), Sink(), Sink()
    _submit(sched, [], empty)
    real, calls = sched.decoder.drafter.reuse, []

    def reuse(src, dst, length, *bounded):
        calls.append(dst)
        if len(calls) == 1:
            raise RuntimeError("a broken prefix copy")
        return real(src, dst, length, *bounded)

    monkeypatch.setattr(sched.decoder.drafter, "reuse", reuse)
    _submit(sched, [_row(encode, tokenizer, max_tokens=8)], bad)
    _submit(sched, [_row(encode, tokenizer, max_tokens=8)], good)
    _drive(sched, [empty, bad, good])
    assert [s.finals for s in (empty, bad, good)] == [1, 1, 1]
    assert empty.events[-1][:2] == ("fail", "invalid") and "no rows" in empty.events[-1][2]
    assert bad.events[-1][:2] == ("fail", "internal") and "a broken prefix copy" in bad.events[-1][2]
    assert good.result().finish_reason in ("stop", "length") and len(calls) == 2
    assert sorted(sched.decoder.free) == [0, 1] and sched.reserved == 0 and not sched.decoder.active


def test_a_failed_step_whose_cleanup_raises_too_still_answers_everyone(target, draft, tokenizer, encode,
                                                                       monkeypatch):
    """A step raises and then freeing one of its slots raises too: every request in flight still gets one error,
    the loop keeps running (it used to die with the rest unanswered until a new request restarted it), and the
    slots come back."""
    sched = _scheduler(target, draft, tokenizer, max_active=2)
    real_step, real_cancel = sched.decoder.step, sched.decoder.cancel
    broken = {"step": 1, "cancel": 1}

    def step():
        active = sched.decoder.active
        if broken["step"] and len(active) == 2 and all(j.out for j in active):
            broken["step"] -= 1
            raise RuntimeError("a broken step")
        return real_step()

    def cancel(job):
        if broken["cancel"]:
            broken["cancel"] -= 1
            raise RuntimeError("a broken cancel")
        return real_cancel(job)

    monkeypatch.setattr(sched.decoder, "step", step)
    monkeypatch.setattr(sched.decoder, "cancel", cancel)
    sinks = [Sink(), Sink()]
    for sink in sinks:
        _submit(sched, [_row(encode, tokenizer, max_tokens=24)], sink)
    sched.start()
    assert all(s.done.wait(120) for s in sinks)
    assert broken == {"step": 0, "cancel": 0} and [s.finals for s in sinks] == [1, 1]
    assert all(s.events[-1][:2] == ("fail", "internal") and "a broken step" in s.events[-1][2] for s in sinks)
    fresh = Sink()
    _submit(sched, [_row(encode, tokenizer, max_tokens=4)], fresh)
    assert fresh.done.wait(120) and fresh.finals == 1 and fresh.result().output_tokens == 4
    assert sched.alive and sched.restarts == 0
    sched.stop()
    assert sorted(sched.decoder.free) == [0, 1] and not sched.decoder.active


@pytest.mark.unit
def test_the_timeout_limit_sent_as_fp32_is_the_limit(tokenizer, encode):
    """The OpenAI frontend sends the limit itself as TYPE_FP32 (35.2 arrives as 35.2000008): accepted as the limit,
    not refused as over it (every request failed with 400 at such a max_request_seconds)."""
    import numpy as np

    limits = Limits(max_request_seconds=35.2)
    row = make_row({"text_input": b"hi", "timeout_seconds": float(np.float32(35.2))}, limits, encode,
                   lambda w: tokenizer.encode(w, add_special_tokens=False))
    assert row.timeout == 35.2
    with pytest.raises(RequestError, match="timeout_seconds must be in"):
        make_row({"text_input": b"hi", "timeout_seconds": 35.3}, limits, encode, lambda w: [])


@pytest.mark.unit
def test_validator_refuses_costly_inputs_before_any_work(tokenizer, encode):
    """A 1 MB tree string and a 10,000-entry word list are refused before anything is decoded or tokenized (the
    tokenizer is never called); token ids past the vocabulary are refused by the decoder's check."""
    calls = []

    def counting(prompt, chat=True):
        calls.append(prompt)
        return encode(prompt, chat)

    def word(w):
        calls.append(w)
        return tokenizer.encode(w, add_special_tokens=False)

    limits = Limits()
    with pytest.raises(RequestError, match="tree is 1048576 bytes long"):
        make_row({"text_input": b"hi", "tree": b"1," * (1 << 19)}, limits, counting, word)
    with pytest.raises(RequestError, match="10000 words, more than 64"):
        make_row({"text_input": b"hi", "stop_words": [b"x"] * 10_000}, limits, counting, word)
    with pytest.raises(RequestError, match="longer than 32 tokens"):
        make_row({"text_input": b"hi", "bad_words": [b"y" * 100_000]}, limits, counting, word)
    with pytest.raises(RequestError, match="more than the context"):
        make_row({"text_input": b"z" * (limits.max_prompt_bytes + 1)}, limits, counting, word)
    assert calls == []
    row = make_row({"text_input": b"hi", "stop_words": [b"\n", b" "], "tree": b"2,1"}, limits, counting, word)
    assert row.stop_strings == ["\n", " "] and row.job.stop_words == [tokenizer.encode("\n", add_special_tokens=False),
                                                                       tokenizer.encode(" ", add_special_tokens=False)]
    decoder = Decoder(_Vocab(10), None, {2})
    with pytest.raises(ValueError, match="outside this model's vocabulary"):
        decoder.check(row.job)


class _Vocab:
    """An engine that only has a vocabulary size (the check runs before any forward)."""

    def __init__(self, vocab):
        from spectrt.runtime.engines.model import ModelConfig

        self.config = ModelConfig(vocab, 8, 8, 1, 1, 1, 8, 1e-5, 1e4, True)

    def new_caches(self, slots, capacity, window):
        from spectrt.runtime.engines.model import KVCache

        return KVCache.pool(self.config, slots, capacity, window, torch.float32)


@pytest.mark.unit
def test_auto_tree_falls_back_to_the_target_alone_without_speculation(tokenizer, encode):
    limits = Limits(speculation=False)
    assert _row(encode, tokenizer, limits, tree=b"auto").job.tree is None
    assert _row(encode, tokenizer, Limits(), tree=b"auto").job.tree == AUTO


# --------------------------------------------------------------------------- a scripted decoder (no model)


class Scripted:
    """A decoder stand-in: job `prompt_ids[0]` emits its script, one chunk of tokens per step (a tree step accepts
    several at once), then finishes with "length"; `check` refuses the keys in `refuse`."""

    def __init__(self, scripts: dict[int, list[list[int]]], max_active: int = 4, refuse=(), broken=()):
        self.scripts, self.refuse, self.broken = scripts, set(refuse), set(broken)
        self.active, self.free = [], list(range(max_active))
        self.clock = StepClock()  # the scheduler reads a step's time from it (nothing runs: it stays at zero)

    def check(self, job):
        if job.prompt_ids[0] in self.refuse:
            raise ValueError("refused by the scripted decoder")

    def add(self, job):
        job.slot = self.free.pop()
        self.active.append(job)

    def step(self):
        info = StepInfo(active=len(self.active))
        for job in list(self.active):
            if job.prompt_ids[0] in self.broken:  # its forward failed alone: it ends, the others go on
                job.error = "RuntimeError: a broken row"
                self.finish(job, "error")
                info.finished.append(job)
                continue
            chunks = self.scripts[job.prompt_ids[0]]
            new = chunks[job.stats.target_passes]
            job.stats.target_passes += 1
            job.out += new
            info.emitted.append((job, new))
            if job.stats.target_passes == len(chunks):
                self.finish(job, "length")
                info.finished.append(job)
        return info

    def finish(self, job, reason="stop"):
        job.finish = job.finish or reason
        if job in self.active:
            self.active.remove(job)
            self.free.append(job.slot)

    def cancel(self, job):
        self.finish(job, "cancelled")


def _scripted_row(key: int, stops=(), stream=True) -> Row:
    return Row(Job([key], 1000), "p", stream=stream, stop_strings=list(stops))


@pytest.mark.unit
def test_a_stop_string_inside_a_token_cuts_the_text_and_the_tokens_after_it(tokenizer):
    """One step accepts " Paris", " is", " big"; the stop string "Par" ends inside the first token: the client sees
    " Par" and nothing after it, streamed and in the result, and one output token is counted."""
    ids = tokenizer.encode(" Paris is big", add_special_tokens=False)
    sched = Scheduler(Scripted({0: [ids], 1: [ids[:1], ids[1:]]}), tokenizer, CounterMetrics())
    first, second = Sink(), Sink()
    _submit(sched, [_scripted_row(0, ["Par"])], first)
    _submit(sched, [_scripted_row(1, ["s b"])], second)  # ends inside the step's last token, after another one
    _drive(sched, [first, second])
    assert first.texts[0] == first.result().text == " Par" and first.result().output_tokens == 1
    assert second.texts[0] == second.result().text == " Paris is b" and second.result().output_tokens == 3
    assert first.result().finish_reason == second.result().finish_reason == "stop"
    assert sched.metrics.counts["tokens"] == 4


@pytest.mark.unit
def test_the_queue_wait_limit_counts_from_the_last_running_row(tokenizer):
    """One slot. A two-row request whose first row decoded past `max_queue_seconds` gets its second row admitted
    when the first ends (its slot is free: it was refused as "overloaded" the round the first row ended), while a
    request that waits that long behind another's row is refused as before."""
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    sched = Scheduler(Scripted({k: [[t] for t in ids] for k in range(3)}, max_active=1), tokenizer, CounterMetrics(),
                      max_queue_seconds=30)
    pair, late = Sink(2), Sink()
    _submit(sched, [_scripted_row(0), _scripted_row(1)], pair)
    sched.tick()  # takes the request, admits row 0
    sched.requests[0].arrived -= 40  # row 0 has decoded for 40 s (no waiting on the clock)
    _drive(sched, [pair])
    assert pair.finals == 1 and not any(e[0] == "fail" for e in pair.events)
    assert [pair.result(i).text for i in (0, 1)] == [" one two three"] * 2
    first = Sink()
    _submit(sched, [_scripted_row(0)], first)
    sched.tick()
    _submit(sched, [_scripted_row(2)], late)
    sched.tick()  # `late` waits behind `first`'s row
    next(r for r in sched.requests if r.sink is late).arrived -= 40
    _drive(sched, [first, late])
    assert late.events[-1][:2] == ("fail", "unavailable") and "overloaded" in late.events[-1][2]
    assert first.finals == late.finals == 1 and sched.metrics.counts["overloaded"] == 1


class Flaky(Sink):
    """A sink whose calls named in `raises` raise (the client or the transport failed mid-request)."""

    def __init__(self, raises=(), rows: int = 1):
        super().__init__(rows)
        self.raises = set(raises)

    def text(self, row, delta, tokens, logprobs):
        if "text" in self.raises:
            raise RuntimeError("text send failed")
        super().text(row, delta, tokens, logprobs)

    def row_done(self, row, result, last):
        if "row_done" in self.raises:
            raise RuntimeError("final send failed")
        super().row_done(row, result, last)

    def fail(self, message, code):
        if "fail" in self.raises:
            raise RuntimeError("error send failed")
        super().fail(message, code)


@pytest.mark.unit
def test_a_send_that_raises_still_ends_its_request_once_and_no_other(tokenizer):
    """A raising text send gets a final error; a raising final send too; a raising error send (a refused request)
    its close; the request next to them finishes normally whatever they do."""
    ids = tokenizer.encode(" one two three four", add_special_tokens=False)
    sched = Scheduler(Scripted({k: [[t] for t in ids] for k in range(5)}, refuse={3, 4}), tokenizer,
                      CounterMetrics())
    good, texting, final, refused, silent = (Flaky(), Flaky({"text"}), Flaky({"row_done"}), Flaky({"fail"}),
                                             Flaky({"fail", "text"}))
    for key, sink in enumerate((good, texting, final, refused, silent)):
        _submit(sched, [_scripted_row(key)], sink)
    _drive(sched, [good, texting, final, refused, silent])
    assert [s.finals for s in (good, texting, final, refused, silent)] == [1] * 5
    assert good.result().text == " one two three four"
    assert texting.events[-1][:2] == ("fail", "internal") and "text send failed" in texting.events[-1][2]
    assert final.events[-1][:2] == ("fail", "internal") and "final send failed" in final.events[-1][2]
    assert refused.events == [("close",)] and silent.events == [("close",)]
    assert not sched.requests and not sched.decoder.active and sched.reserved == 0


@pytest.mark.unit
def test_sixteen_streams_with_failing_sends_lose_no_final_response_and_cross_no_tokens(tokenizer):
    """16 client threads x 20 requests against the scheduler thread; some sinks raise on text, on the final
    response or on the error too: every request gets exactly one final response and every text is its own."""
    streams, requests = 16, 20
    scripts, want = {}, {}
    for s in range(streams):
        for k in range(requests):
            ids = tokenizer.encode(f" stream {s} request {k} ends here", add_special_tokens=False)
            scripts[s * requests + k] = [ids[i:i + 1 + (s + k) % 3] for i in range(0, len(ids), 1 + (s + k) % 3)]
            want[s * requests + k] = tokenizer.decode(ids)
    refuse = {s * requests + 13 for s in range(streams)}
    sched = Scheduler(Scripted(scripts, max_active=8, refuse=refuse), tokenizer, CounterMetrics(), max_queue=64)
    sched.start()
    sinks: dict[int, Flaky] = {}
    modes = [(), ("text",), (), ("row_done",), (), ("row_done", "fail"), ("text", "fail")]

    def client(s: int) -> None:
        for k in range(requests):
            key = s * requests + k
            sinks[key] = sink = Flaky(modes[(s + k) % len(modes)])
            _submit(sched, [_scripted_row(key)], sink)
            assert sink.done.wait(60)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    sched.stop()
    assert len(sinks) == streams * requests and all(s.finals == 1 for s in sinks.values())
    for key, sink in sinks.items():
        assert want[key].startswith(sink.texts[0]), key  # never another request's text
        if key in refuse:
            assert sink.events[-1][0] == ("close" if "fail" in sink.raises else "fail")
        elif not sink.raises:
            assert sink.texts[0] == sink.result().text == want[key]
        else:
            assert sink.events[-1][0] in ("fail", "close")
    assert sched.reserved == 0 and not sched.requests and not sched.decoder.active


class Stuck(Scripted):
    """A scripted decoder whose steps wait for `release` (a forward that takes long); `entered`: a step began."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.entered, self.release = threading.Event(), threading.Event()

    def step(self):
        self.entered.set()
        assert self.release.wait(60), "never released (a hang guard)"
        return super().step()


@pytest.mark.unit
def test_health_names_a_loop_that_stopped_advancing_with_requests_in_flight(tokenizer):
    """The loop stamps every round; `health` is None while it advances or has nothing to do, and says why not once
    requests are in flight and no round came for max_stall_seconds (here a step that does not return: the thread is
    alive, so nothing else shows it). No waiting on the clock: the stamp is moved back."""
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    decoder = Stuck({0: [[t] for t in ids]}, max_active=1)
    sched = Scheduler(decoder, tokenizer, CounterMetrics(), max_stall_seconds=30)
    stalled = (r"the decode loop has not advanced for \d+ s \(max_stall_seconds=30\) with 1 request\(s\) waiting "
               r"or decoding$")
    sched.advanced -= 1000
    assert sched.health() is None  # nothing to do: an old stamp is no stall
    sink = Sink()
    _submit(sched, [_scripted_row(0)], sink)
    assert re.match(stalled, sched.health())  # handed over, and no loop runs to take it
    sched.start()
    assert decoder.entered.wait(60)
    assert sched.health() is None  # its step began a moment ago
    sched.advanced -= 31  # that step has now run past the bound
    assert re.match(stalled, sched.health())
    decoder.release.set()
    assert sink.done.wait(60) and sink.finals == 1 and sink.result().text == " one two"
    assert sched.health() is None
    sched.stop()


@pytest.mark.unit
def test_a_stop_whose_loop_is_still_in_a_step_leaves_its_state_to_the_loop(tokenizer):
    """The loop is inside a step past the drain and the grace: `stop` returns False and touches nothing the loop
    owns (no response is sent from the stopping thread, the requests and the slot stay as they are: ending them from
    there raced the step). When the step returns the loop itself ends every request, the one handed over after
    the stop too, with exactly one "stopping" response each, and exits."""
    ids = tokenizer.encode(" one two three", add_special_tokens=False)
    decoder = Stuck({k: [[t] for t in ids] for k in range(3)}, max_active=1)
    sched = Scheduler(decoder, tokenizer, CounterMetrics())
    decoding, waiting, late = Sink(), Sink(), Sink()
    _submit(sched, [_scripted_row(0)], decoding)
    _submit(sched, [_scripted_row(1)], waiting)  # one slot: it waits
    sched.reserve(1)  # a request accepted before the stop, handed over after it
    sched.start()
    assert decoder.entered.wait(60)
    assert sched.stop(drain_seconds=0.0, grace_seconds=0.05) is False
    assert decoding.finals == waiting.finals == 0 and decoding.events == [] == waiting.events
    assert len(sched.requests) == 2 and [j.prompt_ids[0] for j in decoder.active] == [0] and sched.alive
    with pytest.raises(Overloaded, match="stopping"):
        sched.reserve(1)
    sched.submit(Request([_scripted_row(2)], late))
    decoder.release.set()
    sched.thread.join(60)
    assert not sched.alive
    assert [s.finals for s in (decoding, waiting, late)] == [1, 1, 1]
    assert all(s.events[-1][:2] == ("fail", "unavailable") and "stopping" in s.events[-1][2]
               for s in (decoding, waiting, late))
    assert decoding.texts[0] == " one"  # the step it was in finished and was streamed first
    assert not sched.requests and not decoder.active and sched.reserved == 0
    assert sched.stop() is True  # the loop is gone: a second stop has nothing left to end


@pytest.mark.unit
def test_failures_are_logged_with_the_request_id(tokenizer, caplog):
    """A row's failure and a send that raises leave a log line naming the request (they used to be silent)."""
    ids = tokenizer.encode(" one two", add_special_tokens=False)
    sched = Scheduler(Scripted({0: [ids], 1: [ids]}, broken={0}), tokenizer, CounterMetrics())
    broken, flaky = Sink(), Flaky({"text"})
    sched.reserve(2)
    sched.submit(Request([_scripted_row(0)], broken, "req-broken"))
    sched.submit(Request([_scripted_row(1)], flaky, "req-flaky"))
    with caplog.at_level("WARNING", logger="spectrt.scheduler"):
        _drive(sched, [broken, flaky])
    logged = [r.getMessage() for r in caplog.records]
    assert any("'req-broken'" in m and "a broken row" in m for m in logged), logged
    assert any("'req-flaky'" in m and "text send failed" in m for m in logged), logged
    assert sched.metrics.counts["failed"] == 1 and sched.metrics.counts["send_failed"] == 1


@pytest.mark.unit
def test_a_repeated_warning_is_logged_at_the_1st_10th_100th():
    assert [n for n in range(0, 20001) if logged_now(n)] == [1, 10, 100, 1000, 10000]
