"""One validator from request fields to a decode job: every bound checked before any expensive work.

The Triton model (and the CLI) hand raw field values here, one dict per row; `make_row` checks them in order of
cost (sizes and counts before decoding bytes, decoding before tokenizing) and returns a `Row`: the decode `Job`
plus what serving needs (streaming, stop strings, which outputs to return). The decoder's own `check` stays the
last line (token ids against the vocabulary, tree size). Every refusal is a `RequestError` whose message names
the field, the limit and the fix.

Schema (tensorrtllm_backend's, so existing clients work): `text_input` (required), `max_tokens`, `stream`,
`temperature`, `top_k`, `top_p`, `seed` / `random_seed`, `end_id`, `pad_id`, `beam_width`, `min_length`,
`bad_words`, `stop_words`, `exclude_input_in_output`, `return_perf_metrics`, `return_num_input_tokens`,
`return_num_output_tokens`, `presence_penalty`, `frequency_penalty`, `repetition_penalty`; spectrt extensions `tree`,
`children`, `apply_chat_template`, `timeout_seconds`, `structured_output`, `logit_bias`, `logprobs` (the count of
top alternatives per emitted token, 0 to 20; absent: none), `prompt_logprobs` (the prompt's tokens' too). A row that
asks for logprobs gets them in each response's `output_logprobs` (`logprob_json`: the OpenAI API's logprobs content
entries for that response's tokens), its prompt's in its final response's `output_prompt_logprobs`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from spectrt.runtime.decoding.decoder import CHILD_MODES, Job
from spectrt.runtime.decoding.penalties import Penalties
from spectrt.runtime.decoding.sampling import MAX_TOP_LOGPROBS, SamplingParams
from spectrt.runtime.decoding.tree import AUTO, Tree, TreeError, parse_tree_arg

FIELDS = ("text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed", "random_seed", "end_id",
          "pad_id", "beam_width", "min_length", "bad_words", "stop_words", "exclude_input_in_output",
          "return_perf_metrics", "return_num_input_tokens", "return_num_output_tokens", "tree", "children",
          "apply_chat_template", "timeout_seconds", "structured_output", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "logprobs", "prompt_logprobs")


class RequestError(ValueError):
    """A bad request: answered with an INVALID_ARG error naming the problem."""


@dataclass(frozen=True)
class Limits:
    """What one deployment accepts (the model's config parameters)."""

    max_seq_len: int = 2048
    max_tokens: int = 1024  # largest max_tokens
    default_max_tokens: int = 128
    max_tree_tokens: int = 64
    max_tree_depth: int = 16
    max_request_cost: int = 16384  # tree nodes x max_tokens
    max_words: int = 64  # stop_words / bad_words per row
    max_word_tokens: int = 32
    # a stop word's bytes: one past max_word_tokens tokens is matched on the text alone (as every stop word also is),
    # so its length only costs a text search per step; 1024 takes any OpenAI `stop` the frontend accepts (256
    # characters of up to 4 bytes), which it forwards so the model ends the answer and counts its tokens itself
    max_stop_bytes: int = 1024
    max_prompt_bytes: int = 1 << 20
    max_request_seconds: float = 300.0  # server-side deadline of one request
    speculation: bool = True  # a draft or suffix candidates exist: a tree may be served

    @property
    def max_word_bytes(self) -> int:
        return 16 * self.max_word_tokens  # no token covers more than 16 bytes of ordinary text

    @property
    def max_tree_chars(self) -> int:
        return 4 * self.max_tree_depth + 8  # "k," per level with k < 1000, and some spaces


@dataclass(eq=False)  # identity: two requests with equal fields are still two requests
class Row:
    """One row of a request: its decode job and how to answer it."""

    job: Job
    prompt: str
    stream: bool = False
    exclude_input: bool = True
    perf: bool = False
    n_in: bool = False
    n_out: bool = False
    stop_strings: list[str] = field(default_factory=list)
    timeout: float = 300.0


def _text(value, name: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RequestError(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    return str(value)


def _number(fields: Mapping, name: str, default, kind=int):
    value = fields.get(name)
    if value is None:
        return default
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise RequestError(f"{name} must be a number, got {str(value)[:40]!r}") from None
    if kind is float and not math.isfinite(number):
        raise RequestError(f"{name} must be a finite number, got {number}")
    return number


def _flag(fields: Mapping, name: str, default: bool) -> bool:
    value = fields.get(name)
    if value is None:
        return default
    if isinstance(value, bytes | str):
        return _text(value, name).strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def parse_tree(spec, limits: Limits, default: Tree | str | None = AUTO) -> Tree | str | None:
    """A request's `tree`: "auto" (dynamic trees under the tuned policy), "none"/"ar"/"0" (the target alone) or a
    SpecInfer expansion vector such as "2,1"; its length is checked before it is split or echoed."""
    if spec is None:
        return default
    if isinstance(spec, bytes) and len(spec) > limits.max_tree_chars:
        raise RequestError(f"tree is {len(spec)} bytes long, more than {limits.max_tree_chars}: send an expansion "
                           f"vector such as 2,1 (at most max_tree_depth={limits.max_tree_depth} levels)")
    spec = _text(spec, "tree").strip()
    if len(spec) > limits.max_tree_chars:
        raise RequestError(f"tree is {len(spec)} characters long, more than {limits.max_tree_chars}: send an "
                           f"expansion vector such as 2,1 (at most max_tree_depth={limits.max_tree_depth} levels)")
    if not spec:
        return default
    try:
        tree = parse_tree_arg(spec, limits.max_tree_depth, limits.max_tree_tokens)
    except TreeError as e:
        raise RequestError(str(e)) from None
    return tree if limits.speculation else None  # a deployment without speculation runs every request alone


def parse_words(values, name: str, limits: Limits) -> list[str]:
    """stop_words / bad_words of one row: each non-empty string is one word (whitespace is a word too: "\\n");
    the count and byte sizes are checked before anything is decoded."""
    values = list(values or [])
    if len(values) > limits.max_words:
        raise RequestError(f"{name} has {len(values)} words, more than {limits.max_words}: send fewer")
    words = []
    for value in values:
        if name == "stop_words" and len(value) > limits.max_stop_bytes:
            raise RequestError(f"a word of {name} is {len(value)} bytes, more than {limits.max_stop_bytes}")
        if name != "stop_words" and len(value) > limits.max_word_bytes:
            raise RequestError(f"a word of {name} is {len(value)} bytes, longer than {limits.max_word_tokens} tokens")
        word = _text(value, name)
        if word:
            words.append(word)
    return words


def _penalties(fields: Mapping) -> Penalties | None:
    """presence / frequency / repetition penalties (FP32) and logit_bias (JSON text: {"token id": bias})."""
    bias = {}
    if fields.get("logit_bias") is not None:
        try:
            raw = json.loads(_text(fields["logit_bias"], "logit_bias"))
            bias = {int(k): float(v) for k, v in raw.items()}
        except (ValueError, TypeError, AttributeError):
            raise RequestError('logit_bias must be a JSON object {"token id": bias}, e.g. {"50256": -100}') from None
        if len(bias) > 300:
            raise RequestError(f"logit_bias has {len(bias)} entries, more than 300")
    try:
        penalties = Penalties(_number(fields, "presence_penalty", 0.0, float),
                              _number(fields, "frequency_penalty", 0.0, float),
                              _number(fields, "repetition_penalty", 1.0, float), bias)
    except ValueError as e:
        raise RequestError(str(e)) from None
    return penalties if penalties.active else None


def make_row(fields: Mapping, limits: Limits, encode: Callable[[str, bool], list[int]],
             encode_word: Callable[[str], list[int]], chat_default: bool = True,
             default_tree: Tree | str | None = AUTO, grammar: Callable[[str], object] | None = None) -> Row:
    """Validate one row's fields (raw values: bytes, str, numbers, lists) into a `Row`, cheapest checks first;
    `encode(prompt, chat)` tokenizes the prompt, `encode_word(word)` a stop/bad word (no special tokens),
    `grammar(spec)` compiles a `structured_output` (runtime/decoding/grammar.py) into the row's grammar state."""
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise RequestError(f"unknown field(s) {sorted(unknown)}: the schema is {', '.join(FIELDS)}")
    raw = fields.get("text_input")
    if raw is None:
        raise RequestError("text_input is required (TYPE_STRING, shape [1, 1]: the prompt)")
    if len(raw) > limits.max_prompt_bytes:  # before any decoding or tokenizing
        raise RequestError(f"text_input is {len(raw)} bytes: more than the context of max_seq_len="
                           f"{limits.max_seq_len} tokens can hold ({limits.max_prompt_bytes} bytes); shorten it")
    max_tokens = _number(fields, "max_tokens", limits.default_max_tokens)
    if not 1 <= max_tokens <= limits.max_tokens:
        raise RequestError(f"max_tokens must be in [1, {limits.max_tokens}] (this model's limit), got {max_tokens}")
    temperature = _number(fields, "temperature", 0.0, float)
    top_p = _number(fields, "top_p", 1.0, float)
    top_k = _number(fields, "top_k", 0)
    seed = _number(fields, "seed", None)
    seed = _number(fields, "random_seed", None) if seed is None else seed
    try:
        params = SamplingParams(temperature, top_k, top_p, None if seed is None else seed % (1 << 62))
    except ValueError as e:
        raise RequestError(str(e)) from None
    end_id = _number(fields, "end_id", None)
    beam_width = _number(fields, "beam_width", 1)
    if beam_width not in (0, 1):
        raise RequestError(f"beam_width {beam_width} is not supported: spectrt decodes one beam (send 1)")
    min_length = _number(fields, "min_length", 0)
    if not 0 <= min_length <= max_tokens:
        raise RequestError(f"min_length must be in [0, max_tokens={max_tokens}], got {min_length}")
    timeout = _number(fields, "timeout_seconds", limits.max_request_seconds, float)
    if limits.max_request_seconds < timeout <= limits.max_request_seconds * (1 + 1e-6):
        timeout = limits.max_request_seconds  # the limit itself sent as FP32 (35.2 -> 35.2000008): not over it
    if not 0 < timeout <= limits.max_request_seconds:
        raise RequestError(f"timeout_seconds must be in (0, {limits.max_request_seconds:g}] (this server's "
                           f"limit), got {timeout:g}")
    children = _text(fields.get("children") or b"sample", "children").strip() or "sample"
    if children not in CHILD_MODES:
        raise RequestError(f"children must be one of {CHILD_MODES}, got {children[:40]!r}")
    tree = parse_tree(fields.get("tree"), limits, default_tree)
    nodes = len(tree) if isinstance(tree, Tree) else limits.max_tree_tokens if tree == AUTO else 1
    if isinstance(tree, Tree) and nodes * max_tokens > limits.max_request_cost:
        raise RequestError(f"tree of {nodes} nodes x max_tokens {max_tokens} = {nodes * max_tokens} verify rows, "
                           f"more than max_request_cost={limits.max_request_cost}: send a smaller tree or max_tokens")
    words = {name: parse_words(fields.get(name), name, limits) for name in ("bad_words", "stop_words")}
    prompt = _text(raw, "text_input")
    if not prompt.strip():
        raise RequestError("text_input is empty: send the prompt text")
    token_words = {}
    for name, values in words.items():
        token_words[name] = []
        for w in values:
            ids = encode_word(w)
            if len(ids) > limits.max_word_tokens:
                if name == "stop_words":  # matched on the text alone (Row.stop_strings)
                    continue
                raise RequestError(f"a word of {name} is {len(ids)} tokens, more than {limits.max_word_tokens}")
            if ids:
                token_words[name].append(ids)
    ids = encode(prompt, _flag(fields, "apply_chat_template", chat_default))  # the only tokenization of the prompt
    if len(ids) >= limits.max_seq_len:
        raise RequestError(f"the prompt has {len(ids)} tokens but the context is max_seq_len={limits.max_seq_len} "
                           "tokens (prompt + output): shorten the prompt")
    penalties = _penalties(fields)
    logprobs = _number(fields, "logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (top alternatives per token), got {logprobs}")
    prompt_logprobs = _flag(fields, "prompt_logprobs", False)
    if prompt_logprobs and logprobs is None:
        logprobs = 0
    state = None
    if fields.get("structured_output") is not None:
        spec = _text(fields["structured_output"], "structured_output")
        if grammar is None:
            raise RequestError("structured_output is not served by this model")
        try:
            state = grammar(spec)
        except ValueError as e:  # GrammarError: the spec's problem, named
            raise RequestError(str(e)) from None
    job = Job(ids, max_tokens, tree, params, children, None if end_id is None else {end_id}, min_length,
              token_words["stop_words"], token_words["bad_words"], state, penalties, logprobs, prompt_logprobs)
    return Row(job, prompt, stream=_flag(fields, "stream", False),
               exclude_input=_flag(fields, "exclude_input_in_output", True),
               perf=_flag(fields, "return_perf_metrics", False), n_in=_flag(fields, "return_num_input_tokens", False),
               n_out=_flag(fields, "return_num_output_tokens", False), stop_strings=words["stop_words"],
               timeout=timeout)


FLOOR_LOGPROB = -9999.0  # a masked token's -inf, as JSON can carry it (vLLM's value)


def logprob_json(entries: list[tuple[int, float, list[tuple[int, float]]]],
                 token_bytes: Callable[[int], bytes]) -> str:
    """`output_logprobs` of one response: per token (id, logprob, top alternatives), the OpenAI API's logprobs
    content entry {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}; a logprob None (a prompt's first
    token: nothing before it to predict it) gives logprob and top_logprobs null."""

    def entry(token: int, logprob: float | None) -> dict:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", "replace"), "logprob": None if logprob is None else
                max(logprob, FLOOR_LOGPROB), "bytes": list(raw)}

    return json.dumps([{**entry(token, lp), "top_logprobs": None if lp is None else [entry(t, v) for t, v in top]}
                       for token, lp, top in entries])
