"""The OpenAI API as data: request bodies -> the Triton model's inputs, Triton responses -> OpenAI bodies and chunks.

Pure functions (no I/O, no model), so every rule is tested with small dicts; `openai_frontend.py` is the HTTP and
gRPC edge around them. Request fields, and what each becomes (README, "OpenAI-compatible endpoint"):

- honoured: `model` (must be the served name), `messages` (system/developer/user/assistant turns, text content),
  `prompt` (one string), `max_tokens` / `max_completion_tokens`, `temperature`, `top_p`, `seed`, `stop` (strings:
  the text ends before the first one; each also goes to the model as a stop word, so the model ends the answer
  there itself and counts its tokens), `n` (1 to 8 choices: rows of one model request, choice i seeded seed + i),
  `stream`, `stream_options.include_usage`; the vLLM extensions `top_k`, `min_tokens` (end-of-sequence only, as
  TensorRT-LLM's `min_length`: stop strings still apply), `ignore_eos`; the spectrt extension `tree` (per-request
  token tree, e.g. "2,1" or "none"); `response_format` / vLLM's `structured_outputs`, `presence_penalty` /
  `frequency_penalty` / `repetition_penalty`, `logit_bias`; `logprobs` + `top_logprobs` (chat) and `logprobs`
  (completions), the target's values at each returned token (`choice_logprobs`); `echo` (completions: the prompt
  before the answer, with `logprobs` its tokens' logprobs too, the first null: lm-eval's loglikelihood requests),
  `best_of` (completions: `best_choices`).
  `tools` + `tool_choice` (`_tools`: a forced call is a JSON-schema structured output; `tool_calls` from the answer).
- accepted at their no-op values only, refused otherwise: `functions` ([]), `function_call` ("none", "auto"),
  `suffix` ("").
- ignored: `user`, `metadata`, `store`, `service_tier`, `parallel_tool_calls`, `prompt_cache_key`,
  `safety_identifier`, and any field sent as null.
- anything else: refused (400, `unrecognized request argument`), as the OpenAI API itself does.

Responses carry `usage` (prompt tokens = the model's `num_input_tokens`, chat template included; completion tokens =
the sum of its `num_output_tokens`, the tokens of the returned text, end-of-sequence not counted, and at a stop string
the tokens up to and including the one that completed it, none after it;
`prompt_tokens_details.cached_tokens` = the model's `num_cached_tokens`, prompt tokens read from its prefix cache,
0 when the frontend ended the answer at a stop string before the model's final response;
`completion_tokens_details.accepted_prediction_tokens` / `rejected_prediction_tokens`: drafted tokens kept / not),
`finish_reason`
("stop": end-of-sequence or a stop string; "length": `max_tokens` or the context) and vLLM's per-request
`metrics.speculative_decoding` block (non-streaming: in the body; streaming: in the usage chunk).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_PROMPT = ("You can call functions. To call one, answer with only a JSON object {\"name\": <the function's name>, "
               "\"arguments\": <its arguments as a JSON object>}. The functions:\n")
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key", "safety_identifier"}
NOOP = {  # field: the values that change nothing (accepted); any other value is refused
    "functions": ([],), "function_call": ("none", "auto"),
    "suffix": ("",),
}
COMMON = {"model", "n", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "top_k",
          "min_tokens", "ignore_eos", "tree", "response_format", "structured_outputs", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "logit_bias"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice"}
TEXT_FIELDS = COMMON | {"prompt", "logprobs", "echo", "best_of"}
MAX_TOP_LOGPROBS = 20  # the model's bound (runtime/decoding/sampling.py)
MAX_N = 8  # choices of one request: rows of one model request (its config's max_batch_size)
MAX_STOPS, MAX_STOP_CHARS = 16, 256  # at most 1024 bytes a string: within the model's stop words (requests.Limits)
SEED_MODULUS = 1 << 64  # the model's seed input is UINT64
MAX_TOP_K = (1 << 31) - 1  # the model's top_k input is INT32


class ApiError(Exception):
    """A request answered with an OpenAI error object: {"error": {message, type, param, code}} and an HTTP status."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 403: "invalid_request_error",
             404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
             415: "invalid_request_error", 500: "server_error", 503: "service_unavailable_error",
             504: "timeout_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class Limits:
    """The deployed model's bounds, read from its config.pbtxt parameters."""

    max_tokens: int  # max_tokens_limit
    default_max_tokens: int
    max_seq_len: int
    max_request_seconds: float = 300.0  # the model's longest timeout_seconds


@dataclass
class Call:
    """One validated request: the Triton model's inputs and what the answer needs."""

    kind: str  # "chat" or "text"
    fields: dict  # Triton input name -> value (client.grpc_inputs makes the tensors)
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 0
    n: int = 1  # choices: rows of one model request, each with its own seed (`upstream_rows`)
    tools: str = "none"  # "none": text; "auto": a tool call if the answer is one; "required": always a call
    tool_names: tuple[str, ...] = ()  # the functions a call may name
    echo: str | None = None  # completions' `echo`: the prompt, returned before the answer
    best_of: int = 1  # completions: rows decoded, the n of best mean logprob returned (`best_choices`)
    scored: bool = False  # logprobs asked of the model only to rank best_of's rows: not returned

    @property
    def rows(self) -> int:
        return max(self.n, self.best_of)


# --------------------------------------------------------------------------- requests


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON ({e}): send a JSON object") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    try:  # JSON may escape a lone surrogate ("\\ud800"): text that no UTF-8 (so no model input) can carry
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(f"the request body holds a lone surrogate ({e.object[e.start:e.end]!a}): send valid Unicode "
                  "text") from None
    return body


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    # an int is compared exactly (math.isfinite of a 400-digit one raised OverflowError: a 500, not this 400)
    if isinstance(value, bool) or not isinstance(value, int | float) or (isinstance(value, float)
                                                                         and not math.isfinite(value)):
        raise bad(f"{name} must be a number, got {json.dumps(value)[:40]}", name)
    if value < low or value > high or (low_open and value == low):
        raise bad(f"{name} must be in {'(' if low_open else '['}{low:g}, {high:g}], got {str(value)[:40]}", name)
    return float(value)


def _integer(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"{name} must be an integer, got {json.dumps(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise bad(f"{name} must be in [{low}, {high}], got {value}", name)
    return value


def _same(value, ok) -> bool:
    """JSON equality where true is not 1 (0 and 0.0 are the same number)."""
    if isinstance(value, bool) or isinstance(ok, bool):
        return value is ok
    return value == ok


def _check_fields(body: dict, allowed: set[str]) -> None:
    for name, value in body.items():
        if name in allowed or name in IGNORED or value is None:
            continue
        if name in NOOP:
            if not any(_same(value, ok) for ok in NOOP[name]):
                raise bad(f"{name}={json.dumps(value)} is not supported by spectrt "
                          f"(accepted: {', '.join(json.dumps(v) for v in NOOP[name])})", name, "unsupported_parameter")
            continue
        raise bad(f"unrecognized request argument: {name}", name, "unrecognized_argument")


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop has {len(stops)} strings, more than {MAX_STOPS}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return stops


def _structured(body: dict) -> str | None:
    """The model's `structured_output` (runtime/decoding/grammar.py) from OpenAI's `response_format` (json_object,
    json_schema) or vLLM's `structured_outputs` extension ({"json": schema} | {"regex": ..} | {"grammar": EBNF}); None
    for plain text. The model compiles it: a schema it cannot compile is answered 400 naming it."""
    fmt, ext = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and ext is not None:
        raise bad("send one of response_format and structured_outputs", "structured_outputs")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return json.dumps({"type": "json_object"})
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise bad("response_format.json_schema.schema must be a JSON Schema object", "response_format")
            return json.dumps({"type": "json_schema", "schema": schema})
        raise bad('response_format.type must be "text", "json_object" or "json_schema"', "response_format")
    if ext is not None:
        kinds = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}
        given = {k: v for k, v in ext.items() if v is not None} if isinstance(ext, dict) else {}
        if len(given) != 1 or next(iter(given)) not in kinds:
            raise bad('structured_outputs must name one of "json" (a JSON Schema), "regex" or "grammar" (EBNF)',
                      "structured_outputs")
        (key, value), = given.items()
        if key == "json" and not isinstance(value, dict | str) or key != "json" and not isinstance(value, str):
            raise bad(f"structured_outputs.{key} must be {'a JSON Schema' if key == 'json' else 'a string'}",
                      "structured_outputs")
        return json.dumps({"type": kinds[key], "value": value})
    return None


def _common(body: dict, served: str, limits: Limits, max_tokens: int | None, max_tokens_name: str = "max_tokens"
            ) -> tuple[dict, bool, bool, list[str]]:
    """The fields both endpoints share; `max_tokens_name`: the body's field that gave `max_tokens` (its errors name
    it: a chat body may send max_completion_tokens)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required: the served model's name (GET /v1/models)", "model")
    if model != served:  # 404, as OpenAI's own API and vLLM answer an unknown model
        raise ApiError(404, f"the model `{model}` does not exist: this server serves `{served}` (GET /v1/models)",
                       "model", "model_not_found")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad("stream must be true or false", "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or any(k != "include_usage" and v is not None for k, v in options.items()):
            raise bad('stream_options supports {"include_usage": true|false} only', "stream_options")
        include_usage = options.get("include_usage") or False
        if not isinstance(include_usage, bool):
            raise bad("stream_options.include_usage must be true or false", "stream_options")
    if max_tokens is not None and not 1 <= max_tokens <= limits.max_tokens:
        raise bad(f"{max_tokens_name} must be in [1, {limits.max_tokens}] (this deployment's limit), got "
                  f"{max_tokens}", max_tokens_name)
    fields: dict = {"max_tokens": max_tokens if max_tokens is not None else limits.default_max_tokens}
    temperature = _number(body, "temperature", 0, 2)
    top_p = _number(body, "top_p", 0, 1, low_open=True)
    top_k = _integer(body, "top_k", -1, MAX_TOP_K)
    seed = _integer(body, "seed")
    min_tokens = _integer(body, "min_tokens", 0, fields["max_tokens"])
    ignore_eos = body.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise bad("ignore_eos must be true or false", "ignore_eos")
    tree = body.get("tree")
    if tree is not None and not isinstance(tree, str):
        raise bad('tree must be a string: branching per depth ("2,1"), or "none" for the target alone', "tree")
    for name, value in (("temperature", temperature), ("top_p", top_p), ("tree", tree)):
        if value is not None:
            fields[name] = value
    if top_k is not None:
        fields["top_k"] = max(top_k, 0)  # -1 (vLLM) and 0 both mean no top-k
    if seed is not None:
        fields["seed"] = seed % SEED_MODULUS
    if ignore_eos or min_tokens:  # end-of-sequence is masked until min_length tokens: ignore_eos = all of them
        fields["min_length"] = fields["max_tokens"] if ignore_eos else min_tokens
    for name, low, high in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("repetition_penalty", 0, 100)):
        value = _number(body, name, low, high, low_open=name == "repetition_penalty")
        if value is not None and value != (1 if name == "repetition_penalty" else 0):  # no-op values stay out
            fields[name] = value
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict) or not all(
                isinstance(k, str) and k.isdigit() and isinstance(v, int | float) and not isinstance(v, bool)
                and -100 <= v <= 100 for k, v in bias.items()):
            raise bad('logit_bias must map token ids ("50256") to numbers in [-100, 100]', "logit_bias")
        fields["logit_bias"] = json.dumps(bias)
    structured = _structured(body)
    if structured is not None:
        fields["structured_output"] = structured
    stops = _stops(body)
    if stops:  # the model stops on them itself: the tokens it counts end with the one that completed the stop string
        fields["stop_words"] = stops
    return fields, stream, include_usage, stops


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"messages[{i}].content: only text parts are supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict) -> list[dict]:
    """`messages` as [{role, content}] for the chat template (developer turns become system turns)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad(f"messages[{i}] must be an object with role and content", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {json.dumps(role)}", "messages")
        calls = message.get("tool_calls") if role == "assistant" else None
        for key, value in message.items():
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id") and value not in (None, [], "",
                                                                                                     {}):
                raise bad(f"messages[{i}].{key} is not supported by spectrt (text turns and tool calls only)",
                          "messages")
        if calls:  # an earlier call, as the model writes one (TOOL_PROMPT): the next turn reads what it asked
            try:
                content = "\n".join(json.dumps({"name": c["function"]["name"],
                                                "arguments": json.loads(c["function"]["arguments"] or "{}")})
                                     for c in calls)
            except (TypeError, KeyError, ValueError):
                raise bad(f"messages[{i}].tool_calls must be [{{id, type, function: {{name, arguments (JSON text)}}}}]",
                          "messages") from None
        else:
            content = _content(message, i)
        out.append({"role": ROLES[role], "content": content})
    return out


def _function_schema(function: dict) -> dict:
    """A call of `function` as the model writes it: {"name": its name, "arguments": what its parameters allow}."""
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _tools(body: dict) -> tuple[list[dict], str, str | None]:
    """`tools` / `tool_choice` -> (the functions the model is shown, the mode "none" | "auto" | "required", the
    structured output that forces a call: "required" any of them, a named function that one)."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) and t["function"]["name"]
            and isinstance(t["function"].get("parameters") or {}, dict) for t in tools):
        raise bad('tools must be a list of {"type": "function", "function": {"name", "parameters": JSON Schema}}',
                  "tools")
    functions = [t["function"] for t in tools]
    if choice is None:
        choice = "auto" if functions else "none"
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        named = [f for f in functions if f["name"] == name]
        if not named:
            raise bad(f"tool_choice names {json.dumps(name)}, which is not among tools", "tool_choice")
        return functions, "required", json.dumps({"type": "json_schema", "schema": _function_schema(named[0])})
    if choice not in ("none", "auto", "required"):
        raise bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
                  "tool_choice")
    if choice != "none" and not functions:
        raise bad(f'tool_choice "{choice}" needs tools', "tool_choice")
    if choice == "none":
        return [], "none", None
    if choice == "auto":
        return functions, "auto", None
    schemas = [_function_schema(f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return functions, "required", json.dumps({"type": "json_schema", "schema": schema})


def tool_prompt(messages: list[dict], functions: list[dict]) -> list[dict]:
    """The messages with the functions and how to call them in the system turn: for a chat template that does not
    render `tools` itself."""
    note = TOOL_PROMPT + json.dumps(functions, ensure_ascii=False)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + note}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def tool_calls(text: str, names: tuple[str, ...]) -> list[dict] | None:
    """The answer as OpenAI `tool_calls` if it is one call of a named function ({"name", "arguments"}), else None."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names or not isinstance(value.get("arguments"), dict) \
            or set(value) != {"name", "arguments"}:
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": value["name"], "arguments": json.dumps(value["arguments"], ensure_ascii=False)}}]


def parse_chat(body: dict, served: str, limits: Limits, render: Callable[[list[dict], list[dict]], str]) -> Call:
    """A /v1/chat/completions body -> Call; `render(messages, functions)` applies the target's chat template to the
    messages (and the functions the model may call)."""
    _check_fields(body, CHAT_FIELDS)
    messages = chat_messages(body)
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name)
    fields, stream, include_usage, stops = _common(body, served, limits, max_tokens, name)
    functions, mode, forced = _tools(body)
    if forced is not None:
        if "structured_output" in fields:
            raise bad("a forced tool call is already a structured output: send tool_choice or response_format",
                      "tool_choice")
        fields["structured_output"] = forced
    fields.update(text_input=render(messages, functions), apply_chat_template=False)
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad("logprobs must be true or false (top_logprobs says how many alternatives)", "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top and not logprobs:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    if logprobs:
        fields["logprobs"] = top or 0
    return Call("chat", fields, stream, include_usage, stops, fields["max_tokens"], _integer(body, "n", 1, MAX_N) or 1,
                mode, tuple(f["name"] for f in functions))


def parse_completion(body: dict, served: str, limits: Limits) -> Call:
    """A /v1/completions body -> Call (the prompt is sent as is: no chat template)."""
    _check_fields(body, TEXT_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise bad("prompt must be one string: token-id prompts and batches of prompts are not supported", "prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise bad("prompt must be a non-empty string", "prompt")
    fields, stream, include_usage, stops = _common(body, served, limits, _integer(body, "max_tokens"))
    fields.update(text_input=prompt, apply_chat_template=False)
    logprobs = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)  # legacy completions: the count of alternatives
    if logprobs is not None:
        fields["logprobs"] = logprobs
    echo = body.get("echo") or False
    if not isinstance(echo, bool):
        raise bad("echo must be true or false", "echo")
    n = _integer(body, "n", 1, MAX_N) or 1
    best_of = _integer(body, "best_of", 1, MAX_N) or n
    if best_of < n:
        raise bad(f"best_of ({best_of}) must be at least n ({n})", "best_of")
    scored = best_of > n and logprobs is None
    if best_of > n:
        if stream:
            raise bad("best_of > n is answered whole (the best are known at the end): send stream false", "best_of")
        fields.setdefault("logprobs", 0)  # each row's logprobs rank it
    if echo and logprobs is not None:
        if stream:
            raise bad("echo with logprobs is answered whole (the prompt's logprobs come with the answer's end): "
                      "send stream false", "echo")
        fields["prompt_logprobs"] = True  # lm-eval's loglikelihood: the prompt's tokens' logprobs
    return Call("text", fields, stream, include_usage, stops, fields["max_tokens"], n, echo=prompt if echo else None,
                best_of=best_of, scored=scored)


def upstream_rows(call: Call, seconds: float) -> list[dict]:
    """What the frontend always asks of the model, a row per choice: a stream of text deltas with token counts and
    perf metrics, ended by the model itself once the `seconds` left of the request's deadline have passed. Choice i
    of a seeded request draws from seed + i: n samples, not n copies, reproducible all the same."""
    base = {**call.fields, "stream": True, "exclude_input_in_output": True, "return_perf_metrics": True,
            "return_num_input_tokens": True, "return_num_output_tokens": True, "timeout_seconds": seconds}
    if "seed" not in base:
        return [base] * call.rows
    return [{**base, "seed": (base["seed"] + i) % SEED_MODULUS} for i in range(call.rows)]


# --------------------------------------------------------------------------- stop strings


# --------------------------------------------------------------------------- responses


@dataclass
class Choice:
    """What the model's responses for one choice (row) added up to."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: str | None = None
    perf: dict = field(default_factory=dict)
    logprobs: list[dict] = field(default_factory=list)  # the model's logprobs content entries, if asked
    prompt_logprobs: list[dict] = field(default_factory=list)  # the prompt's entries (`echo` with logprobs)


@dataclass
class Outcome:
    """What the model's responses added up to: the prompt's counts and each choice's."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, those read from the prefix cache
    choices: list[Choice] = field(default_factory=lambda: [Choice()])

    @property
    def perf(self) -> dict:
        """The choices' perf counts summed (one request's speculation, however many rows decoded it)."""
        total: dict = {}
        for choice in self.choices:
            for name, value in choice.perf.items():
                total[name] = total.get(name, 0) + value
        return total

    def usage(self) -> dict:
        """OpenAI's usage (completion tokens of every choice, the prompt once); speculation as gateways read it for
        vLLM and SGLang: drafted tokens the target kept are `accepted_prediction_tokens`, the others
        `rejected_prediction_tokens` (OpenAI's Predicted Outputs fields)."""
        completion = sum(c.completion_tokens for c in self.choices)
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                 "total_tokens": self.prompt_tokens + completion,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        metrics = speculative_metrics(self.perf)
        if metrics is not None:
            accepted = metrics["num_accepted_draft_tokens"]
            usage["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                  "rejected_prediction_tokens": metrics["num_draft_tokens"] - accepted}
        return usage


def speculative_metrics(perf: dict) -> dict | None:
    """vLLM's per-request `metrics.speculative_decoding` from the model's perf outputs (None without them).

    mean_acceptance_length is τ, tokens per target pass (vLLM: 1 + accepted / steps); a step is one target pass.
    vLLM's acceptance_histogram and num_spec_tokens are left out: the model reports totals, and a tree's size
    varies per step.
    """
    passes = perf.get("target_passes")
    if not passes:
        return None
    accepted, drafted = int(perf.get("total_accepted_draft_tokens", 0)), int(perf.get("total_draft_tokens", 0))
    return {"mean_acceptance_length": 1 + accepted / passes,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "num_spec_steps": int(passes), "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted}


def finish_reason(choice: Choice) -> str:
    """A choice's finish_reason: the model's (the frontend refuses a final response without one, and sets "stop"
    where it ended the answer at a stop string itself)."""
    return choice.finish_reason or "stop"


def choice_logprobs(call: Call, entries: list[dict], offset: int = 0) -> dict | None:
    """A choice's `logprobs` (None unless asked) from the model's content entries: chat {"content": entries};
    completions the legacy {tokens, token_logprobs, top_logprobs, text_offset}, offsets counted from `offset` (the
    characters of the text before these tokens)."""
    if call.fields.get("logprobs") is None or call.scored:
        return None
    if call.kind == "chat":
        return {"content": entries}
    offsets = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [None if e["top_logprobs"] is None else
                             {t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}


def answered_calls(call: Call, choice: Choice) -> list[dict] | None:
    """A chat choice's `tool_calls` where tools were offered and the answer, ended by the model, is a call."""
    if call.tools == "none" or choice.finish_reason not in (None, "stop"):
        return None
    return tool_calls(choice.text, call.tool_names)


def best_choices(call: Call, rows: list[Choice]) -> list[Choice]:
    """The n choices returned: every row, or best_of's n rows of the highest mean token logprob (OpenAI's "best"),
    best first (a row with no tokens ranks last)."""
    if call.rows == call.n:
        return rows

    def mean(choice: Choice) -> float:
        return sum(e["logprob"] for e in choice.logprobs) / len(choice.logprobs) if choice.logprobs else -math.inf

    return sorted(rows, key=mean, reverse=True)[:call.n]


def completion_body(call: Call, rid: str, created: int, model: str, outcome: Outcome) -> dict:
    """The non-streaming answer (chat.completion or text_completion), a choice per row."""
    choices = []
    for index, choice in enumerate(best_choices(call, outcome.choices)):
        entries = choice.prompt_logprobs + choice.logprobs if call.echo is not None else choice.logprobs
        reason, logprobs = finish_reason(choice), choice_logprobs(call, entries)
        if call.kind == "chat":
            calls = answered_calls(call, choice)
            message = {"role": "assistant", "content": choice.text} if calls is None else \
                {"role": "assistant", "content": None, "tool_calls": calls}
            choices.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": reason if calls is None else "tool_calls"})
        else:
            choices.append({"index": index, "text": (call.echo or "") + choice.text, "logprobs": logprobs,
                            "finish_reason": reason})
    body = {"id": rid, "object": "chat.completion" if call.kind == "chat" else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": outcome.usage()}
    metrics = speculative_metrics(outcome.perf)
    if metrics is not None:
        body["metrics"] = {"speculative_decoding": metrics}
    return body


class Chunks:
    """Server-sent events of one streamed answer: `data: <chunk>` lines, then `data: [DONE]`."""

    def __init__(self, call: Call, rid: str, created: int, model: str):
        self.call = call
        # per choice: text held back while it may be a tool call (sent as tool_calls, or as text once it cannot be)
        self.holding = [call.kind == "chat" and call.tools != "none"] * call.n
        self.held = [""] * call.n
        self.first = [True] * call.n  # per choice: no chunk sent yet (a chat choice's first delta names the role)
        self.offset = [0] * call.n  # per choice: characters of token text streamed so far (completions' text_offset)
        self.head = {"id": rid, "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
                     "created": created, "model": model}

    def _event(self, choices: list, **extra) -> bytes:
        body = {**self.head, "choices": choices, **extra}
        if self.call.include_usage and "usage" not in body:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def _choice(self, index: int, delta: str, logprobs: dict | None, reason: str | None) -> dict:
        if self.call.kind == "chat":
            message = {"role": "assistant", "content": delta} if self.first[index] else (
                {"content": delta} if delta or reason is None else {})
            choice = {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
        self.first[index] = False
        return choice

    def text(self, delta: str, logprobs: list[dict] | None = None, index: int = 0) -> bytes:
        """A chunk of one choice's text and, if asked, the logprobs of the tokens it came with."""
        entries = choice_logprobs(self.call, logprobs or [], self.offset[index])
        self.offset[index] += sum(len(e["token"]) for e in logprobs or [])
        if self.holding[index]:
            self.held[index] += delta
            start = self.held[index].lstrip()
            if self.call.tools == "required" or not start or start.startswith("{"):
                return self._event([self._choice(index, "", entries, None)]) if entries else b""
            self.holding[index], delta, self.held[index] = False, self.held[index], ""  # "auto": text after all
        return self._event([self._choice(index, delta, entries, None)])

    def finish(self, choice: Choice, index: int = 0) -> bytes:
        """One choice's last chunks: a held-back tool call (or the text it turned out to be), its finish reason."""
        out, reason = b"", finish_reason(choice)
        if self.holding[index]:
            calls = answered_calls(self.call, choice)
            if calls is not None:
                first, self.first[index] = self.first[index], False
                delta = {"role": "assistant"} if first else {}
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
                out += self._event([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}])
                reason = "tool_calls"
            elif self.held[index]:
                out += self._event([self._choice(index, self.held[index], None, None)])
        return out + self._event([self._choice(index, "", None, reason)])

    def done(self, outcome: Outcome) -> bytes:
        """After every choice finished: (include_usage) usage and metrics, then [DONE]."""
        out = b""
        if self.call.include_usage:
            metrics = speculative_metrics(outcome.perf)
            extra = {"metrics": {"speculative_decoding": metrics}} if metrics is not None else {}
            out += self._event([], usage=outcome.usage(), **extra)
        return out + DONE

    @staticmethod
    def error(error: ApiError) -> bytes:
        """A failure after the stream began (its status is already 200): an error event, then [DONE]."""
        return b"data: " + json.dumps(error.body()).encode() + b"\n\n" + DONE


DONE = b"data: [DONE]\n\n"


UPSTREAM = (  # how the model's errors begin (runtime/serving/scheduler.py, the model's refusals) -> status, code
    ("overloaded", 503, "overloaded"), ("the server is stopping", 503, "overloaded"),
    ("deadline exceeded", 504, "timeout"), ("spectrt failed", 500, "internal_error"),
    ("invalid request: ", 400, "invalid_value"))


def upstream_error(message: str) -> ApiError:
    """The model's (or Triton's) error message -> the OpenAI error with the right status, by origin.

    Triton's gRPC stream carries only the message, so the model begins each of its errors with words that say which
    (UPSTREAM): overloaded or stopping -> 503 (clients retry), past the deadline -> 504, its own failure -> 500, a
    refused request -> 400. Anything else is Triton's own (the model unknown, not ready, the server shutting down):
    503, as the model is not there to serve.
    """
    for prefix, status, code in UPSTREAM:
        if message.startswith(prefix):
            return ApiError(status, message, None, code)
    return ApiError(503, f"Triton could not serve the request: {message}", None, "unavailable")
