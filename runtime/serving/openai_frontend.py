"""OpenAI-compatible HTTP endpoint in front of the Triton deployment: a thin async process, no model in it.

    client --HTTP/SSE--> this frontend (aiohttp) --gRPC stream (tritonclient.grpc.aio)--> tritonserver: spectrt

Routes: `GET /v1/models`, `GET /v1/models/{id}`, `POST /v1/chat/completions`, `POST /v1/completions`, `GET /health`
(200 while the model can serve, else 503: not ready in Triton, or its decode loop wedged: `Triton.ready`). Each
request becomes one request on its own Triton gRPC stream, always streamed upstream (so a stop string can end it
early and streamed and non-streamed answers are assembled from the same deltas); the rules that map bodies to
model inputs and responses to OpenAI JSON are in `openai_api.py`. The frontend holds only the target's tokenizer,
to apply its chat template to `messages`.

- A client that disconnects (stream or not) cancels its handler (aiohttp handler_cancellation), which cancels the
  gRPC stream; the model sees the cancellation and frees the slot within a step.
- Errors are OpenAI error objects: 400 bad request (validated here, or refused by the model), 401 no API key
  (`--api-key`), 403 a foreign Host on a loopback bind, 404 unknown route, 415 not JSON, 503 overloaded / not
  ready, 504 the request's deadline (`--timeout`); a failure after a stream began is an error event followed by
  `data: [DONE]`.
- HTTP stack: aiohttp, chosen by measurement (scripts/openai_overhead.py stacks, bench/results/openai/): a token
  reaches the client ~0.25 ms after it is made (30 µs more than a hand-written asyncio server; 2-4% of a decode
  step here), 27 µs of CPU per event in a burst; one dependency. End to end against the gRPC stream it adds
  0.53 ms per token and 4 ms to the first one (scripts/openai_overhead.py served); see README.

`spectrt serve --openai-port P` starts this process next to tritonserver under the same supervisor; it can also run
alone against any spectrt deployment: `python -m spectrt.cli.openai_frontend --grpc-url HOST:8001 --tokenizer DIR
--port 9000`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import tritonclient.grpc.aio as grpcaio
from aiohttp import web
from spectrt.runtime.decoding.text import StopText
from spectrt.runtime.serving.client import HEALTH_PARAMETER, PERF_OUTPUTS, grpc_inputs
from spectrt.runtime.serving.openai_api import (
    ApiError,
    Call,
    Choice,
    Chunks,
    Limits,
    Outcome,
    completion_body,
    parse_body,
    parse_chat,
    parse_completion,
    tool_prompt,
    upstream_error,
    upstream_rows,
)
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE
from tritonclient.utils import InferenceServerException

LOG = logging.getLogger("spectrt.openai")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_BODY_BYTES = 8 << 20
READY_CACHE_SECONDS = 1.0  # how long Triton's answer to "is the model ready?" is reused (health checks come often)
PROBE_SECONDS = 5.0  # a health probe the model has not answered by then: its instance is stuck as a whole
READY_SECONDS = 8.0  # the whole readiness check (Triton's readiness, the config, the probe): a hung Triton is a 503
LOOPBACK_HOSTS = {"localhost", "127.0.0.1", "::1"}
HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP header name (RFC 9110 token)


# --------------------------------------------------------------------------- the Triton side


@dataclass
class Piece:
    """One response of the model's stream."""

    text: str = ""
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens from the prefix cache (final responses)
    tokens: int = 0
    final: bool = False
    finish_reason: str | None = None
    perf: dict = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)  # the logprobs content entries of this response's tokens
    index: int = 0  # the choice (the model's row, `batch_index`) it belongs to
    prompt_logprobs: list[dict] = field(default_factory=list)  # final responses of rows that asked

    @classmethod
    def of(cls, result) -> Piece:
        piece = cls()
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            piece.text = b"".join(text.reshape(-1).tolist()).decode("utf-8")
        for name, attr in (("num_output_tokens", "tokens"), ("num_input_tokens", "prompt_tokens"),
                           ("num_cached_tokens", "cached_tokens")):
            value = result.as_numpy(name)
            if value is not None and value.size:
                setattr(piece, attr, int(value.reshape(-1)[0]))
        reason = result.as_numpy("finish_reason")
        if reason is not None and reason.size:
            piece.finish_reason = reason.reshape(-1)[0].decode()
        index = result.as_numpy("batch_index")
        if index is not None and index.size:
            piece.index = int(index.reshape(-1)[0])
        for name, attr in (("output_logprobs", "logprobs"), ("output_prompt_logprobs", "prompt_logprobs")):
            value = result.as_numpy(name)
            if value is not None and value.size:
                setattr(piece, attr, json.loads(value.reshape(-1)[0]))
        for name in PERF_OUTPUTS:
            value = result.as_numpy(name)
            if value is not None and value.size:
                piece.perf[name] = value.reshape(-1)[0].item()
        params = result.get_response().parameters
        piece.final = "triton_final_response" in params and params["triton_final_response"].bool_param
        return piece


class Triton:
    """The deployed model over gRPC: one channel, one bidirectional stream per request."""

    def __init__(self, url: str, model: str):
        # tritonclient's own channel options (message sizes, keepalive), plus a reconnect within 2 s of a restarted
        # server (spectrt serve's supervisor restarts one whose python stub died): gRPC's backoff grows to 120 s
        keepalive = grpcaio.KeepAliveOptions()
        self.client = grpcaio.InferenceServerClient(url, channel_args=[
            ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
            ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
            ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
            ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
            ("grpc.initial_reconnect_backoff_ms", 500), ("grpc.max_reconnect_backoff_ms", 2000)])
        self.model = model
        self.limits: Limits | None = None
        self.checked = -math.inf  # when the model was last asked whether it can serve
        self.trouble: tuple[str, str] | None = ("not asked yet", "not_ready")  # why not: (message, error code)
        self.asking = asyncio.Lock()  # one check at a time: callers that waited read its answer

    async def ready(self) -> bool:
        """Can the model serve now? Asked at most every READY_CACHE_SECONDS; the first time it is ready, its limits
        are read from its config. Two questions: Triton's readiness (unloaded, reloading or its stub dead: no), then
        the model's health probe (`probe`), since a wedged decode loop leaves the model READY. The whole check, and
        the wait for another caller's, takes at most READY_SECONDS: a hung tritonserver (`kill -STOP`) answered
        none of them, and every request and /health waited forever behind the check's lock."""
        try:
            return await asyncio.wait_for(self._ready(), READY_SECONDS)
        except asyncio.TimeoutError:
            self.trouble = (f"Triton did not say within {READY_SECONDS:g} s whether the model {self.model} can serve: "
                            "retry shortly", "unavailable")
            self.checked = time.monotonic()
            return False

    async def _ready(self) -> bool:
        async with self.asking:
            if time.monotonic() - self.checked < READY_CACHE_SECONDS:
                return self.trouble is None
            trouble = (f"the model {self.model} is not ready: retry shortly", "not_ready")
            try:
                if await self.client.is_model_ready(self.model):
                    if self.limits is None:
                        config = (await self.client.get_model_config(self.model, as_json=True))["config"]
                        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
                        limit = int(params.get("max_tokens_limit") or 1024)
                        self.limits = Limits(limit, min(int(params.get("default_max_tokens") or 128), limit),
                                             int(params.get("max_seq_len") or 2048),
                                             float(params.get("max_request_seconds") or 300.0))
                    reason = await self.probe()
                    trouble = None if reason is None else (reason, "unhealthy")
            except InferenceServerException:
                pass
            self.trouble, self.checked = trouble, time.monotonic()
            return trouble is None

    async def probe(self) -> str | None:
        """None if the model's decode loop advances, else why not: the model's answer to a health probe (a request
        with the parameter HEALTH_PARAMETER, answered at once by its `execute`, which runs beside the loop, and never
        decoded), or that no answer came within PROBE_SECONDS. Why a request: Triton's readiness cannot see the loop
        (the model's `_probe` says why), and this frontend reaches the model only through Triton's gRPC API."""
        answered = asyncio.Event()
        inputs = grpc_inputs({"text_input": ""})

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": "spectrt-health-probe",
                   "parameters": {HEALTH_PARAMETER: True}}
            await answered.wait()  # our half of the stream stays open until the answer

        responses = self.client.stream_infer(requests())
        try:
            _, error = await asyncio.wait_for(responses.__anext__(), PROBE_SECONDS)
        except asyncio.TimeoutError:
            responses.cancel()
            return f"the model {self.model} did not answer a health probe within {PROBE_SECONDS:g} s"
        except StopAsyncIteration:
            return "Triton is unavailable: the health probe's stream ended without an answer"
        except grpc.RpcError as e:
            return f"Triton is unavailable: {e.details() if hasattr(e, 'details') else e}"
        finally:
            answered.set()
        return None if error is None else error.message()

    async def require(self) -> Limits:
        """The model's limits, once it can serve now (else 503 saying why not)."""
        if not await self.ready():
            message, code = self.trouble
            raise ApiError(503, message, None, code)
        return self.limits

    async def generate(self, fields: dict, request_id: str) -> AsyncIterator[Piece]:
        """The model's responses to one request, up to the final one; leaving early cancels the request upstream."""
        finished = asyncio.Event()
        inputs = grpc_inputs(fields)  # before the stream opens: an error inside gRPC's request iterator has no answer

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id,
                   "parameters": {"triton_enable_empty_final_response": True}}
            await finished.wait()  # our half of the stream stays open until the final response

        responses = self.client.stream_infer(requests())
        try:
            while True:
                try:
                    result, error = await responses.__anext__()
                except StopAsyncIteration:
                    raise ApiError(500, "the model's stream ended without a final response", None,
                                   "internal_error") from None
                except grpc.RpcError as e:
                    message = f"Triton is unavailable: {e.details() if hasattr(e, 'details') else e}"
                    # health says so at once: a cached "ready" answered /health 200 for up to READY_CACHE_SECONDS
                    # after the server went away (a restart after a python stub died)
                    self.trouble, self.checked = (message, "unavailable"), time.monotonic()
                    raise ApiError(503, message, None, "unavailable") from None
                if error is not None:
                    raise upstream_error(error.message())
                piece = Piece.of(result)
                if piece.final:
                    finished.set()
                yield piece
                if piece.final:
                    return
        finally:
            if not finished.is_set():
                responses.cancel()  # the client went away, a stop string matched, or the deadline passed
                finished.set()


# --------------------------------------------------------------------------- the chat template


class ChatTemplate:
    """The target's chat template (the tokenizer's), rendered to text for the model's `text_input`."""

    def __init__(self, tokenizer_dir: Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        bos = self.tokenizer.bos_token
        # the model tokenizes text_input with special tokens: a BOS the template writes would then appear twice
        ids = self.tokenizer("x").input_ids
        self.strip_bos = bos if bos and ids and ids[0] == self.tokenizer.bos_token_id else None

    def render(self, messages: list[dict], functions: list[dict] | None = None) -> str:
        """The prompt text; `functions` the model may call, in the template's own `tools` where it renders them,
        else described in the system turn (`tool_prompt`)."""
        if not self.tokenizer.chat_template:
            raise ApiError(400, "this model has no chat template: use /v1/completions", "messages")
        tools = None
        if functions:
            if "tools" in self.tokenizer.chat_template:
                tools = [{"type": "function", "function": f} for f in functions]
            else:
                messages = tool_prompt(messages, functions)
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # the template's own checks (e.g. roles that must alternate)
            raise ApiError(400, f"the chat template refused the messages: {e}", "messages") from None
        if self.strip_bos and text.startswith(self.strip_bos):
            text = text[len(self.strip_bos):]
        return text


# --------------------------------------------------------------------------- HTTP


def is_loopback(host: str) -> bool:
    try:
        return host in LOOPBACK_HOSTS or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Frontend:
    """The routes. `host`: the address it is bound to; on a loopback one only loopback `Host` headers are served
    (a web page that rebinds its DNS name to 127.0.0.1 cannot read answers). `api_key`: every route but /health
    needs `Authorization: Bearer <api_key>`. `allowed_origins`: web pages (origins, or "*" for any) that may call
    it from a browser (CORS: their preflight is answered and every response names them); none by default, so a
    page elsewhere can neither send JSON nor read an answer."""

    def __init__(self, triton: Triton, template: ChatTemplate | None, served: str, timeout: float,
                 host: str = "127.0.0.1", api_key: str | None = None, drain_seconds: float = 5.0,
                 allowed_origins: tuple[str, ...] = ()):
        self.triton, self.template, self.served, self.timeout = triton, template, served, timeout
        self.loopback, self.api_key = is_loopback(host), api_key
        self.allowed_origins = frozenset(o.strip().rstrip("/") for o in allowed_origins if o.strip())
        self.started = int(time.time())
        # a graceful stop: new answers are refused, open ones get `drain_seconds`, then `drained` ends them
        self.drain_seconds, self.stopping, self.open_answers = drain_seconds, False, 0
        self.drained = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application(middlewares=[errors, self.guard], client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.on_shutdown.append(self.drain)
        app.on_cleanup.append(self._close)
        app.on_response_prepare.append(self._cors_headers)  # every response, errors and streams included
        return app

    def _allowed(self, request: web.Request) -> str | None:
        """The request's Origin if it may call from a browser (an allowed origin, or any with "*"), else None."""
        origin = request.headers.get("Origin")
        if origin and ("*" in self.allowed_origins or origin.rstrip("/") in self.allowed_origins):
            return origin
        return None

    async def _cors_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        if self.allowed_origins:
            response.headers.setdefault("Vary", "Origin")  # caches keep one answer per origin
        origin = self._allowed(request)
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin

    def _preflight(self, request: web.Request) -> web.Response | None:
        """The answer to an allowed page's CORS preflight (before the API key check: a preflight carries none)."""
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return None
        if self._allowed(request) is None:
            return None  # routed as any OPTIONS: 405, and the browser refuses the page's request
        # the headers the page asks for, granted as asked (an allowed origin still needs the API key): the OpenAI JS
        # SDK in a browser sends X-Stainless-* headers, and a browser refuses a request with any header not granted
        asked = request.headers.get("Access-Control-Request-Headers", "")
        names = [h.strip() for h in asked.split(",") if h.strip()]
        granted = ", ".join(h for h in names if HEADER_NAME.fullmatch(h)) or "Authorization, Content-Type"
        return web.Response(status=204, headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": granted,
            "Access-Control-Max-Age": "600",
            "Vary": "Origin, Access-Control-Request-Headers"})

    async def drain(self, _app=None) -> None:
        """At SIGTERM/SIGINT (aiohttp runs this after it stopped listening, before it closes connections): open
        answers get `drain_seconds` to finish, then each still open ends properly with a 503 "stopping" error (a
        stream: an error event and [DONE]) instead of being cut mid-answer."""
        self.stopping = True
        deadline = time.monotonic() + self.drain_seconds
        while self.open_answers and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.drained.set()
        while self.open_answers:  # each ends at once now: cancelled upstream, its error written
            await asyncio.sleep(0.01)

    async def _close(self, _app) -> None:
        await self.triton.client.close()

    @web.middleware
    async def guard(self, request: web.Request, handler) -> web.StreamResponse:
        """Who may call: a loopback Host on a loopback bind, the API key if one is set, and JSON bodies only (a
        cross-site page can POST text/plain without asking; application/json needs a CORS preflight, granted only to
        `allowed_origins`)."""
        if self.loopback and not is_loopback((request.url.host or "").strip("[]")):
            raise ApiError(403, f"Host {request.host!r} is not served: this endpoint is bound to a loopback address "
                                "(connect to 127.0.0.1 or localhost)", None, "forbidden_host")
        preflight = self._preflight(request)
        if preflight is not None:
            return preflight
        if self.api_key is not None and request.path != "/health":
            given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), self.api_key.encode()):
                raise ApiError(401, "invalid or missing API key: send `Authorization: Bearer <key>`", None,
                               "invalid_api_key")
        if request.method == "POST" and request.content_type != "application/json":
            raise ApiError(415, f"Content-Type must be application/json, got {request.content_type!r}", None,
                           "unsupported_media_type")
        return await handler(request)

    async def health(self, _request: web.Request) -> web.Response:
        """200 only while the model can serve (Triton's readiness, then the model's health probe: `Triton.ready`, at
        most a second old), else 503 saying why not."""
        await self.triton.require()
        return web.json_response({"status": "ok"})

    def _card(self) -> dict:
        card = {"id": self.served, "object": "model", "created": self.started, "owned_by": "spectrt"}
        if self.triton.limits is not None:
            card["max_model_len"] = self.triton.limits.max_seq_len
        return card

    async def models(self, _request: web.Request) -> web.Response:
        await self.triton.require()  # listed only once servable: a client that polls it may then send requests
        return web.json_response({"object": "list", "data": [self._card()]})

    async def model(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != self.served:
            raise ApiError(404, f"the model `{request.match_info['model']}` does not exist", "model",
                           "model_not_found")
        await self.triton.require()
        return web.json_response(self._card())

    async def chat(self, request: web.Request) -> web.StreamResponse:
        if self.template is None:
            raise ApiError(400, "this frontend runs without a tokenizer (--tokenizer): use /v1/completions")
        body = parse_body(await request.read())
        limits = await self.triton.require()
        return await self.answer(request, parse_chat(body, self.served, limits, self.template.render), "chatcmpl")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(await request.read())
        limits = await self.triton.require()
        return await self.answer(request, parse_completion(body, self.served, limits), "cmpl")

    async def answer(self, request: web.Request, call: Call, prefix: str) -> web.StreamResponse:
        """Run the call until it ends, its deadline passes (504) or a stop's drain runs out (503); both cancel it
        upstream, and a stream that began ends with an error event and [DONE] (its status is already 200)."""
        if self.stopping:
            raise ApiError(503, "the server is stopping: retry the request", None, "unavailable")
        rid, sent, until = f"{prefix}-{uuid.uuid4().hex}", [], time.monotonic() + self.timeout
        work = asyncio.ensure_future(self._answer(request, call, rid, sent, until))
        drained = asyncio.ensure_future(self.drained.wait())
        self.open_answers += 1
        try:
            done, _ = await asyncio.wait({work, drained}, timeout=self.timeout, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            await _cancel(work)
            if self.drained.is_set():
                error = ApiError(503, "the server is stopping: retry the request", None, "unavailable")
            else:
                error = ApiError(504, f"the request's deadline passed ({self.timeout:g} s; raise it with "
                                      "`spectrt serve --openai-timeout`)", None, "deadline_exceeded")
            if not sent:
                raise error
            await sent[0].write(Chunks.error(error))
            return sent[0]
        finally:  # also when the client went away (aiohttp cancels this handler): the upstream request goes too
            drained.cancel()
            await _cancel(work)
            self.open_answers -= 1

    async def _answer(self, request: web.Request, call: Call, rid: str, sent: list,
                      until: float) -> web.StreamResponse:
        created, outcome = int(time.time()), Outcome(choices=[Choice() for _ in range(call.rows)])
        stops = [StopText(call.stop) for _ in range(call.rows)]
        ended = [False] * call.rows  # per choice: its last response (the one with its finish_reason) arrived
        seconds = min(max(until - time.monotonic(), 1e-3), self.triton.limits.max_request_seconds)
        pieces = self.triton.generate(upstream_rows(call, seconds), rid)  # the model ends it at the deadline too
        try:
            piece = await pieces.__anext__()  # the model's first answer (text or refusal) before any header
            chunks = Chunks(call, rid, created, self.served) if call.stream else None
            if chunks is not None:
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
                sent.append(response)
                if call.echo is not None:  # the prompt first, in each choice
                    for index in range(call.n):
                        await response.write(chunks.text(call.echo, None, index))
            while True:
                index = piece.index
                choice, stop = outcome.choices[index], stops[index]
                last = piece.final or piece.finish_reason is not None  # this choice's last response
                if stop.stopped and not last:
                    # after a stop string the choice's last response (its counts and metrics) follows at once: the
                    # model got every stop string as a stop word and ended the answer there itself, its token count
                    # with the token that completed it. More text instead means a model that goes on (one that
                    # predates matching stop words on its text): it is dropped, and once every choice is stopped or
                    # ended the request is cancelled; usage then counts the tokens of the responses read
                    if all(s.stopped or e for s, e in zip(stops, ended, strict=True)):
                        break
                else:
                    outcome.prompt_tokens = piece.prompt_tokens or outcome.prompt_tokens
                    outcome.cached_tokens = piece.cached_tokens or outcome.cached_tokens
                    choice.completion_tokens += piece.tokens
                    text = stop.feed(piece.text)  # "" once a stop string matched
                    if last:
                        ended[index] = True
                        text += stop.flush()
                        choice.finish_reason, choice.perf = piece.finish_reason, piece.perf
                        choice.prompt_logprobs = piece.prompt_logprobs
                        if piece.finish_reason not in ("stop", "length") and not stop.stopped:
                            # every answer the model ends says why: this one was cut off upstream (it used to reach
                            # clients as a 200 with the text so far and "stop")
                            error = ApiError(502, "the model ended the answer without a finish_reason: it may be "
                                             "cut short; retry the request", None, "upstream_error")
                            if chunks is None:
                                raise error
                            await response.write(Chunks.error(error))
                            return response
                    choice.text += text
                    choice.logprobs += piece.logprobs
                    if chunks is not None and (text or piece.logprobs):
                        await response.write(chunks.text(text, piece.logprobs, index))
                    if piece.final:
                        break
                try:
                    piece = await pieces.__anext__()
                except ApiError as e:
                    if chunks is None:
                        raise
                    await response.write(Chunks.error(e))
                    return response
        finally:
            await pieces.aclose()  # cancels the upstream request unless it finished
        for choice, stop in zip(outcome.choices, stops, strict=True):
            if stop.stopped:
                choice.finish_reason = "stop"
        if chunks is None:
            return web.json_response(completion_body(call, rid, created, self.served, outcome),
                                     dumps=_dumps)
        for index, choice in enumerate(outcome.choices):
            await response.write(chunks.finish(choice, index))
        await response.write(chunks.done(outcome))
        await response.write_eof()
        return response


async def _cancel(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it ended (its `finally` closed the upstream request)."""
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False)


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure as an OpenAI error object with its HTTP status."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error_response(e)
    except web.HTTPException as e:  # unknown route (404), wrong method (405), body too large (413)
        if e.status < 400:
            raise
        response = _error_response(ApiError(e.status, f"{e.reason}: {request.method} {request.path}"))
        if "Allow" in e.headers:  # a 405 names the methods the route takes (RFC 9110)
            response.headers["Allow"] = e.headers["Allow"]
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client went away: nobody to answer
    except Exception as e:
        LOG.exception("request failed")
        return _error_response(ApiError(500, f"spectrt frontend failed: {type(e).__name__}: {e}", None,
                                        "internal_error"))


def _error_response(error: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if error.status == 503 else None
    return web.json_response(error.body(), status=error.status, headers=headers)


def run(grpc_url: str, model: str, tokenizer: Path | None, host: str, port: int, timeout: float,
        drain_seconds: float, api_key: str | None, allowed_origins: tuple[str, ...] = ()) -> None:
    """Serve the OpenAI API until SIGTERM/SIGINT (`python -m spectrt.cli.openai_frontend` parses the flags)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    template = ChatTemplate(tokenizer) if tokenizer else None

    async def make_app() -> web.Application:  # the gRPC aio channel belongs to the server's event loop
        return Frontend(Triton(grpc_url, model), template, model, timeout, host, api_key or None,
                        drain_seconds, allowed_origins).app()

    LOG.info("OpenAI endpoint on http://%s:%d/v1 -> Triton %s model %s", host, port, grpc_url, model)
    # handler_cancellation: a client that disconnects cancels its handler, and so its upstream request;
    # shutdown_timeout: what is left after Frontend.drain (on_shutdown) ended every open answer
    web.run_app(make_app(), host=host, port=port, handler_cancellation=True, shutdown_timeout=1.0,
                print=None, access_log=logging.getLogger("spectrt.openai.access"),
                access_log_format='%a "%r" %s %b %Tf')
