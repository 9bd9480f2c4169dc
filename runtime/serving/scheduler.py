"""The serving scheduler: one thread owns the decode loop; queue, admission, fairness, cancellation, deadlines,
overload, drain, health and metrics live here, testable in process without tritonserver.

A `Request` is what one client sent: one or more `Row`s (requests.py) and a `Sink` that carries responses
back (the Triton model implements it over its response sender). The scheduler guarantees that every request gets
exactly one final response, whatever happens: finished, cancelled by its client, refused for overload, past its
deadline, failed (its own step failed: the batch goes on without it), or the server stopping.

Each tick: take new requests; drop cancelled ones and end the ones past their deadline or queue wait; admit waiting
rows into free slots, the request with the fewest active rows first (one 8-row request cannot take every slot);
run one decoder step; turn each row's new tokens into text (incremental detokenization, stop strings matched on
the text) and hand it to the sink.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

from spectrt.runtime.decoding.decoder import Decoder, Job
from spectrt.runtime.decoding.text import StopStrings, TextStream
from spectrt.runtime.serving.requests import Row

LOG = logging.getLogger("spectrt.scheduler")
CANCEL_CHECK_SECONDS = 0.1  # how often a request's sink is asked whether its client went away (an IPC round trip)
IDLE_WAIT_SECONDS = 0.1  # how long an idle scheduler blocks waiting for work (the thread never spins)


def warm_up(decoder: Decoder, prompts: list[list[int]], tree) -> None:
    """Decode a few tokens of each prompt before serving (first forwards: allocator, scratch growth), raising
    RuntimeError with the reason if any of them failed: a model whose forward fails would fail every request, so it
    must not load READY (the decoder ends a failing job with finish "error" instead of raising)."""
    jobs = decoder.run([Job(list(p), 4, tree) for p in prompts])
    failed = next((job for job in jobs if job.finish == "error"), None)
    if failed is not None:
        raise RuntimeError(f"the warm-up request failed: {failed.error}") from failed.exception


class Overloaded(Exception):
    """No room: the queue is full or the server is stopping (UNAVAILABLE; the client may retry)."""


class Sink(Protocol):
    """Where one request's responses go. Exactly one of `done`, `fail`, `close` ends it."""

    def cancelled(self) -> bool: ...

    def text(self, row: int, delta: str, tokens: int, logprobs: list) -> None:
        """A streamed text delta of one row, how many tokens it covers, and their logprobs if the row asked
        (`Job.logprobs`: (id, logprob, [(id, logprob), ...]) per token, in order, each token's once)."""

    def row_done(self, row: int, result: RowResult, last: bool) -> None:
        """One row finished; `last`: it is the request's final response."""

    def fail(self, message: str, code: str) -> None:
        """The request's final response is this error (`code`: "invalid", "unavailable", "deadline", "internal")."""

    def close(self) -> None:
        """Its client went away: end the stream without an answer."""


class Metrics(Protocol):
    def count(self, name: str, value: float = 1) -> None: ...

    def observe(self, name: str, value: float) -> None: ...

    def gauge(self, name: str, value: float) -> None: ...


class CounterMetrics:
    """In-process metrics (tests, the CLI): every name's total, last gauge value and observations."""

    def __init__(self):
        self.counts: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.observations: dict[str, list[float]] = {}

    def count(self, name: str, value: float = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + value

    def observe(self, name: str, value: float) -> None:
        self.observations.setdefault(name, []).append(value)

    def gauge(self, name: str, value: float) -> None:
        self.gauges[name] = value


@dataclass
class RowResult:
    text: str
    finish_reason: str
    output_tokens: int
    proposed: int
    accepted: int
    target_passes: int
    seconds: float
    cached_tokens: int = 0  # prompt tokens read from the prefix cache (not prefilled)
    prompt_logprobs: list = field(default_factory=list)  # (id, logprob, top) per prompt token, if the row asked


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class Request:
    rows: list[Row]
    sink: Sink
    id: str = ""  # the client's request id: in every log line about this request
    arrived: float = field(default_factory=time.monotonic)
    streams: list[TextStream] = field(default_factory=list)
    stops: list[StopStrings] = field(default_factory=list)
    ended: list[bool] = field(default_factory=list)  # per row: its final response was handled
    held: list[list] = field(default_factory=list)  # per row: [text, tokens, logprobs] not sent yet (stream_interval)
    logprobs_held: list[int] = field(default_factory=list)  # per row: its tokens whose logprobs went to `held`
    remaining: int = 0
    active: int = 0  # rows holding a slot
    waiting: list[int] = field(default_factory=list)  # rows not admitted yet
    stalled_since: float = 0.0  # when its last running row ended with rows still waiting (the queue-wait limit)
    first_text: float | None = None
    checked: float = 0.0
    done: bool = False

    @property
    def deadline(self) -> float:
        return self.arrived + min(r.timeout for r in self.rows)


def logged_now(count: int) -> bool:
    """Whether the `count`th occurrence of a repeated warning is logged: the 1st, 10th, 100th, ... (a log that
    grows with the digits of the count, however long the cause persists; the metric counts every one)."""
    return count >= 1 and 10 ** (len(str(count)) - 1) == count


class Scheduler:
    """One thread decoding up to the decoder's `max_active` rows together; `submit` from any thread."""

    def __init__(self, decoder: Decoder, tokenizer, metrics: Metrics | None = None, max_queue: int = 64,
                 max_queue_seconds: float = 30.0, stream_interval: int = 1, max_stall_seconds: float = 60.0):
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1 token, got {stream_interval}")
        self.decoder, self.tokenizer = decoder, tokenizer
        self.stream_interval = stream_interval
        self.metrics = metrics or CounterMetrics()
        self.max_queue, self.max_queue_seconds = max_queue, max_queue_seconds
        self.max_stall_seconds = max_stall_seconds
        self.advanced = time.monotonic()  # the loop's heartbeat: when it last began a round (`health`)
        self.incoming: queue.Queue[Request] = queue.Queue()
        self.requests: list[Request] = []  # taken in, not done; admission order
        self.reserved = 0  # rows accepted (reserve) and not yet admitted or dropped
        self.lock = threading.Lock()
        self.accepting = True
        self.stopping = False
        self.restarts = 0
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------ any thread
    def reserve(self, rows: int) -> None:
        """Room for `rows` more rows, checked before the request is parsed or tokenized (backpressure first).

        Room is the free decoding slots plus `max_queue`: rows accepted but not admitted yet take the free slots
        first (two requests arriving before the scheduler thread admitted the first both get a slot; counting
        them against the queue alone refused the second whenever the thread was busy in a forward)."""
        with self.lock:
            if not self.accepting:
                self.metrics.count("overloaded", rows)
                raise Overloaded("the server is stopping: retry on another instance")
            if self.reserved + rows > self.max_queue + len(self.decoder.free):
                self.metrics.count("overloaded", rows)
                raise Overloaded(f"overloaded: {self.reserved} requests are already queued (max_queue_size="
                                 f"{self.max_queue}); retry later")
            self.reserved += rows

    def release(self, rows: int) -> None:
        with self.lock:
            self.reserved -= rows

    def submit(self, request: Request) -> None:
        """Hand a validated request (its rows reserved) to the scheduler thread."""
        self.incoming.put(request)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def health(self) -> str | None:
        """None while the decode loop advances (or has nothing to do), else why not, for a health check to report.

        The loop stamps `advanced` at every round: after a step, or after an idle wait of at most IDLE_WAIT_SECONDS.
        Requests in flight and no round for `max_stall_seconds` mean it is wedged (a forward or a send that never
        returns): its thread is alive and Triton's readiness stays up, so only this stamp shows it. A thread that
        died says so at once (the model restarts it at its next request or health probe)."""
        if self.thread is not None and not self.alive and not self.stopping:
            return "the decode loop's thread died (it restarts at the next request or health probe)"
        stalled = time.monotonic() - self.advanced
        pending = len(self.requests) + self.incoming.qsize()
        if stalled <= self.max_stall_seconds or not pending:
            return None
        return (f"the decode loop has not advanced for {stalled:.0f} s (max_stall_seconds="
                f"{self.max_stall_seconds:g}) with {pending} request(s) waiting or decoding")

    def start(self) -> None:
        """Start (or restart after a crash: the requests it held end with an error) the scheduler thread."""
        if self.alive:
            return
        if self.thread is not None:  # it died: whatever it held cannot be trusted
            self.restarts += 1
            self.metrics.count("scheduler_restarts")
            LOG.error("the scheduler thread died: restarting it, ending the %d request(s) it held", len(self.requests))
            self._end_all("spectrt failed: the scheduler restarted after an internal error: retry")
        self.thread = threading.Thread(target=self._run, name="spectrt-scheduler", daemon=True)
        self.thread.start()

    def run_here(self) -> None:
        """Run the scheduler loop in the calling thread instead of `start`'s own: the thread that loaded the engines.
        Why: the native forward ran at ~0.6x in a thread other than the one that first ran the process's OpenMP work
        (loading); the Triton model loads and decodes in one thread (triton_repo/spectrt/1/model.py)."""
        self.thread = threading.current_thread()
        self._run()

    def stop(self, drain_seconds: float = 0.0, grace_seconds: float = 10.0) -> bool:
        """Refuse new requests, let the ones in flight finish for up to `drain_seconds`, then end the rest with an
        UNAVAILABLE final response. Returns True once the loop is gone; False if it is still inside a step
        `grace_seconds` after the drain. Then nothing here touches what the loop owns (its requests, the decoder it
        may be running this moment: ending them from here raced it): the loop ends every request itself when that
        step returns, so each still gets exactly one final response."""
        with self.lock:
            self.accepting = False
        self.drain_until = time.monotonic() + drain_seconds
        self.stopping = True
        if self.thread is not None:
            self.thread.join(timeout=drain_seconds + grace_seconds)
        if self.alive:
            LOG.error("the scheduler thread is still in a step %g s after the drain: it ends its %d request(s) "
                      "when the step returns", grace_seconds, len(self.requests))
            return False
        self._end_stopped()  # no loop (never started, or gone): what is left is ours to end
        return True

    # ------------------------------------------------------------------------------------ scheduler thread
    def _run(self) -> None:
        while True:
            self.advanced = time.monotonic()
            if self.stopping and (time.monotonic() >= self.drain_until or not self.requests and self.incoming.empty()):
                self._end_stopped()
                return
            try:
                self.tick()
            except Exception as e:  # never leave a request without its final response: end what was in flight
                LOG.exception("scheduler step failed; ending the %d request(s) in flight", len(self.requests))
                self._end_all(f"spectrt failed: {type(e).__name__}: {e}")

    def _end_stopped(self) -> None:
        """At a stop, past the drain: every request left, those not taken in yet too, ends as "stopping"."""
        self._take_incoming()
        self._end_all("the server is stopping: retry on another instance", "unavailable")

    def _end_all(self, message: str, code: str = "internal") -> None:
        """Fail every request in flight and free every slot, each on its own: one that raises (its state is what
        failed) must not end the loop with the others unanswered until the next request restarts it."""
        for request in list(self.requests):
            try:
                self._fail(request, message, code)
            except Exception:
                LOG.exception("request %r: ending it failed", request.id)
                request.done = True
                if request in self.requests:
                    self.requests.remove(request)
                self._send(request, "fail", message, code)
        for job in list(self.decoder.active):
            try:
                self.decoder.cancel(job)
            except Exception:
                LOG.exception("freeing a slot failed")

    def _take_incoming(self, wait: float = 0.0) -> None:
        try:
            request = self.incoming.get(timeout=wait) if wait else self.incoming.get_nowait()
            while True:
                self._take(request)
                request = self.incoming.get_nowait()
        except queue.Empty:
            pass

    def _take(self, request: Request) -> None:
        request.remaining = len(request.rows)
        request.waiting = list(range(len(request.rows)))
        request.streams = [TextStream(self.tokenizer) for _ in request.rows]
        request.stops = [StopStrings(r.stop_strings) for r in request.rows]
        request.ended = [False] * len(request.rows)
        request.held = [["", 0, []] for _ in request.rows]
        request.logprobs_held = [0] * len(request.rows)
        for i, row in enumerate(request.rows):
            row.job.tag = (request, i)
        try:
            if not request.rows:  # else its deadline (a min over no rows) raised in `tick`, failing every request
                raise ValueError("the request has no rows: send text_input with shape [1, 1]")
            for row in request.rows:
                self.decoder.check(row.job)
        except ValueError as e:
            self.release(len(request.rows))
            request.waiting = []
            request.done = True
            self._send(request, "fail", str(e), "invalid")
            return
        self.requests.append(request)

    def tick(self) -> None:
        """One round: intake, cancellations and deadlines, admission, one decoder step, responses."""
        idle = not self.decoder.active and not any(r.waiting for r in self.requests)
        self._take_incoming(IDLE_WAIT_SECONDS if idle else 0.0)
        now = time.monotonic()
        for request in list(self.requests):
            self._check(request, now)
        self._admit(now)
        self.metrics.gauge("active", len(self.decoder.active))
        self.metrics.gauge("queued", sum(len(r.waiting) for r in self.requests))
        if not self.decoder.active:
            return
        clock = self.decoder.clock
        total, target = clock.total, clock.target
        info = self.decoder.step()
        if info.fallback is not None:  # this step only: the next one is batched again
            self.metrics.count("step_fallbacks")
            fallbacks = self.metrics.counts["step_fallbacks"]
            if logged_now(fallbacks):  # a persistent failure used to warn at every step
                LOG.warning("the batched step of %d row(s) failed (%s): each row was retried alone (requests %s; "
                            "fallback %d since start, logged at the 1st, 10th, 100th, ...)", info.active,
                            info.fallback, sorted({job.tag[0].id for job in self.decoder.active}
                                                  | {job.tag[0].id for job in info.finished}), fallbacks)
        self.metrics.count("steps")
        self.metrics.count("step_tokens", info.tokens)
        self.metrics.count("step_tree_tokens", info.tree_tokens)
        # a step's time and its target forward's: served vs in-process step costs, and the host share of a step
        self.metrics.count("step_seconds", clock.total - total)
        self.metrics.count("target_forward_seconds", clock.target - target)
        for job, new in info.emitted:
            self._emit(job, new)
        for job in info.finished:
            self._row_finished(job)
        self.metrics.gauge("active", len(self.decoder.active))

    def _check(self, request: Request, now: float) -> None:
        if now - request.checked >= CANCEL_CHECK_SECONDS:
            request.checked = now
            try:
                gone = request.sink.cancelled()
            except Exception:  # cannot even ask: its client is gone
                gone = True
            if gone:
                self.metrics.count("cancelled", len(request.rows))
                self._drop(request)
                self._send(request, "close")
                return
        if now >= request.deadline:
            self.metrics.count("deadline_exceeded")
            limit = min(r.timeout for r in request.rows)
            self._fail(request, f"deadline exceeded: the request ran past its {limit:g} s limit (timeout_seconds)",
                       "deadline")
        elif request.waiting and not request.active and \
                now - max(request.arrived, request.stalled_since) > self.max_queue_seconds:
            # waited since it arrived or since its last running row ended: a multi-row request whose first row
            # decoded past the limit was refused as overloaded the round that row ended, with its slot free
            waited = now - max(request.arrived, request.stalled_since)
            self.metrics.count("overloaded", len(request.waiting))
            self._fail(request, f"overloaded: waited {waited:.1f}s for a decoding slot "
                       f"(max_queue_seconds={self.max_queue_seconds:g}); retry later", "unavailable")

    def _admit(self, now: float) -> None:
        """Free slots go to the waiting row of the request with the fewest active rows (then the oldest)."""
        while self.decoder.free:
            candidates = [r for r in self.requests if r.waiting]
            if not candidates:
                return
            request = min(candidates, key=lambda r: r.active)  # stable: the oldest among equals
            i = request.waiting.pop(0)
            job = request.rows[i].job
            try:  # the slot is taken before the reservation is given back: room is never counted twice
                self.decoder.add(job)
            except Exception as e:  # this request alone ends (the decoder gave the slot back); raised out of `tick`,
                # it failed every request in flight
                LOG.exception("request %r: admitting row %d failed", request.id, i)
                self.metrics.count("failed")
                self._fail(request, f"spectrt failed: {type(e).__name__}: {e}", "internal")
                continue
            finally:
                self.release(1)
            request.active += 1
            self.metrics.count("admitted")
            self.metrics.count("prompt_tokens_cached", job.stats.cached_tokens)
            self.metrics.count("prompt_tokens_computed", job.stats.prompt_tokens - job.stats.cached_tokens)
            self.metrics.observe("queue_seconds", now - request.arrived)

    def _emit(self, job: Job, new: list[int]) -> None:
        request, i = job.tag
        if request.done:
            return
        stream, stops = request.streams[i], request.stops[i]
        kept = len(stream.ids)
        delta = stream.push(new, stops if stops.stops else None)
        if job.logprobs is not None:  # those of the tokens kept (a stop string cuts the rest), sent with text
            start = request.logprobs_held[i]
            request.held[i][2] += [(token, *row) for token, row in zip(
                stream.ids[start:], job.logprob_rows[start:len(stream.ids)], strict=True)]
            request.logprobs_held[i] = len(stream.ids)
        if delta:  # a stop string in the text cut it (and the tokens after it) before anything was sent
            self._text(request, i, delta, len(stream.ids) - kept)
        if stream.stopped:  # the row is done
            if job.finish is None:
                self.decoder.finish(job, "stop")
                self._row_finished(job)
            else:  # the decoder ended it in this same step (length, end-of-sequence): the stop string came first
                job.finish = "stop"

    def _text(self, request: Request, i: int, delta: str, tokens: int) -> None:
        """A row's new text: its first text goes out at once (time to first token), later text once
        `stream_interval` tokens are held, and whatever is held when the row ends (`_flush`). Why hold: every send
        wakes the server's and the client's threads on the cores the forward runs on, and a forward waits for its
        slowest thread."""
        held = request.held[i]
        held[0] += delta
        held[1] += tokens
        if request.first_text is None:
            request.first_text = time.monotonic()
            self.metrics.observe("ttft", request.first_text - request.arrived)
        elif held[1] < self.stream_interval:
            return
        self._flush(request, i)

    def _flush(self, request: Request, i: int) -> None:
        held = request.held[i]
        if held[0] or held[1] or held[2]:
            text, tokens, logprobs = held
            held[0], held[1], held[2] = "", 0, []
            self._send(request, "text", i, text, tokens, logprobs)

    def _row_finished(self, job: Job) -> None:
        request, i = job.tag
        if request.done or request.ended[i]:
            return
        request.ended[i] = True
        if job.finish == "error":
            self.metrics.count("failed")
            LOG.error("request %r row %d failed: %s", request.id, i, job.error, exc_info=job.exception)
            self._fail(request, f"spectrt failed: {job.error}", "internal")
            return
        if job.finish == "cancelled":  # ended from outside (a drop): nothing to send
            return
        request.active -= 1
        request.remaining -= 1
        if not request.active and request.waiting:
            request.stalled_since = time.monotonic()
        stream, stats = request.streams[i], job.stats
        rest = "" if stream.stopped else stream.finish()
        if rest:
            self._text(request, i, rest, 0)
        self._flush(request, i)
        if request.done:  # a send raised: the request was dropped and answered
            return
        accepted = sum(stats.accepted) if stats.proposed else 0
        tokens = len(stream.ids)  # the decoder's output up to the stop string's last token
        self.metrics.count("tokens", tokens)
        self.metrics.count("proposed", stats.proposed)
        self.metrics.count("accepted", accepted)
        self.metrics.count("target_passes", stats.target_passes)
        self.metrics.count("requests")
        if stats.target_passes:  # one observation per request: a histogram IPC per target pass cost up to 1,024
            self.metrics.observe("tau", tokens / stats.target_passes)  # round trips on the decode thread (N8)
        prompt = [] if not job.prompt_logprobs else [(job.prompt_ids[0], None, [])] + [
            (token, *row) for token, row in zip(job.prompt_ids[1:], job.prompt_logprob_rows, strict=True)]
        result = RowResult(stream.text, job.finish, tokens, stats.proposed, accepted, stats.target_passes,
                           time.monotonic() - request.arrived, stats.cached_tokens, prompt)
        last = request.remaining == 0
        if last:
            request.done = True
            self.requests.remove(request)
        self._send(request, "row_done", i, result, last)

    # ------------------------------------------------------------------------------------ ending requests
    def _send(self, request: Request, name: str, *args) -> None:
        """Every call into a sink (`text`, `row_done`, `fail`, `close`) goes through here: one that raises ends
        its own request only (never another's), which still gets a final response: a short error, or else its
        close, whichever the sink can still send."""
        try:
            getattr(request.sink, name)(*args)
            return
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self.metrics.count("send_failed")
        LOG.warning("request %r: sink.%s raised %s: ending that request", request.id, name, error)
        self._drop(request)
        endings = ("fail", "close")
        for ending in endings[endings.index(name) + 1 if name in endings else 0:]:
            try:
                if ending == "fail":
                    request.sink.fail(f"spectrt failed: a response could not be sent ({error})", "internal")
                else:
                    request.sink.close()
                return
            except Exception:
                continue

    def _drop(self, request: Request) -> None:
        """Stop all work on a request (its rows leave the queue and their slots) without answering it."""
        if request.waiting:
            self.release(len(request.waiting))
            request.waiting = []
        for row in request.rows:
            if row.job in self.decoder.active:
                self.decoder.cancel(row.job)
        request.active = 0
        request.done = True
        if request in self.requests:
            self.requests.remove(request)

    def _fail(self, request: Request, message: str, code: str) -> None:
        if request.done:
            return
        self._drop(request)
        self._send(request, "fail", message, code)
