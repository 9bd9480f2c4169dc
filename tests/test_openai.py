"""The OpenAI-compatible endpoint: its request/response rules on small dicts, then end to end with the real
tritonserver and the real `openai` Python client.

One server for the module (one instance batching up to 2 requests, queue of 1, the 4-layer slice as draft with tree
2,1, a short context and max_tokens limit) with the frontend on a free port; the finalizer stops it and checks that
no process is left. Two more launches check the supervisor's guarantees for the frontend (`spectrt serve
--openai-port 0` killed outright; the frontend dying). No wall-clock thresholds: texts, counters, metrics, states.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch
from aiohttp import web
from conftest import launch_serve, scrape_metrics
from spectrt.runtime.decoding.text import StopText
from spectrt.runtime.serving.client import HEALTH_PARAMETER, GrpcSession
from spectrt.runtime.serving.openai_api import (
    Limits,
    bad,
    chat_messages,
    parse_body,
    parse_chat,
    parse_completion,
    speculative_metrics,
    upstream_error,
    upstream_rows,
)
from spectrt.runtime.serving.openai_frontend import Frontend, Triton
from spectrt.runtime.serving.serve import SHM_DIR, TritonServer, free_port

TREE = "2,1"
LIMIT = 48
# The served module's own cap, far above what answers use: a request held busy (min_tokens = BUSY) lasts seconds on
# any CPU, so a test that fills every slot sees them all taken (48 tokens ran out in under a second on a fast CPU,
# before a scrape could see two active) and is cancelled the moment its socket closes.
BUSY = 448
TIMEOUT = 180.0
MAX_ACTIVE = 2
MAX_QUEUE = 1
LIMITS = Limits(max_tokens=LIMIT, default_max_tokens=16, max_seq_len=256)
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name three colors."}]


# --------------------------------------------------------------------------- rules (no server)


def _chat(**body):
    render = lambda messages, functions: json.dumps(messages if not functions else [messages, functions])  # noqa: E731
    return parse_chat({"model": "spectrt", "messages": CHAT, **body}, "spectrt", LIMITS, render)


@pytest.mark.unit
def test_stop_text_holds_back_what_may_begin_a_stop_string():
    stop = StopText(["END", "\n\n"])
    sent = [stop.feed(d) for d in ("Hello E", "N", "xt wor", "ld\n", "\nmore")]
    assert sent == ["Hello ", "", "ENxt wor", "ld", ""] and stop.stopped
    assert "".join(sent) == "Hello ENxt world"
    stop = StopText(["abab"])
    assert [stop.feed(d) for d in ("xab", "a", "b tail")] == ["x", "", ""] and stop.stopped
    stop = StopText(["zz"])
    assert stop.feed("abz") == "ab" and not stop.stopped and stop.flush() == "z"
    earliest = StopText(["world", "lo"])
    assert earliest.feed("hello world") == "hel"
    assert StopText([]).feed("anything") == "anything"


@pytest.mark.unit
def test_chat_fields_become_model_inputs():
    call = _chat(max_completion_tokens=20, temperature=0.5, top_p=0.9, top_k=-1, seed=-1, stop="\n",
                 stream=True, stream_options={"include_usage": True}, ignore_eos=True, tree="none",
                 user="u1", metadata={"k": "v"}, logit_bias={}, n=1, presence_penalty=0.0, logprobs=False,
                 tool_choice="none", response_format={"type": "text"}, frequency_penalty=None)
    assert call.kind == "chat" and call.stream and call.include_usage and call.stop == ["\n"]
    assert call.fields == {"max_tokens": 20, "temperature": 0.5, "top_p": 0.9, "tree": "none", "top_k": 0,
                           "seed": (1 << 64) - 1, "min_length": 20, "stop_words": ["\n"],
                           "text_input": json.dumps(CHAT), "apply_chat_template": False}
    assert _chat().fields["max_tokens"] == LIMITS.default_max_tokens and not _chat().stream
    assert _chat(min_tokens=5).fields["min_length"] == 5
    assert chat_messages({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                          {"type": "text", "text": "b"}]},
                                       {"role": "assistant", "content": "c", "refusal": None}]}) == [
        {"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "c"}]


@pytest.mark.unit
def test_every_stop_string_goes_to_the_model_and_its_validator_takes_the_longest(tokenizer):
    """Every stop string is sent as a stop word, so the model ends the answer there and counts its tokens itself
    (those past 32 bytes used to be matched here only: the model went on and usage counted tokens past the stop
    string). The longest the API accepts (16 strings of 256 four-byte characters) pass the model's validator: one past
    its token limit is kept for the text match only."""
    from spectrt.runtime.serving.requests import Limits as ModelLimits
    from spectrt.runtime.serving.requests import make_row

    call = _chat(stop=["日" * 256, "\n", "x" * 33])
    assert call.stop == ["日" * 256, "\n", "x" * 33] == call.fields["stop_words"]
    assert _chat(stop="y" * 40).fields["stop_words"] == ["y" * 40]
    longest = ["😀" * 255 + chr(0x1F600 + i) for i in range(16)]
    words = _chat(stop=longest).fields["stop_words"]
    assert [len(w.encode()) for w in words] == [1024] * 16
    row = make_row({"text_input": b"hi", "stop_words": [w.encode() for w in words + ["\n"]]}, ModelLimits(),
                   lambda p, chat: tokenizer.encode(p), lambda w: tokenizer.encode(w, add_special_tokens=False))
    assert row.stop_strings == words + ["\n"]
    assert row.job.stop_words == [tokenizer.encode("\n", add_special_tokens=False)]  # the token form: "\n" only


@pytest.mark.unit
def test_completion_prompt_is_sent_as_is():
    call = parse_completion({"model": "spectrt", "prompt": ["Once upon"], "max_tokens": 4, "echo": False},
                            "spectrt", LIMITS)
    assert call.kind == "text" and call.fields == {"max_tokens": 4, "text_input": "Once upon",
                                                   "apply_chat_template": False}


REFUSED = [
    ({"messages": "hi"}, "messages must be a non-empty list"),
    ({"messages": []}, "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "only text parts"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, "tool_calls must be"),
    ({"model": None}, "model is required"),
    ({"max_tokens": 0}, r"max_tokens must be in \[1, 48\]"),
    ({"max_tokens": LIMIT + 1}, r"max_tokens must be in \[1, 48\].*got 49"),
    ({"max_tokens": 8.5}, "max_tokens must be an integer"),
    ({"max_completion_tokens": LIMIT + 1}, r"^max_completion_tokens must be in \[1, 48\].*got 49"),
    ({"temperature": 2.5}, r"temperature must be in \[0, 2\]"),
    ({"temperature": 10 ** 400}, r"temperature must be in \[0, 2\], got 1000000000"),  # was an OverflowError: 500
    ({"top_p": -(10 ** 400)}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"n": 9}, r"n must be in \[1, 8\]"),
    ({"logit_bias": {"x": -100}}, "logit_bias must map token ids"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be in \[0, 20\]"),
    ({"logprobs": 1}, "logprobs must be true or false"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\]"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be in \(0, 100\]"),
    ({"tools": [{"type": "function"}]}, "tools must be a list of"),
    ({"tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
      "function": {"name": "g"}}}, 'tool_choice names "g", which is not among tools'),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "send tool_choice or response_format"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}]},
     r"function: {name, arguments \(JSON text\)}"),
    ({"stop": ["a"] * 17}, "more than 16"),
    ({"stop": [""]}, "each stop string"),
    ({"stop": 3}, "stop must be a string"),
    ({"stream_options": {"include_usage": True}}, "only allowed when stream is true"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "include_usage"),
    ({"min_tokens": LIMIT + 1, "max_tokens": LIMIT}, r"min_tokens must be in \[0, 48\]"),
    ({"frobnicate": 1}, "unrecognized request argument: frobnicate"),
]


@pytest.mark.unit
@pytest.mark.parametrize("body, message", REFUSED, ids=[m for _, m in REFUSED])
def test_bad_chat_bodies_are_refused_with_a_reason(body, message):
    with pytest.raises(type(bad(""))) as refused:
        _chat(**body)
    assert refused.value.status == 400 and re.search(message, refused.value.message), refused.value.message
    error = refused.value.body()["error"]
    assert error["type"] == "invalid_request_error" and set(error) == {"message", "type", "param", "code"}
    named = re.match(r"\^?(\w+) must be", message)  # the error's param is the field the body sent
    if named and named.group(1) in body:
        assert error["param"] == named.group(1)


@pytest.mark.unit
def test_an_unknown_model_is_404_not_found():
    """As OpenAI's API and vLLM answer it: 404 with code model_not_found, the served model named."""
    with pytest.raises(type(bad(""))) as refused:
        _chat(model="gpt-4o")
    error = refused.value.body()["error"]
    assert refused.value.status == 404 and error["code"] == "model_not_found" and error["param"] == "model"
    assert "the model `gpt-4o` does not exist: this server serves `spectrt`" in error["message"]


@pytest.mark.unit
def test_completion_bodies_refused():
    for body, message in (({"prompt": [1, 2, 3]}, "token-id prompts"), ({"prompt": ["a", "b"]}, "batches"),
                          ({"prompt": "  "}, "non-empty"),
                          ({"prompt": "x", "echo": True, "logprobs": 1, "stream": True}, "send stream false"),
                          ({"prompt": "x", "best_of": 2, "n": 3}, "best_of (2) must be at least n (3)"),
                          ({"prompt": "x", "best_of": 2, "stream": True}, "best_of > n is answered whole"),
                          ({"prompt": "x", "best_of": 9}, "best_of must be in [1, 8]"),
                          ({"prompt": "x", "messages": []}, "unrecognized request argument: messages")):
        with pytest.raises(type(bad(""))) as refused:
            parse_completion({"model": "spectrt", **body}, "spectrt", LIMITS)
        assert message in refused.value.message


@pytest.mark.unit
def test_speculative_metrics_and_upstream_errors():
    perf = {"target_passes": 10, "total_accepted_draft_tokens": 8, "total_draft_tokens": 40, "output_tokens": 18}
    assert speculative_metrics(perf) == {"mean_acceptance_length": 1.8, "draft_acceptance_rate": 0.2,
                                         "num_spec_steps": 10, "num_accepted_draft_tokens": 8,
                                         "num_draft_tokens": 40}
    assert speculative_metrics({}) is None
    assert upstream_error("overloaded: 64 requests are already queued").status == 503
    assert upstream_error("spectrt failed: boom").status == 500
    assert upstream_error("the server is stopping: retry on another instance").status == 503
    assert upstream_error("deadline exceeded: the request ran past its 5 s limit (timeout_seconds)").status == 504


@pytest.mark.unit
def test_upstream_errors_are_mapped_by_origin_not_by_words_inside():
    """A refusal that quotes "overloaded" is still the client's error (400: the SDK would retry a 503); Triton's own
    errors (the model unknown or not ready) and the scheduler's restart are not the client's (503, 500)."""
    statuses = {message: upstream_error(message).status for message in (
        "invalid request: tree 'overloaded' is malformed: give branching per depth as integers, e.g. 2,1",
        "invalid request: max_tokens must be in [1, 48] (this model's limit), got 49",
        "Request for unknown model: 'spectrt' is not found",
        "spectrt failed: the scheduler restarted after an internal error: retry")}
    assert list(statuses.values()) == [400, 400, 503, 500]


@pytest.mark.unit
def test_lone_surrogates_and_top_k_past_int32_are_refused():
    """Either used to reach gRPC's request iterator and end the connection with no answer (or wrap in int32)."""
    for raw in ('{"model": "spectrt", "prompt": "\\ud800"}', '{"stop": ["a\\udfff"]}', '{"\\ud800": 1}'):
        with pytest.raises(type(bad(""))) as refused:
            parse_body(raw.encode())
        assert refused.value.status == 400 and "lone surrogate" in refused.value.message
    for top_k in (1 << 31, 1 << 63):
        with pytest.raises(type(bad(""))) as refused:
            _chat(top_k=top_k)
        assert refused.value.status == 400 and refused.value.param == "top_k"
    assert _chat(top_k=(1 << 31) - 1).fields["top_k"] == (1 << 31) - 1


class _FakeGrpc:
    """The tritonclient.grpc.aio calls the frontend makes outside a generation; `ready` is what Triton says,
    `health` the model's answer to its health probe (None: "ok"; "hang": none at all)."""

    def __init__(self, max_seconds: float = 300.0):
        self.ready, self.asked, self.max_seconds, self.sent = True, 0, max_seconds, None
        self.health, self.probes, self.cancelled = None, 0, 0

    async def is_model_ready(self, model):
        self.asked += 1
        if self.ready == "hang":  # a stopped tritonserver (kill -STOP): the call never returns
            await asyncio.Event().wait()
        return self.ready

    async def get_model_config(self, model, as_json=True):
        return {"config": {"parameters": {"max_tokens_limit": {"string_value": str(LIMIT)},
                                          "max_request_seconds": {"string_value": str(self.max_seconds)}}}}

    async def close(self):
        pass

    def stream_infer(self, requests):
        return _FakeStream(requests, self)


class _Error:
    def __init__(self, message: str):
        self.text = message

    def message(self) -> str:
        return self.text


class _FakeStream:
    """One upstream stream: a health probe gets the fake's `health`; any other request is recorded (`fake.sent`),
    then the model refuses it."""

    def __init__(self, requests, fake):
        self.requests, self.fake = requests, fake

    async def __anext__(self):
        import asyncio

        request = await self.requests.__anext__()
        if (request.get("parameters") or {}).get(HEALTH_PARAMETER) is True:
            self.fake.probes += 1
            if self.fake.health == "hang":
                await asyncio.Event().wait()
            return (object(), None) if self.fake.health is None else (None, _Error(self.fake.health))
        self.fake.sent = request
        return None, _Error("invalid request: refused by the fake")

    def cancel(self):
        self.fake.cancelled += 1


FRONTEND = web.AppKey("frontend", Frontend)


def _frontend(calls, host: str = "127.0.0.1", api_key: str | None = None, fake: _FakeGrpc | None = None,
              allowed_origins: tuple[str, ...] = ()):
    """Run `calls(client, triton, fake)` against an in-process frontend whose Triton is `_FakeGrpc`."""
    import asyncio

    from aiohttp.test_utils import TestClient, TestServer

    async def run():
        triton = Triton("127.0.0.1:1", "spectrt")
        await triton.client.close()
        triton.client = grpc = fake or _FakeGrpc()
        frontend = Frontend(triton, None, "spectrt", 5.0, host, api_key, allowed_origins=allowed_origins)
        app = frontend.app()
        app[FRONTEND] = frontend
        async with TestClient(TestServer(app)) as client:
            return await calls(client, triton, grpc)

    return asyncio.run(run())


@pytest.mark.unit
def test_cross_site_pages_call_only_from_allowed_origins():
    """CORS: a page from an allowed origin gets its preflight answered (before the API key: a preflight has none),
    with every header it asked for granted (the OpenAI JS SDK in a browser sends X-Stainless-* headers; a malformed
    name is left out), and its origin on every response, errors included; any other origin gets neither, and
    without allowed origins (the default) no page elsewhere can call."""
    page, other = "http://localhost:3000", "http://evil.example"
    preflight = {"Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-lang,x-stainless-os,a b"}

    async def calls(client, triton, fake):
        out = []
        for origin in (page, other):
            ok = await client.options("/v1/chat/completions", headers={"Origin": origin, **preflight})
            listed = await client.get("/v1/models", headers={"Origin": origin, "Authorization": "Bearer s3cret"})
            refused = await client.get("/v1/models", headers={"Origin": origin})
            out.append((ok.status, ok.headers.get("Access-Control-Allow-Origin"),
                        ok.headers.get("Access-Control-Allow-Headers"), listed.status,
                        listed.headers.get("Access-Control-Allow-Origin"), refused.status,
                        refused.headers.get("Access-Control-Allow-Origin")))
        return out

    allowed, denied = _frontend(calls, api_key="s3cret", allowed_origins=(page + "/",))
    assert allowed == (204, page, "authorization, content-type, x-stainless-lang, x-stainless-os", 200, page, 401,
                       page)
    # not a granted preflight: the key check refuses it like any other request without the key
    assert denied[0] == 401 and denied[1] is None and denied[3:] == (200, None, 401, None)

    async def default(client, triton, fake):
        r = await client.options("/v1/completions", headers={"Origin": page, **preflight})
        return r.status, r.headers.get("Access-Control-Allow-Origin")

    assert _frontend(default) == (405, None)
    assert _frontend(default, allowed_origins=("*",)) == (204, page)


@pytest.mark.unit
def test_health_follows_the_model_not_its_first_ready():
    """/health (and /v1/models) ask Triton, at most a second apart: 503 once the model is unloaded or its stub died,
    200 again when it is back; it used to stay 200 forever after the first ready."""

    async def calls(client, triton, fake):
        statuses = [(await client.get("/health")).status]
        fake.ready = False
        statuses.append((await client.get("/health")).status)  # within the second: Triton is not asked again
        asked = fake.asked
        triton.checked -= 2  # the cached answer is older than a second (no waiting on the clock)
        down = await client.get("/health")
        statuses += [down.status, (await client.get("/v1/models")).status]
        fake.ready = True
        triton.checked -= 2
        statuses.append((await client.get("/health")).status)
        return statuses, asked, down.headers.get("Retry-After"), (await down.json())["error"]["code"]

    statuses, asked, retry, code = _frontend(calls)
    assert statuses == [200, 200, 503, 503, 200] and asked == 1 and retry == "1" and code == "not_ready"


@pytest.mark.unit
def test_health_is_503_naming_a_wedged_decode_loop(monkeypatch):
    """The model READY in Triton but its decode loop wedged: /health, and every route that needs the model, is 503
    with the model's own reason (its health probe, sent with each readiness check: at most a second apart), 200 again
    once the loop advances; a probe the model does not answer at all is 503 too, and cancelled. Triton's readiness
    alone kept /health 200 while nothing was decoded."""
    import spectrt.runtime.serving.openai_frontend as frontend

    monkeypatch.setattr(frontend, "PROBE_SECONDS", 0.05)  # the stuck case's wait
    stall = "the decode loop has not advanced for 75 s (max_stall_seconds=60) with 2 request(s) waiting or decoding"

    async def calls(client, triton, fake):
        responses = [await client.get("/health")]
        fake.health = stall
        triton.checked -= 2  # the cached answer is older than a second (no waiting on the clock)
        responses += [await client.get("/health"), await client.get("/v1/models"),
                      await client.post("/v1/completions", json={"model": "spectrt", "prompt": "hi"})]
        probes = fake.probes
        fake.health = "hang"
        triton.checked -= 2
        responses.append(await client.get("/health"))
        fake.health = None
        triton.checked -= 2
        responses.append(await client.get("/health"))
        bodies = [await r.json() for r in responses]
        return ([r.status for r in responses], responses[1].headers.get("Retry-After"), bodies, probes,
                fake.probes, fake.cancelled, fake.sent)

    statuses, retry, bodies, probes, all_probes, cancelled, sent = _frontend(calls)
    assert statuses == [200, 503, 503, 503, 503, 200] and retry == "1"
    assert [b.get("error", {}).get("code") for b in bodies[1:5]] == ["unhealthy"] * 4
    assert bodies[1]["error"]["message"] == bodies[2]["error"]["message"] == bodies[3]["error"]["message"] == stall
    assert bodies[4]["error"]["message"] == "the model spectrt did not answer a health probe within 0.05 s"
    assert bodies[0] == bodies[5] == {"status": "ok"}
    assert probes == 2 and all_probes == 4 and cancelled == 1  # one probe per check; the stuck one cancelled
    assert sent is None  # the refused completion never reached the model


@pytest.mark.unit
@pytest.mark.parametrize("max_seconds", [2.0, 300.0])
def test_the_request_deadline_is_forwarded_to_the_model(max_seconds):
    """The model gets the frontend's deadline (here 5 s) as timeout_seconds, within its own limit, so it ends the
    request itself; the frontend's deadline used to stay behind (the model's 300 s decided)."""
    import numpy as np

    async def calls(client, triton, fake):
        answer = await client.post("/v1/completions", json={"model": "spectrt", "prompt": "hi"})
        return answer.status, (await answer.json())["error"]["message"]

    fake = _FakeGrpc(max_seconds)
    assert _frontend(calls, fake=fake) == (400, "invalid request: refused by the fake")
    sent = {i.name(): i for i in fake.sent["inputs"]}
    seconds = float(np.frombuffer(sent["timeout_seconds"]._raw_content, np.float32)[0])
    assert seconds == max_seconds if max_seconds < 5 else 4 < seconds <= 5


@pytest.mark.unit
def test_cross_site_posts_foreign_hosts_and_missing_api_keys_are_refused():
    """A text/plain POST (a web page may send one without a CORS preflight) is 415; on a loopback bind a Host that
    is not loopback (DNS rebinding) is 403; with an API key every route but /health needs it (401)."""
    body = json.dumps({"model": "nope", "prompt": "hi"})

    async def calls(client, triton, fake):
        plain = await client.post("/v1/completions", data=body, headers={"Content-Type": "text/plain"})
        foreign = await client.get("/v1/models", headers={"Host": "attacker.example"})
        local = await client.get("/v1/models", headers={"Host": "localhost:9000"})
        json_post = await client.post("/v1/completions", data=body, headers={"Content-Type": "application/json"})
        return [(r.status, (await r.json()).get("error", {}).get("code")) for r in (plain, foreign, local, json_post)]

    assert _frontend(calls) == [(415, "unsupported_media_type"), (403, "forbidden_host"), (200, None),
                                (404, "model_not_found")]

    async def keyed(client, triton, fake):
        return [(await client.get("/v1/models", headers=h)).status for h in
                ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer s3cret"})] + [
            (await client.get("/health")).status, (await client.get("/v1/models", headers={
                "Host": "attacker.example", "Authorization": "Bearer s3cret"})).status]

    assert _frontend(keyed, host="0.0.0.0", api_key="s3cret") == [401, 401, 200, 200, 200]  # any Host off loopback


@pytest.mark.unit
def test_a_graceful_stop_drains_open_answers_then_ends_them_properly():
    """At a stop (aiohttp's on_shutdown) open answers get the drain: one that ends within it ends as usual; a stream
    still open then ends with a 503 "stopping" error event and [DONE], and its upstream request is cancelled; a
    request arriving during the stop is refused with 503. Streams used to be cut after 3 s with neither."""
    import asyncio

    from spectrt.runtime.serving.openai_frontend import Piece

    cancelled = []

    async def generate(rows, rid):  # the model: `short` answers end after 3 pieces, the rest never end
        fields = rows[0]
        try:
            for i in range(3 if fields["max_tokens"] == 3 else 10**6):
                await asyncio.sleep(0.02)
                yield Piece(text=f"w{i} ", tokens=1, prompt_tokens=2)
            yield Piece(final=True, finish_reason="length", prompt_tokens=2)
        finally:
            cancelled.append(fields["max_tokens"])

    async def calls(client, triton, fake):
        triton.generate = generate
        frontend = client.server.app[FRONTEND]
        frontend.drain_seconds = 0.3
        long = await client.post("/v1/completions", json={"model": "spectrt", "prompt": "hi", "max_tokens": 40,
                                                          "stream": True})
        first = await long.content.readline()  # the stream has begun
        short = asyncio.ensure_future(client.post("/v1/completions", json={"model": "spectrt", "prompt": "hi",
                                                                           "max_tokens": 3}))
        await asyncio.sleep(0.01)
        stop = asyncio.ensure_future(frontend.drain())
        await asyncio.sleep(0.05)
        late = await client.post("/v1/completions", json={"model": "spectrt", "prompt": "hi", "max_tokens": 3})
        await stop
        events = [line for line in (first + await long.read()).split(b"\n") if line.startswith(b"data: ")]
        short = await short
        return (events, (short.status, (await short.json())["choices"][0]["text"]),
                (late.status, (await late.json())["error"]["code"]), frontend.open_answers)

    events, short, late, still_open = _frontend(calls)
    assert short == (200, "w0 w1 w2 ") and late == (503, "unavailable") and still_open == 0
    assert events[-1] == b"data: [DONE]" and b'"finish_reason":"length"' not in b"".join(events)
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "unavailable" and "stopping" in error["message"]
    assert sorted(cancelled) == [3, 40]  # the long one's upstream generator was closed too


@pytest.mark.unit
def test_a_hung_triton_gets_503_from_health_and_requests_instead_of_a_hang(monkeypatch):
    """`kill -STOP` of tritonserver: the readiness check never got an answer and held the lock every request and
    /health wait for; now the check is bounded and both answer 503 naming the cause (the outer wait only turns a
    regression into a failure instead of a hung suite)."""
    from spectrt.runtime.serving import openai_frontend

    monkeypatch.setattr(openai_frontend, "READY_SECONDS", 0.2)
    fake = _FakeGrpc()
    fake.ready = "hang"

    async def calls(client, triton, fake):
        body = {"model": "spectrt", "prompt": "hi", "max_tokens": 4}
        answers = await asyncio.wait_for(asyncio.gather(
            client.get("/health"), client.post("/v1/completions", json=body),
            client.post("/v1/completions", json=body)), 60)
        return [(r.status, (await r.json())["error"]["code"]) for r in answers]

    assert _frontend(calls, fake=fake) == [(503, "unavailable")] * 3


@pytest.mark.unit
def test_a_final_response_without_a_finish_reason_is_an_upstream_failure():
    """Every answer the model ends says why; one that does not was cut off upstream: a 502 (streamed: an error event
    and [DONE]), not a 200 with the text so far and "stop"."""
    from spectrt.runtime.serving.openai_frontend import Piece

    async def generate(fields, rid):
        yield Piece(text="partial ", tokens=1, prompt_tokens=2)
        yield Piece(final=True, prompt_tokens=2)

    async def calls(client, triton, fake):
        triton.generate = generate
        body = {"model": "spectrt", "prompt": "hi", "max_tokens": 8}
        plain = await client.post("/v1/completions", json=body)
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        return plain.status, await plain.json(), (await streamed.read()).split(b"\n\n")

    status, body, events = _frontend(calls)
    assert status == 502 and body["error"]["code"] == "upstream_error" and "finish_reason" in body["error"]["message"]
    events = [e for e in events if e]
    assert events[-1] == b"data: [DONE]" and b'"finish_reason":"stop"' not in b"".join(events)
    assert json.loads(events[-2].removeprefix(b"data: "))["error"]["code"] == "upstream_error"


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def server(target_dir, draft_dir):
    params = {"target_dir": target_dir, "draft_dir": draft_dir, "tree": TREE, "max_seq_len": 512,
              "max_tokens_limit": BUSY, "default_max_tokens": 16, "threads": 1, "measure_kernels": "false",
              "max_active": MAX_ACTIVE, "max_queue_size": MAX_QUEUE}
    srv = TritonServer(params, instances=1, ready_timeout=300, openai_port=0)
    srv.start()
    pids = (srv.pid, srv.openai_pid)
    yield srv
    srv.stop()
    assert all(_state(pid) is None for pid in pids), "tritonserver or the frontend is still running"
    assert _port_free(srv.openai_host, srv.openai_port) and not srv.run_dir.exists()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


def _stream_chat(client, **kwargs) -> tuple[str, list, dict]:
    """(joined deltas, finish reasons, the usage chunk as a dict) of one streamed chat completion."""
    parts, reasons, last = [], [], {}
    for chunk in client.chat.completions.create(model="spectrt", stream=True, stream_options={"include_usage": True},
                                                **kwargs):
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
        if not chunk.choices:
            last = chunk.model_dump()
    return "".join(parts), reasons, last


def test_models_endpoint(client):
    assert [m.id for m in client.models.list().data] == ["spectrt"]
    assert client.models.retrieve("spectrt").owned_by == "spectrt"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_the_model_answers_its_health_probe_without_decoding(server):
    """Over the wire: the model answers the frontend's health probe (gRPC) and the same probe on Triton's HTTP
    generate endpoint with "ok" while its loop advances, and admits nothing for it."""
    import asyncio

    async def probe():
        triton = Triton(server.grpc_url, "spectrt")
        try:
            return await triton.probe()
        finally:
            await triton.client.close()

    admitted = scrape_metrics(server)["spectrt_requests_admitted_total"]
    assert asyncio.run(probe()) is None
    body = json.dumps({"text_input": "", "parameters": {HEALTH_PARAMETER: True}}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/models/spectrt/generate", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as answer:
        assert json.loads(answer.read())["text_output"] == "ok"
    assert scrape_metrics(server)["spectrt_requests_admitted_total"] == admitted


def test_greedy_chat_streamed_equals_full_equals_grpc(server, client, tokenizer):
    messages = [{"role": "user", "content": "Name three colors."}]
    full = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT)
    text, reasons, last = _stream_chat(client, messages=messages, max_tokens=LIMIT)
    with GrpcSession(server.grpc_url) as session:  # the model applies the same chat template to a bare prompt
        grpc = session.generate("Name three colors.", LIMIT, stream=True, timeout=TIMEOUT)
    content = full.choices[0].message.content
    assert content and text == content == grpc.text
    assert full.choices[0].finish_reason == "stop" and reasons == ["stop"]  # ended before max_tokens
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids
    usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": grpc.tokens,
             "total_tokens": len(prompt_ids) + grpc.tokens}
    assert grpc.tokens == len(tokenizer.encode(content, add_special_tokens=False))
    assert full.usage.model_dump(include=set(usage)) == usage and {k: last["usage"][k] for k in usage} == usage
    spec = {"num_spec_steps": grpc.perf["target_passes"], "num_draft_tokens": grpc.perf["total_draft_tokens"],
            "num_accepted_draft_tokens": grpc.perf["total_accepted_draft_tokens"]}
    details = {"accepted_prediction_tokens": spec["num_accepted_draft_tokens"],
               "rejected_prediction_tokens": spec["num_draft_tokens"] - spec["num_accepted_draft_tokens"]}
    assert full.usage.completion_tokens_details.model_dump(include=set(details)) == details
    assert {k: last["usage"]["completion_tokens_details"][k] for k in details} == details
    for metrics in (full.model_dump()["metrics"]["speculative_decoding"], last["metrics"]["speculative_decoding"]):
        assert {k: metrics[k] for k in spec} == spec and spec["num_draft_tokens"] == 4 * spec["num_spec_steps"]
        assert metrics["mean_acceptance_length"] == pytest.approx(
            1 + spec["num_accepted_draft_tokens"] / spec["num_spec_steps"])


def test_finish_reason_length_and_multi_turn(client, tokenizer):
    full = client.chat.completions.create(model="spectrt", messages=CHAT, max_tokens=5)
    text, reasons, last = _stream_chat(client, messages=CHAT, max_tokens=5)
    assert full.choices[0].finish_reason == "length" and reasons == ["length"]
    assert text == full.choices[0].message.content and full.usage.completion_tokens == 5 == last["usage"][
        "completion_tokens"]
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert full.usage.prompt_tokens == len(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)


def test_stop_strings_end_the_text(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT)
    content = whole.choices[0].message.content
    words = content.split()
    # a newline (a token of its own: the model can stop on it itself) and a piece inside a word's token (only the
    # frontend's text matching can see it: the model goes on and is cancelled)
    for stop in ("\n" if "\n" in content else words[1], words[-1][1:3]):
        want = content[:content.index(stop)]
        full = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT, stop=[stop])
        text, reasons, last = _stream_chat(client, messages=messages, max_tokens=LIMIT, stop=stop)
        assert full.choices[0].message.content == want == text, stop
        assert full.choices[0].finish_reason == "stop" and reasons == ["stop"]
        assert 0 < full.usage.completion_tokens <= whole.usage.completion_tokens


def test_a_long_stop_string_is_served(client):
    """A 256-character stop string (768 bytes): the model refused it as a stop word, so the request got 400."""
    full = client.chat.completions.create(model="spectrt", messages=CHAT, max_tokens=4, stop=["日" * 256])
    assert full.choices[0].message.content and full.choices[0].finish_reason == "length"


def test_usage_at_a_stop_string_counts_up_to_the_token_that_completed_it(client, tokenizer, reference):
    """A 40-character stop string mid-answer (past 32 bytes the frontend matched it alone and cancelled the model,
    and usage counted every token of the response it arrived in, those after it too): the model stops on it itself,
    so usage counts exactly the tokens up to and including the one that completed it, streamed and not, and the
    answer has its metrics (the model's final response came)."""
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    _, out, text = _uncached(reference, tokenizer, messages, LIMIT)
    start = len(text) // 4
    stop = text[start:start + 40]
    assert len(stop.encode()) > 32 and text.index(stop) == start, text
    tokens = next(k for k in range(1, len(out) + 1) if stop in tokenizer.decode(out[:k], skip_special_tokens=True))
    assert tokens < len(out)  # the answer goes on past it: tokens that must not be counted
    full = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT, stop=[stop])
    streamed, reasons, last = _stream_chat(client, messages=messages, max_tokens=LIMIT, stop=[stop])
    assert full.choices[0].message.content == streamed == text[:start]
    assert full.choices[0].finish_reason == "stop" and reasons == ["stop"]
    assert full.usage.completion_tokens == last["usage"]["completion_tokens"] == tokens
    assert full.model_dump()["metrics"]["speculative_decoding"] and last["metrics"]["speculative_decoding"]


def test_completions_streamed_equals_full_equals_grpc(server, client, tokenizer):
    prompt = "The three primary colors are"
    full = client.completions.create(model="spectrt", prompt=prompt, max_tokens=12)
    parts, reasons, usage = [], [], None
    for chunk in client.completions.create(model="spectrt", prompt=prompt, max_tokens=12, stream=True,
                                           stream_options={"include_usage": True}):
        parts += [c.text for c in chunk.choices]
        reasons += [c.finish_reason for c in chunk.choices if c.finish_reason]
        usage = chunk.usage or usage
    with GrpcSession(server.grpc_url) as session:
        grpc = session.generate(prompt, 12, stream=True, timeout=TIMEOUT, chat=False)
    assert full.choices[0].text == "".join(parts) == grpc.text and full.object == "text_completion"
    assert full.choices[0].finish_reason == reasons[0] == ("length" if grpc.tokens == 12 else "stop")
    assert full.usage.prompt_tokens == usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == usage.completion_tokens == grpc.tokens


@pytest.fixture(scope="module")
def reference(target_dir, draft_dir):
    """The served decoder in process without the prefix cache (same engines, precision, tree, context)."""
    from spectrt.runtime.decoding.pipeline import Pipeline

    return Pipeline(target_dir, draft_dir, max_seq_len=512, measure_kernels=False, prefix_cache=False)


def _uncached(reference, tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], list[int], str]:
    """(prompt ids, output ids, text) of a chat decoded in process without the cache, on one thread as served."""
    from conftest import chat_ids
    from spectrt.runtime.decoding.tree import Tree

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ids = chat_ids(tokenizer, messages)
        out = reference.decoder.generate(ids, max_tokens, Tree.parse(TREE)).token_ids
    finally:
        torch.set_num_threads(before)
    return ids, out, tokenizer.decode(out, skip_special_tokens=True)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_multi_turn_reuses_the_history_and_answers_as_without_the_cache(server, client, tokenizer, reference):
    """A greedy 3-turn chat: each answer equals the uncached decoder's; each turn's cached_tokens is the previous
    turn's prompt + answer it shares (an answer cut by max_tokens may lack its last token's KV: a step's own next
    token is computed by the next step); the Prometheus counters add up to the prompt tokens."""
    turns = ["Name two fruits.", "Which one is sweeter?", "Say that in French."]
    messages = [{"role": "system", "content": "You are a terse assistant for the prefix cache test."}]
    before = scrape_metrics(server)
    held, prompts, cached = None, [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        answer = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=24)
        ids, out, text = _uncached(reference, tokenizer, messages, 24)
        assert answer.choices[0].message.content == text
        assert answer.usage.prompt_tokens == len(ids)
        cached.append(answer.usage.prompt_tokens_details.cached_tokens)
        if held is not None:
            assert cached[-1] in {min(_common(h, ids), len(ids) - 1) for h in held}
            assert cached[-1] > len(prompts[-1])
        prompts.append(ids)
        # the output's last token has KV unless it was the step's own next token (cut by max_tokens, it may not)
        held = [ids + out] if answer.choices[0].finish_reason == "stop" else [ids + out, (ids + out)[:-1]]
        messages.append({"role": "assistant", "content": text})
    assert cached[0] < len(prompts[0]) // 2  # only the chat template's opening is shared with earlier tests
    after = scrape_metrics(server)
    got = {k: after[k] - before.get(k, 0.0) for k in ("spectrt_prompt_tokens_cached_total",
                                                       "spectrt_prompt_tokens_computed_total")}
    assert got == {"spectrt_prompt_tokens_cached_total": sum(cached),
                   "spectrt_prompt_tokens_computed_total": sum(map(len, prompts)) - sum(cached)}


def test_concurrent_requests_share_a_cached_prefix_and_eviction_keeps_answers_exact(server, client, tokenizer,
                                                                                      reference):
    """A long system prompt cached by one chat, then read by two concurrent ones (one copies it into the other slot,
    one takes the slot over), then more chats than the pool's two slots hold: every answer equals the uncached
    decoder's, and the concurrent ones reused the shared prefix."""
    import concurrent.futures

    system = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence. "
                                           "Be kind, be precise, and never repeat the question."}
    chats = [[system, {"role": "user", "content": q}] for q in
             ("Name a planet.", "Describe a river in detail.", "Describe a mountain in detail.", "Name a color.")]
    first = client.chat.completions.create(model="spectrt", messages=chats[0], max_tokens=16)
    assert first.choices[0].message.content == _uncached(reference, tokenizer, chats[0], 16)[2]
    shared = _common(*(_uncached(reference, tokenizer, c, 1)[0] for c in chats[:2]))  # the system prompt's
    _wait_for(lambda: _active(server) == 0)
    admitted = scrape_metrics(server)["spectrt_requests_admitted_total"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the second once the first holds a slot (queue of 1)
        running = pool.submit(client.chat.completions.create, model="spectrt", messages=chats[1], max_tokens=LIMIT)
        _wait_for(lambda: scrape_metrics(server)["spectrt_requests_admitted_total"] > admitted)
        answers = [pool.submit(client.chat.completions.create, model="spectrt", messages=chats[2],
                               max_tokens=LIMIT).result(), running.result()][::-1]
    for chat, answer in zip(chats[1:3], answers, strict=True):
        assert answer.choices[0].message.content == _uncached(reference, tokenizer, chat, LIMIT)[2]
        assert answer.usage.prompt_tokens_details.cached_tokens >= shared
    later = [chats[3], chats[0] + [{"role": "assistant", "content": first.choices[0].message.content},
                                   {"role": "user", "content": "And another one?"}]]
    for chat in later:  # a third and fourth sequence in a pool of two: evictions
        answer = client.chat.completions.create(model="spectrt", messages=chat, max_tokens=16)
        assert answer.choices[0].message.content == _uncached(reference, tokenizer, chat, 16)[2]


def test_a_request_cancelled_mid_prefill_leaves_no_partial_prefix(server, client, tokenizer, reference):
    """A long prompt whose client goes away at once: whatever it left is whole prefill chunks (64 tokens, after
    what it reused itself: at most the chat template's opening) or its complete prompt, and the same prompt then
    answers exactly."""
    from conftest import chat_ids

    messages = [{"role": "system", "content": "Cancel test."},
                {"role": "user", "content": "Repeat after me: " + " ".join(f"item {i}," for i in range(40))}]
    _wait_for(lambda: _active(server) == 0)
    admitted = scrape_metrics(server)["spectrt_requests_admitted_total"]
    sock = _open(server, {"messages": messages, "max_tokens": 8})
    _wait_for(lambda: scrape_metrics(server)["spectrt_requests_admitted_total"] > admitted)
    sock.close()
    _wait_for(lambda: _active(server) == 0)
    answer = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=8)
    ids, _, text = _uncached(reference, tokenizer, messages, 8)
    assert answer.choices[0].message.content == text
    cached = answer.usage.prompt_tokens_details.cached_tokens
    opening = _common(ids, chat_ids(tokenizer, [{"role": "system", "content": "x"}]))  # shared with every chat
    assert cached % 64 <= opening or cached == len(ids) - 1, (cached, opening)


def _post(server, path: str, body: bytes | str) -> tuple[int, dict]:
    host, port = server.openai_host, server.openai_port
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


BAD_HTTP = [
    ("malformed JSON", "/v1/chat/completions", '{"model": "spectrt", "messages": [', "not valid JSON"),
    ("not an object", "/v1/chat/completions", "[1, 2]", "must be a JSON object"),
    ("messages not a list", "/v1/chat/completions", {"messages": "hello"}, "messages must be a non-empty list"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-4o"}, "does not exist"),
    ("max_tokens out of range", "/v1/chat/completions", {"max_tokens": 100000}, r"max_tokens must be in \[1, 448\]"),
    ("refused by the model", "/v1/chat/completions", {"tree": "2,x"}, "malformed"),
    ("a refusal quoting overloaded", "/v1/chat/completions", {"tree": "overloaded"}, "malformed"),
    ("lone surrogate", "/v1/chat/completions",
     '{"model": "spectrt", "messages": [{"role": "user", "content": "\\ud800"}]}', "lone surrogate"),
    ("top_k past int64", "/v1/chat/completions", {"top_k": 1 << 63}, "top_k must be in"),
    ("top_k past int32", "/v1/completions", {"prompt": "Hi", "messages": None, "top_k": 1 << 31}, "top_k must be in"),
    ("completions without a prompt", "/v1/completions", {"messages": None}, "prompt must be"),
]


@pytest.mark.parametrize("name, path, body, message", BAD_HTTP, ids=[b[0] for b in BAD_HTTP])
def test_bad_request_gets_400_and_the_server_keeps_serving(server, client, name, path, body, message):
    if isinstance(body, dict):
        body = json.dumps({"model": "spectrt", "messages": [{"role": "user", "content": "Hi"}], **body})
    status, answer = _post(server, path, body)
    assert status == (404 if name == "unknown model" else 400), answer  # an unknown model: 404, as OpenAI answers
    assert set(answer["error"]) == {"message", "type", "param", "code"} and re.search(message,
                                                                                        answer["error"]["message"])
    assert client.chat.completions.create(model="spectrt", messages=CHAT, max_tokens=2).choices[0].message.content


def test_cross_site_post_and_foreign_host_are_refused_over_the_wire(server):
    """The loopback endpoint: a text/plain POST (which a web page may send cross-site) is 415, a request naming
    another Host (DNS rebinding) is 403; both used to be served."""
    body = json.dumps({"model": "spectrt", "messages": CHAT, "max_tokens": 2})
    answers = []
    for headers in ({"Content-Type": "text/plain"}, {"Content-Type": "application/json", "Host": "attacker.example"}):
        conn = http.client.HTTPConnection(server.openai_host, server.openai_port, timeout=TIMEOUT)
        conn.request("POST", "/v1/chat/completions", body, headers)
        response = conn.getresponse()
        answers.append((response.status, json.loads(response.read())["error"]["code"]))
        conn.close()
    assert answers == [(415, "unsupported_media_type"), (403, "forbidden_host")]


def test_unknown_route_and_method_are_error_objects(server):
    for method, path, status in (("GET", "/v1/embeddings", 404), ("GET", "/v1/chat/completions", 405)):
        conn = http.client.HTTPConnection(server.openai_host, server.openai_port, timeout=TIMEOUT)
        conn.request(method, path)
        response = conn.getresponse()
        assert response.status == status and "message" in json.loads(response.read())["error"]
        assert status != 405 or "POST" in response.getheader("Allow", "")  # a 405 names the methods it takes
        conn.close()


def _wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout}s (a hang guard)"
        time.sleep(0.05)


def _active(server) -> float:
    return scrape_metrics(server).get("spectrt_active_requests", 0.0)


def _open(server, body: dict, path: str = "/v1/chat/completions") -> socket.socket:
    """Send a request on a raw socket (so the test can drop the connection whenever it likes)."""
    sock = socket.create_connection((server.openai_host, server.openai_port), timeout=TIMEOUT)
    data = json.dumps({"model": "spectrt", "messages": [{"role": "user", "content": "Count from one to fifty."}],
                       **body}).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_its_slot(server, stream):
    """A client that goes away mid-generation: its request is cancelled upstream (not completed), its slot freed."""
    _wait_for(lambda: _active(server) == 0)
    before = scrape_metrics(server)
    sock = _open(server, {"max_tokens": BUSY, "stream": stream, "min_tokens": BUSY, "tree": "none"})
    try:
        if stream:
            received = b""
            while b"data: {" not in received:  # the stream has begun
                received += sock.recv(65536)
        _wait_for(lambda: _active(server) == 1)
    finally:
        sock.close()
    _wait_for(lambda: _active(server) == 0)
    after = scrape_metrics(server)
    assert after["spectrt_requests_admitted_total"] == before["spectrt_requests_admitted_total"] + 1
    assert after["spectrt_requests_total"] == before["spectrt_requests_total"], "it ran to completion"
    assert after["spectrt_tokens_generated_total"] == before["spectrt_tokens_generated_total"]


def test_overloaded_is_503_and_clears(server, client):
    """Every slot and the queue taken: the next request gets 503 (overloaded) with Retry-After; afterwards the
    server serves again."""
    _wait_for(lambda: _active(server) == 0)
    busy = [_open(server, {"max_tokens": BUSY, "min_tokens": BUSY, "stream": True, "tree": "none"})
            for _ in range(MAX_ACTIVE)]
    try:
        _wait_for(lambda: _active(server) == MAX_ACTIVE)
        busy.append(_open(server, {"max_tokens": LIMIT, "stream": True}))
        _wait_for(lambda: scrape_metrics(server).get("spectrt_queued_requests") == MAX_QUEUE)
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(model="spectrt", messages=CHAT, max_tokens=2)
        assert refused.value.status_code == 503 and refused.value.response.headers["Retry-After"] == "1"
        assert "overloaded" in str(refused.value) and refused.value.code == "overloaded"
    finally:
        for sock in busy:
            sock.close()
    _wait_for(lambda: _active(server) == 0 and scrape_metrics(server).get("spectrt_queued_requests") == 0)
    assert client.chat.completions.create(model="spectrt", messages=CHAT, max_tokens=2).choices[0].message.content


def test_deadline_is_504_and_cancels_upstream(server, target_dir):
    """A frontend run on its own (python -m ...) with a 50 ms deadline against the module's Triton: 48 tokens
    cannot arrive in time, so the answer is 504 deadline_exceeded and the request is cancelled upstream."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "spectrt.cli.openai_frontend",
                             f"--grpc-url={server.grpc_url}",
                             f"--tokenizer={target_dir}", f"--port={port}", "--timeout=0.05"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _health(port) == 200 or proc.poll() is not None, TIMEOUT)
        assert proc.poll() is None, proc.stderr.read()
        before = scrape_metrics(server)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": "spectrt", "messages": CHAT, "max_tokens": LIMIT, "min_tokens": LIMIT}),
            {"Content-Type": "application/json"})
        response = conn.getresponse()
        answer = json.loads(response.read())
        conn.close()
        assert response.status == 504 and answer["error"]["code"] == "deadline_exceeded", answer
        _wait_for(lambda: _active(server) == 0)
        assert scrape_metrics(server)["spectrt_requests_total"] == before["spectrt_requests_total"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0, "the frontend did not stop cleanly on SIGTERM"


def _health(port: int) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


# --------------------------------------------------------------------------- lifecycle under the supervisor


def _state(pid: int | None) -> str | None:
    """The process state letter, None once it is gone (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (OSError, TypeError):
        return None
    state = stat.rpartition(")")[2].split()[0]
    return None if state in "ZX" else state


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _launch(target: Path) -> tuple[subprocess.Popen, dict]:
    proc, info, out = launch_serve(target, "--openai-port", "0")
    assert f"OpenAI {info['openai']}" in out  # the URL a user copies
    return proc, info


def _assert_all_gone(info: dict) -> None:
    _wait_for(lambda: _state(info["supervisor_pid"]) is None and not Path(info["run_dir"]).exists(), 120)
    for name in ("pid", "openai_pid", "supervisor_pid"):
        assert _state(info[name]) is None, f"{name} {info[name]} is still running"
    assert not list(SHM_DIR.glob(info["shm_prefix"] + "*")), "shared-memory regions left in /dev/shm"
    host, port = info["openai"].removeprefix("http://").removesuffix("/v1").rsplit(":", 1)
    assert _port_free(host, int(port)), "the OpenAI port is still open"


def test_killed_launcher_takes_the_frontend_down(stub_target):
    """SIGKILL of `spectrt serve --openai-port 0`: its supervisor stops the frontend and the server."""
    proc, info = _launch(stub_target)
    assert _health(int(info["openai"].rsplit(":", 1)[1].removesuffix("/v1"))) == 200
    proc.kill()
    proc.wait(timeout=60)
    _assert_all_gone(info)


def test_frontend_that_dies_takes_the_deployment_down(stub_target):
    """The deployment is up as a whole or not at all: a killed frontend stops the server; the launcher exits 1."""
    proc, info = _launch(stub_target)
    os.kill(info["openai_pid"], signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    assert "tritonserver exited" in proc.stderr.read()
    _assert_all_gone(info)


def test_a_graceful_stop_ends_an_open_stream_with_an_error_event_and_done(target_dir, draft_dir):
    """Over the wire: a stop while a stream runs past the drain (here 1 s) ends the stream properly, with an error
    event saying the server is stopping and `data: [DONE]`; it used to be cut after 3 s with neither."""
    import threading

    params = {"target_dir": target_dir, "draft_dir": draft_dir, "tree": TREE, "max_seq_len": 512,
              "max_tokens_limit": BUSY, "threads": 1, "measure_kernels": "false", "warmup": "false",
              "drain_seconds": "1"}
    srv = TritonServer(params, instances=1, ready_timeout=300, openai_port=0)
    srv.start()
    try:
        sock = _open(srv, {"max_tokens": BUSY, "min_tokens": BUSY, "stream": True, "tree": "none"})
        received = b""
        while b"data: {" not in received:  # the stream has begun
            received += sock.recv(65536)
        stopper = threading.Thread(target=srv.stop)
        stopper.start()
        while chunk := sock.recv(65536):  # until the frontend closes the connection
            received += chunk
        sock.close()
        stopper.join(timeout=120)
    finally:
        srv.stop()
    events = [line for line in received.split(b"\n") if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", received[-400:]
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "unavailable" and "stopping" in error["message"]
    assert b'"finish_reason":"length"' not in received  # it did not run to its end


def test_structured_outputs_parse_and_equal_the_target_alone(client):
    """The SDK's `parse()` with a pydantic model returns the parsed object; a JSON schema, a regex (vLLM's
    `structured_outputs`) and `json_object` give the same tokens under the default tree and with `tree` "none"; a
    schema the grammar engine cannot compile is answered 400 naming the field."""
    import pydantic

    class City(pydantic.BaseModel):
        name: str
        country: str

    messages = [{"role": "user", "content": "Name a big city and its country, as JSON."}]
    parsed = client.chat.completions.parse(model="spectrt", messages=messages, response_format=City, max_tokens=LIMIT)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    for extra in ({"structured_outputs": {"regex": r"[A-Z][a-z]+ [0-9]{2}"}},
                  {"response_format": {"type": "json_object"}},
                  {"response_format": {"type": "json_schema", "json_schema": {
                      "name": "city", "schema": City.model_json_schema()}}}):
        texts = [client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT,
                                                extra_body={**extra, "tree": tree}).choices[0].message.content
                 for tree in (None, "none")]
        assert texts[0] == texts[1], extra
        if "structured_outputs" in extra:
            assert re.fullmatch(r"[A-Z][a-z]+ [0-9]{2}", texts[0])
    with pytest.raises(openai.BadRequestError, match="cannot be compiled"):
        client.chat.completions.create(model="spectrt", messages=messages, max_tokens=4,
                                       extra_body={"structured_outputs": {"regex": "(unclosed"}})


def test_penalties_and_logit_bias_served_equal_the_target_alone(client):
    """presence / frequency / repetition penalties and logit_bias change the answer, and the default tree gives the
    same answer as `tree` "none" (each verified row penalized by its own path)."""
    messages = [{"role": "user", "content": "List ten fruits, one per line."}]
    plain = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT).choices[0]
    for extra in ({"presence_penalty": 1.0}, {"frequency_penalty": 0.8}, {"repetition_penalty": 1.4},
                  {"logit_bias": {"198": -100}}):  # 198: "\n"
        texts = [client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT,
                                                extra_body={**extra, "tree": tree}).choices[0].message.content
                 for tree in (None, "none")]
        assert texts[0] == texts[1] and texts[0] != plain.message.content, extra


def test_logprobs_served_equal_the_target_alone_streamed_and_not(client):
    """Chat `logprobs`/`top_logprobs` and completions' `logprobs`: the default tree reports the tokens and values of
    `tree` "none" exactly, streamed == not streamed, the entries' bytes join to the text, the chosen token first."""
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    runs = {}
    for tree in (None, "none"):
        answer = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT, logprobs=True,
                                                top_logprobs=3, extra_body={"tree": tree}).choices[0]
        runs[tree] = answer
        content = [e.model_dump() for e in answer.logprobs.content]
        assert bytes(b for e in content for b in e["bytes"]).decode() == answer.message.content
        for e in content:
            assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["token"] == e["token"]
            assert e["top_logprobs"][0]["logprob"] == e["logprob"] <= 0
    assert runs[None].logprobs == runs["none"].logprobs and runs[None].message.content == runs["none"].message.content
    streamed = []
    for chunk in client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT, logprobs=True,
                                                top_logprobs=3, stream=True):
        for choice in chunk.choices:
            streamed += choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    assert streamed == runs[None].logprobs.content
    text = client.completions.create(model="spectrt", prompt="The sea is", max_tokens=LIMIT, logprobs=2,
                                     extra_body={"tree": None}).choices[0]
    alone = client.completions.create(model="spectrt", prompt="The sea is", max_tokens=LIMIT, logprobs=2,
                                      extra_body={"tree": "none"}).choices[0]
    assert text.logprobs == alone.logprobs and "".join(text.logprobs.tokens) == text.text
    assert text.logprobs.text_offset[0] == 0 and all(len(t) == 2 for t in text.logprobs.top_logprobs)


@pytest.mark.unit
def test_n_choices_are_rows_each_with_its_own_seed():
    call = _chat(n=3, seed=2 ** 64 - 2, temperature=0.8)
    rows = upstream_rows(call, 5.0)
    assert [r["seed"] for r in rows] == [2 ** 64 - 2, 2 ** 64 - 1, 0] and call.n == 3
    assert all({k: v for k, v in r.items() if k != "seed"} == {k: v for k, v in rows[0].items() if k != "seed"}
               for r in rows)
    assert upstream_rows(_chat(), 5.0) == [upstream_rows(_chat(), 5.0)[0]]


def test_n_choices_served_equal_single_requests_streamed_and_not(client):
    """n=3 with a seed: choice i is the answer to the same request with n=1 and seed + i (sampled: three answers, not
    three copies); streamed, each index's deltas join to the same text; usage counts every choice's tokens."""
    messages = [{"role": "user", "content": "Write a short poem about the sea."}]
    args = {"model": "spectrt", "messages": messages, "max_tokens": LIMIT, "temperature": 1.0}
    many = client.chat.completions.create(n=3, seed=11, **args)
    texts = [c.message.content for c in sorted(many.choices, key=lambda c: c.index)]
    assert [c.index for c in many.choices] == [0, 1, 2] and len(set(texts)) > 1
    singles = [client.chat.completions.create(seed=11 + i, **args) for i in range(3)]
    assert texts == [one.choices[0].message.content for one in singles]
    assert many.usage.completion_tokens == sum(one.usage.completion_tokens for one in singles)
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    parts, reasons = {}, {}
    for chunk in client.chat.completions.create(n=3, seed=11, stream=True, **args):
        for choice in chunk.choices:
            parts[choice.index] = parts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    assert [parts[i] for i in range(3)] == texts and set(reasons) == {0, 1, 2}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.mark.unit
def test_tools_become_a_grammar_a_prompt_and_tool_calls():
    """A forced call (named or "required") is a JSON-schema structured output of {"name", "arguments"}; the functions
    reach the prompt; an answer that is such a call comes back as `tool_calls` ("auto" too), streamed as one delta."""
    from spectrt.runtime.serving.openai_api import Choice, Chunks, Outcome, completion_body, tool_prompt

    named = _chat(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}})
    spec = json.loads(named.fields["structured_output"])
    assert spec["schema"]["properties"]["name"] == {"const": "add"} and named.tools == "required"
    assert json.loads(named.fields["text_input"])[1] == [WEATHER["function"], ADD["function"]]
    required = _chat(tools=[WEATHER, ADD], tool_choice="required")
    assert len(json.loads(required.fields["structured_output"])["schema"]["anyOf"]) == 2
    auto = _chat(tools=[WEATHER])
    assert auto.tools == "auto" and "structured_output" not in auto.fields
    assert _chat(tools=[WEATHER], tool_choice="none").fields["text_input"] == json.dumps(CHAT)
    system = tool_prompt([{"role": "user", "content": "hi"}], [WEATHER["function"]])[0]
    assert system["role"] == "system" and '"get_weather"' in system["content"]

    answer = Choice(text='{"name": "add", "arguments": {"a": 2, "b": 3}}', finish_reason="stop")
    body = completion_body(named, "r", 0, "spectrt", Outcome(choices=[answer]))
    message, = (c["message"] for c in body["choices"])
    assert body["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    call, = message["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'} and call["id"].startswith("call_")
    text = Choice(text="It is sunny.", finish_reason="stop")
    assert completion_body(auto, "r", 0, "spectrt", Outcome(choices=[text]))["choices"][0]["message"]["content"] \
        == "It is sunny."

    def stream(call, choice, deltas):
        chunks = Chunks(call, "r", 0, "spectrt")
        raw = b"".join(chunks.text(d) for d in deltas) + chunks.finish(choice)
        return [json.loads(e.removeprefix(b"data: ")) for e in raw.split(b"\n\n") if e]

    events = stream(named, answer, ['{"name": "add", ', '"arguments": {"a": 2, "b": 3}}'])
    assert events[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "add"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls" and len(events) == 2
    events = stream(auto, text, ["It is ", "sunny."])  # "auto": text once it cannot be a call
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == "It is sunny."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    history = chat_messages({"messages": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"}]})
    assert history[1]["content"] == '{"name": "add", "arguments": {"a": 2, "b": 3}}' and history[2]["role"] == "tool"


def test_a_named_tool_call_is_served_the_same_under_speculation(client):
    """With the real SDK: a named tool's call validates against its schema and equals `tree` "none"'s; "required"
    picks one of the tools; streamed, the SDK's accumulated call is the same."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    calls = {}
    for tree in (None, "none"):
        answer = client.chat.completions.create(
            model="spectrt", messages=messages, max_tokens=LIMIT, tools=[WEATHER, ADD],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body={"tree": tree})
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls[tree] = choice.message.tool_calls[0].function
    assert calls[None] == calls["none"] and calls[None].name == "get_weather"
    assert set(json.loads(calls[None].arguments)) == {"city"}
    required = client.chat.completions.create(model="spectrt", messages=messages, max_tokens=LIMIT,
                                              tools=[WEATHER, ADD], tool_choice="required").choices[0]
    assert required.message.tool_calls[0].function.name in ("get_weather", "add")
    streamed = [d.function for chunk in client.chat.completions.create(
        model="spectrt", messages=messages, max_tokens=LIMIT, tools=[WEATHER, ADD], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
        for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert [(f.name, f.arguments) for f in streamed] == [(calls[None].name, calls[None].arguments)]


def test_echo_returns_the_prompt_and_its_logprobs_as_lm_eval_reads_them(client):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1, temperature 0): the text and tokens start with
    the prompt's, the first token's logprob is null, and a prompt token's logprob is the one the model reported when
    it generated that token after the same prefix (prefix-cache reuse is off for such a request: every row counted)."""
    prefix = "The capital of France is"
    first = client.completions.create(model="spectrt", prompt=prefix, max_tokens=1, logprobs=1, temperature=0)
    token, logprob = first.choices[0].logprobs.tokens[0], first.choices[0].logprobs.token_logprobs[0]
    for _ in range(2):  # the second time its prefix is cached
        echoed = client.completions.create(model="spectrt", prompt=prefix + token, max_tokens=1, logprobs=1,
                                           temperature=0, echo=True).choices[0]
        lp = echoed.logprobs
        assert echoed.text.startswith(prefix + token) and "".join(lp.tokens) == echoed.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and all(
            v is not None and v <= 0 for v in lp.token_logprobs[1:])
        at = len(lp.tokens) - 2  # the prompt's last token: the one `first` generated
        assert lp.tokens[at] == token and math.isclose(lp.token_logprobs[at], logprob, rel_tol=1e-5, abs_tol=1e-6)
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[at] == len(prefix)
    plain = client.completions.create(model="spectrt", prompt=prefix, max_tokens=4, echo=True, temperature=0)
    assert plain.choices[0].text.startswith(prefix) and plain.choices[0].logprobs is None


def test_best_of_returns_the_rows_of_best_mean_logprob(client):
    """best_of 3, n 1, seeded: the answer is, of the three rows the same request decodes with n 3 (seeds s, s+1, s+2),
    the one of the highest mean token logprob; usage counts all three; logprobs not asked are not returned."""
    args = {"model": "spectrt", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 5}
    rows = client.completions.create(n=3, logprobs=0, **args)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in rows.choices]
    best = client.completions.create(best_of=3, **args)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.choices[0].text == rows.choices[means.index(max(means))].text
    assert best.usage.completion_tokens == rows.usage.completion_tokens


def test_a_killed_python_stub_is_healed_without_an_operator(stub_target):
    """SIGKILL of the python stub while 4 OpenAI streams decode (Triton never restarts a decoupled stub, and stays
    "ready"): every stream ends with an error event within seconds, the health endpoints say not ready while the
    server is down, the supervisor restarts tritonserver (a log line, spectrt_server_restarts_total 1), and the same
    endpoint serves again with no operator action."""
    import threading

    from spectrt.runtime.serving.supervise import stubs

    proc, info = _launch_long(stub_target)
    try:
        port = int(info["openai"].rsplit(":", 1)[1].removesuffix("/v1"))
        client = openai.OpenAI(base_url=info["openai"], api_key="unused", max_retries=0, timeout=120)
        started, ended = threading.Barrier(5), {}

        def stream(i: int) -> None:
            chunks = 0
            try:
                for _chunk in client.chat.completions.create(
                        model=info["model"], messages=[{"role": "user", "content": f"story {i}"}], max_tokens=3000,
                        extra_body={"min_tokens": 3000}, stream=True):
                    chunks += 1
                    if chunks == 1:
                        started.wait(60)
                ended[i] = ("finished", time.monotonic())
            except openai.APIError as e:
                ended[i] = (f"error: {e}", time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(120)  # every stream is decoding
        stub, = stubs(info["pid"])
        os.kill(stub, signal.SIGKILL)
        killed, health = time.monotonic(), []
        for t in threads:
            t.join(60)
        assert len(ended) == 4 and all(kind.startswith("error") for kind, _ in ended.values()), ended
        assert max(at for _, at in ended.values()) - killed < 30
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # (the frontend's /health, Triton's ready) until both are up again
            health.append((_health(port), _triton_ready(info["http"])))
            if health[-1] == (200, True):
                break
            time.sleep(0.2)
        assert health[-1] == (200, True) and (503, False) in health, health
        answer = client.chat.completions.create(model=info["model"], messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=4)
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert scrape_metrics(SimpleNamespace(metrics_url=info["metrics"]))["spectrt_server_restarts_total"] == 1
        log = (Path(info["run_dir"]) / "server.log").read_text(errors="replace")
        assert f"python stub(s) [{stub}] died: restarting tritonserver (restart 1" in log
        _soak_through_a_stub_kill(client, info)
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    _wait_for(lambda: _state(info["supervisor_pid"]) is None and not Path(info["run_dir"]).exists(), 120)
    assert not list(SHM_DIR.glob(info["shm_prefix"] + "*")), "shared-memory regions left in /dev/shm"


def _soak_through_a_stub_kill(client, info: dict) -> None:
    """16 streams x 20 greedy requests, the stub killed once the first 80 ended: every request gets exactly one
    ending (its answer, or an error while the server was down: these clients do not retry), and every answer is its
    own prompt's (as answered before the kill: no tokens crossed between requests)."""
    import threading

    from spectrt.runtime.serving.supervise import stubs

    prompts = [f"Count to {i} in words." for i in range(16)]

    def ask(prompt: str) -> str:
        parts = []
        for chunk in client.chat.completions.create(model=info["model"], messages=[{"role": "user", "content": prompt}],
                                                    max_tokens=16, temperature=0, stream=True):
            parts += [c.delta.content or "" for c in chunk.choices]
        return "".join(parts)

    want = {p: ask(p) for p in prompts}
    outcomes: list[tuple[str, str]] = []
    lock, answered = threading.Lock(), threading.Event()

    def worker(prompt: str) -> None:
        for _ in range(20):
            try:
                got = ("answer", ask(prompt) == want[prompt])
            except openai.APIError as e:
                got = ("error", str(e))
            with lock:
                outcomes.append(got)
                if len(outcomes) == 80:
                    answered.set()

    threads = [threading.Thread(target=worker, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    assert answered.wait(300)
    os.kill(next(iter(stubs(_serving_pid(info)))), signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert len(outcomes) == 320, f"{320 - len(outcomes)} requests never ended"
    answers = [ok for kind, ok in outcomes if kind == "answer"]
    assert all(answers) and len(answers) >= 80  # no answer another request's; errors only while it was down
    port = int(info["openai"].rsplit(":", 1)[1].removesuffix("/v1"))
    _wait_for(lambda: _triton_ready(info["http"]) and _health(port) == 200, 120)
    assert ask(prompts[0]) == want[prompts[0]]


def _serving_pid(info: dict) -> int:
    """The current tritonserver's PID: the supervisor's child that is not the frontend (it changes at a restart)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != info["openai_pid"]:
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == info["supervisor_pid"] and fields[0] not in "ZX":
                return int(entry.name)
    raise AssertionError("no tritonserver under the supervisor")


def _triton_ready(http: str) -> bool:
    try:
        return urllib.request.urlopen(f"{http}/v2/health/ready", timeout=5).status == 200
    except OSError:
        return False


def _launch_long(target: Path) -> tuple[subprocess.Popen, dict]:
    """`_launch` with room for long answers (streams that still decode when something is killed)."""
    proc, info, _ = launch_serve(target, "--openai-port", "0", "--max-tokens-limit", "4000", "--max-seq-len", "4096")
    return proc, info


def test_past_max_restarts_a_dead_stub_stops_the_deployment(stub_target):
    """`--max-restarts 0`: the first stub death stops the deployment (the launcher exits 1, a log line says why), for
    whatever runs it (systemd, Kubernetes) to decide; nothing is left behind."""
    from spectrt.runtime.serving.supervise import stubs

    proc, info, _ = launch_serve(stub_target, "--openai-port", "0", "--max-restarts", "0")
    os.kill(next(iter(stubs(info["pid"]))), signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    assert "0 restarts in the last 600 s already, stopping the deployment" in proc.stderr.read()
    _assert_all_gone(info)
