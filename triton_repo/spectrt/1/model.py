"""spectrt as a Triton python-backend model: decoupled, streaming, in-flight batching of token trees. Glue only.

`execute()` reserves queue room (backpressure before any parsing), reads each row's fields, validates and tokenizes
them with the one validator (runtime/serving/requests.py), and hands the request to the scheduler
(runtime/serving/scheduler.py), whose thread owns the decode loop (runtime/decoding/decoder.py: dynamic trees,
suffix candidates, the tuned policy, one speculation budget across requests). Responses go back through
`TritonSink`; every request ends with exactly one final response. The request schema is tensorrtllm_backend's plus
spectrt's extensions (runtime/serving/requests.py). Streaming sends each row's text deltas, then a final response
per row (empty `text_output`, `finish_reason` and, if asked, the perf metrics), the last one flagged final;
non-streaming sends one final response with every row. A request with the parameter `spectrt_health: true` is a
health probe, answered at once and never decoded (`TritonPythonModel._probe`).
"""

from __future__ import annotations

import json
import locale
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

# The stub embeds Python without calling setlocale (and ignores PYTHONUTF8): text files opened without an
# explicit encoding would be read as ASCII (tokenizer.json is UTF-8). Adopt a UTF-8 locale for this process.
for _name in ("", "C.UTF-8", "en_US.UTF-8"):
    try:
        locale.setlocale(locale.LC_CTYPE, _name)
    except locale.Error:
        continue
    if locale.getpreferredencoding(False).lower().replace("-", "") == "utf8":
        break

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CODES = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "deadline": "UNAVAILABLE", "internal": "INTERNAL"}
# Triton's gRPC stream carries an error's message only: a refusal says so in its first words, as the scheduler's other
# errors do ("overloaded", "the server is stopping", "deadline exceeded", "spectrt failed"), so a client (the OpenAI
# frontend) tells the model's errors by origin from Triton's own
INVALID_PREFIX = "invalid request: "
PERF = (("acceptance_rate", np.float32), ("total_accepted_draft_tokens", np.int32), ("total_draft_tokens", np.int32),
        ("target_passes", np.int32), ("output_tokens", np.int32), ("generation_seconds", np.float32))
COUNTERS = {  # scheduler metric -> (Prometheus name, help)
    "tokens": ("spectrt_tokens_generated_total", "Tokens generated (sent to clients)"),
    "proposed": ("spectrt_draft_tokens_proposed_total", "Candidate tokens proposed for verification"),
    "accepted": ("spectrt_draft_tokens_accepted_total", "Candidate tokens accepted by the target"),
    "target_passes": ("spectrt_target_passes_total", "Target verification passes (per request)"),
    "requests": ("spectrt_requests_total", "Generations completed (one per row of a request)"),
    "admitted": ("spectrt_requests_admitted_total", "Rows that took a decoding slot (prefill began)"),
    "prompt_tokens_cached": ("spectrt_prompt_tokens_cached_total", "Prompt tokens of admitted rows whose KV came "
                             "from the prefix cache"),
    "prompt_tokens_computed": ("spectrt_prompt_tokens_computed_total", "Prompt tokens of admitted rows prefilled "
                               "(not in the prefix cache)"),
    "overloaded": ("spectrt_requests_overloaded_total", "Rows refused: queue full, waited too long, or stopping"),
    "cancelled": ("spectrt_requests_cancelled_total", "Rows whose client went away"),
    "deadline_exceeded": ("spectrt_requests_deadline_exceeded_total", "Requests ended past their deadline"),
    "failed": ("spectrt_requests_failed_total", "Rows whose own step failed (the batch went on)"),
    "steps": ("spectrt_batch_steps_total", "Batched decoder steps (one target forward each)"),
    "step_fallbacks": ("spectrt_batch_step_fallbacks_total", "Batched steps whose forward failed, each row then "
                       "retried alone"),
    "scheduler_restarts": ("spectrt_scheduler_restarts_total", "Scheduler threads restarted after a crash"),
    "server_restarts": ("spectrt_server_restarts_total", "tritonserver restarts by spectrt serve's supervisor after "
                        "a python stub died (its count when this server started)"),
    "send_failed": ("spectrt_send_failures_total", "Responses the sender refused (that request alone ended)"),
    "step_tokens": ("spectrt_step_tokens_total", "Tokens emitted by batched steps (per step: / batch_steps_total)"),
    "step_tree_tokens": ("spectrt_step_tree_tokens_total", "Target rows spent on trees, roots included (per step: "
                         "/ batch_steps_total)"),
    "step_seconds": ("spectrt_step_seconds_total", "Wall time of batched decoder steps (per step: / "
                     "batch_steps_total)"),
    "target_forward_seconds": ("spectrt_target_forward_seconds_total", "Of that, the target's forwards (the rest: "
                               "draft forwards and the loop's host work)"),
}
# counted every step: sent to Triton in batches
PER_STEP = {"steps", "step_tokens", "step_tree_tokens", "step_seconds", "target_forward_seconds"}
FLUSH_SECONDS = 0.5
GAUGES = {"active": ("spectrt_active_requests", "Rows holding a decoding slot (active batch size)"),
          "queued": ("spectrt_queued_requests", "Rows waiting for a decoding slot")}
# The same load under the names the Gateway API Inference Extension's endpoint picker reads from a Triton server
# (TensorRT-LLM's), so an InferencePool routes to this model by queue and KV use: gauge -> (family, label, value)
GATEWAY = {"active": ("nv_trt_llm_request_metrics", {"request_type": "scheduled"}),
           "queued": ("nv_trt_llm_request_metrics", {"request_type": "waiting"}),
           "kv_fraction": ("nv_trt_llm_kv_cache_block_metrics", {"kv_cache_block_type": "fraction"})}
GATEWAY_DOCS = {"nv_trt_llm_request_metrics": "Rows scheduled (decoding) and waiting (the Gateway API Inference "
                "Extension's queue metric)", "nv_trt_llm_kv_cache_block_metrics": "Share of the static KV slots "
                "in use (the Gateway API Inference Extension's KV metric)"}
HISTOGRAMS = {
    "tau": ("spectrt_tau", "Each finished request's tokens per target pass (tau); the mean over all tokens is "
            "spectrt_tokens_generated_total / spectrt_target_passes_total",
            [1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 6, 8, 16]),
    "ttft": ("spectrt_time_to_first_token_seconds", "Request arrival to first text chunk",
             [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]),
    "queue_seconds": ("spectrt_queue_seconds", "Request arrival to its decoding slot",
                      [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]),
}


def _truthy(value: str) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


class TritonMetrics:
    """The scheduler's metrics as Triton custom metrics (Prometheus, port 8002).

    Each metric call is a round trip to tritonserver through the python backend's message queue, and on two cores
    every one of them competes with the forward. So the per-step counters are summed here and sent at most every
    FLUSH_SECONDS, gauges only when their value changes, and any other event (a request admitted, finished,
    cancelled, refused) sends everything at once: a client holding its final response reads exact counters.
    """

    def __init__(self, model: str, slots: int = 8):
        labels = {"model": model, "version": "1"}
        self.families, self.metrics = [], {}  # a family must outlive its metrics: keep them all
        for kind, table in ((pb_utils.MetricFamily.COUNTER, COUNTERS), (pb_utils.MetricFamily.GAUGE, GAUGES),
                            (pb_utils.MetricFamily.HISTOGRAM, HISTOGRAMS)):
            for key, (name, doc, *buckets) in table.items():
                self.families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
                extra = {"buckets": buckets[0]} if buckets else {}
                self.metrics[key] = self.families[-1].Metric(labels=labels, **extra)
        gateway = {}
        for name, doc in GATEWAY_DOCS.items():
            self.families.append(pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.GAUGE))
            gateway[name] = self.families[-1]
        self.gateway = {key: gateway[name].Metric(labels={**labels, **label}) for key, (name, label) in GATEWAY.items()}
        self.slots = max(slots, 1)
        self.pending: dict[str, float] = {}
        self.gauges: dict[str, float] = {}
        self.flushed = time.monotonic()
        self.lock = threading.Lock()  # execute() counts refusals while the scheduler thread counts the rest

    def count(self, name: str, value: float = 1) -> None:
        if value:
            with self.lock:
                self.pending[name] = self.pending.get(name, 0) + value
                due = name not in PER_STEP or time.monotonic() - self.flushed >= FLUSH_SECONDS
            if due:
                self.flush()

    def observe(self, name: str, value: float) -> None:
        self.metrics[name].observe(value)

    def gauge(self, name: str, value: float) -> None:
        with self.lock:
            if self.gauges.get(name) == value:
                return
            self.gauges[name] = value
        self.metrics[name].set(value)
        if name in self.gateway:
            self.gateway[name].set(value)
        if name == "active":  # the static KV pool: one slot per active row
            self.gateway["kv_fraction"].set(value / self.slots)

    def flush(self) -> None:
        with self.lock:
            pending, self.pending = self.pending, {}
            self.flushed = time.monotonic()
        for name, value in pending.items():
            self.metrics[name].increment(value)

    def close(self) -> None:
        if self.metrics:
            self.flush()
        self.metrics, self.gateway, self.families = {}, {}, []  # metrics first, then their families


def _number(params: dict[str, str], key: str, default, kind=int):
    """A numeric model parameter (its default when empty); positive unless 0 means "automatic" for it."""
    value = kind(params.get(key) or default)
    if value <= 0 and key not in ("threads", "tree_budget", "prefill_chunk"):
        raise pb_utils.TritonModelException(f"model parameter {key} must be positive, got {value}")
    return value


@dataclass
class Loaded:
    """What an instance loaded (its load log line)."""

    target: object
    draft: object
    backend: str
    dtype: str
    max_seq_len: int
    seconds: float


def error_response(message: str, code: str) -> pb_utils.InferenceResponse:
    """A final error response; `code` is the scheduler's ("invalid", "unavailable", "deadline", "internal")."""
    error = pb_utils.TritonError(INVALID_PREFIX + message if code == "invalid" else message,
                                 getattr(pb_utils.TritonError, CODES[code]))  # set up once the stub runs
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


class TritonSink:
    """One Triton request's response sender behind the scheduler's Sink interface."""

    def __init__(self, sender, rows, logprob_json):
        self.sender, self.rows, self.logprob_json = sender, rows, logprob_json
        self.stream = any(r.stream for r in rows)
        self.logprobs = [[] for _ in rows]  # per row: its tokens' logprobs not sent yet (non-streaming: all)
        self.reported = [0] * len(rows)  # tokens per row counted in a streamed num_output_tokens so far
        self.texts = [""] * len(rows)
        self.results: list = [None] * len(rows)

    def cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def _response(self, texts, rows, results=None, index=None, n_out=None, finish=None, logprobs=None):
        tensors = [pb_utils.Tensor("text_output", np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))]
        if results is not None and any(r.job.prompt_logprobs for r in rows):  # final responses only
            tensors.append(pb_utils.Tensor("output_prompt_logprobs", np.array(
                [[self.logprob_json(r.prompt_logprobs).encode()] for r in results], dtype=np.object_)))
        if logprobs is not None and any(r.job.logprobs is not None for r in rows):
            tensors.append(pb_utils.Tensor("output_logprobs", np.array(
                [[self.logprob_json(e).encode()] for e in logprobs], dtype=np.object_)))
        if results is not None and any(r.perf for r in rows):
            values = [{"acceptance_rate": r.accepted / r.proposed if r.proposed else 0.0,
                       "total_accepted_draft_tokens": r.accepted, "total_draft_tokens": r.proposed,
                       "target_passes": r.target_passes, "output_tokens": r.output_tokens,
                       "generation_seconds": r.seconds} for r in results]
            for name, dtype in PERF:
                tensors.append(pb_utils.Tensor(name, np.array([[v[name]] for v in values], dtype=dtype)))
        if any(r.n_in for r in rows):
            tensors.append(pb_utils.Tensor("num_input_tokens",
                                           np.array([[len(r.job.prompt_ids)] for r in rows], np.uint32)))
        if results is not None and any(r.n_in for r in rows):  # known once a row is done: final responses only
            tensors.append(pb_utils.Tensor("num_cached_tokens",
                                           np.array([[r.cached_tokens] for r in results], np.uint32)))
        if n_out is not None and any(r.n_out for r in rows):
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([[n] for n in n_out], np.uint32)))
        if finish is not None:
            tensors.append(pb_utils.Tensor("finish_reason", np.array([[f.encode()] for f in finish], np.object_)))
        if index is not None:
            tensors.append(pb_utils.Tensor("batch_index", np.array([[index]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def text(self, row: int, delta: str, tokens: int, logprobs: list) -> None:
        self.texts[row] += delta
        self.logprobs[row] += logprobs
        if self.stream:
            index = row if len(self.rows) > 1 else None
            self.sender.send(self._response([delta], [self.rows[row]], None, index, [tokens],
                                            logprobs=[self.logprobs[row]]))
            self.logprobs[row] = []
            self.reported[row] += tokens

    def row_done(self, row: int, result, last: bool) -> None:
        self.results[row] = result
        if self.stream:  # the final response of a row counts the tokens whose text was held back until now
            index = row if len(self.rows) > 1 else None
            rest = result.output_tokens - self.reported[row]
            self.sender.send(self._response([""], [self.rows[row]], [result], index, [rest], [result.finish_reason],
                                            [self.logprobs[row]]), flags=FINAL if last else 0)
        elif last:
            texts = [t if r.exclude_input else r.prompt + t for r, t in zip(self.rows, self.texts, strict=True)]
            self.sender.send(self._response(texts, self.rows, self.results, None,
                                            [r.output_tokens for r in self.results],
                                            [r.finish_reason for r in self.results], self.logprobs), flags=FINAL)

    def fail(self, message: str, code: str) -> None:
        self.sender.send(error_response(message, code), flags=FINAL)

    def close(self) -> None:
        self.sender.send(flags=FINAL)


class TritonLogHandler(logging.Handler):
    """The runtime's Python log records (the scheduler's warnings, a failed request's traceback) into Triton's own
    log (server.log), at their level. Why: the stub configures no logging, so they went to Python's last-resort
    handler, bare messages on stderr with no time, level or model."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            if record.levelno >= logging.ERROR:
                pb_utils.Logger.log_error(text)
            elif record.levelno >= logging.WARNING:
                pb_utils.Logger.log_warn(text)
            else:
                pb_utils.Logger.log_info(text)
        except Exception:
            self.handleError(record)


def route_logs() -> logging.Logger:
    """Send the `spectrt` loggers' records at INFO and above to Triton's log (once a process)."""
    root = logging.getLogger("spectrt")
    if not any(isinstance(h, TritonLogHandler) for h in root.handlers):
        handler = TritonLogHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


class TritonPythonModel:
    def initialize(self, args):
        route_logs()
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("spectrt needs model_transaction_policy { decoupled: true }")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.instance = args.get("model_instance_name", args["model_name"])
        self.base = Path(args["model_repository"]).resolve().parent.parent  # <repo parent>: relative paths
        threads = _number(params, "threads", 0)
        if threads <= 0:  # the CPUs this process may use (affinity mask, cgroup quota), split between instances
            from spectrt.runtime.engines.cpus import default_threads

            threads = default_threads(sum(g.get("count", 1) for g in config.get("instance_group", [])) or 1)
        loaded, failure = threading.Event(), []

        def load_then_decode() -> None:
            """Load, warm up and decode in this one thread. Why: the native forward ran at ~0.6x when the model was
            loaded in the stub's main thread and decoded in the scheduler thread (served AR 61.5 vs 99.1 tok/s in
            process, Zen 4, bf16; in process a thread that loaded the model itself decoded at full speed)."""
            try:
                import torch

                torch.set_num_threads(threads)
                self.loaded = self._load(params, args["model_name"])
            except BaseException as e:  # initialize raises it: the model does not load
                failure.append(e)
                loaded.set()
                return
            # the loop's thread is known before initialize returns: an execute in between saw no live scheduler
            # and started a second loop on the same decoder
            self.scheduler.thread = threading.current_thread()
            loaded.set()
            self.scheduler.run_here()

        threading.Thread(target=load_then_decode, name="spectrt-scheduler", daemon=True).start()
        loaded.wait()
        if failure:
            raise failure[0]
        info, decoder, policy = self.loaded, self.pipe.decoder, self.pipe.policy
        mode = {None: "none (target alone)", "auto": f"auto (budget {policy.budget}, depth "
                f"{policy.depth if info.draft else 0}, width {policy.width}{', suffix' if policy.suffix else ''})"}
        pb_utils.Logger.log_info(
            f"spectrt {self.instance}: target {info.target}, draft {info.draft}, backend {info.backend}/{info.dtype}, "
            f"tree {mode.get(self.default_tree, self.default_tree)}, max_seq_len {info.max_seq_len}, max_active "
            f"{decoder.max_active}, {threads} thread(s), prefix cache "
            f"{'on' if decoder.prefix is not None else 'off'}, loaded in {info.seconds:.1f}s")
        if decoder.prefix is None and decoder.prefix_refusal and _truthy(params.get("prefix_cache", "true")):
            pb_utils.Logger.log_warn(f"spectrt {self.instance}: no prefix cache: {decoder.prefix_refusal}")

    def _load(self, params: dict[str, str], model_name: str) -> Loaded:
        """The pipeline, limits, default tree, metrics and scheduler from the model parameters, warmed up (runs in
        the thread that will decode: `initialize`); returns what the load log line names."""
        from spectrt.runtime.decoding.pipeline import Pipeline
        from spectrt.runtime.decoding.text import TokenBytes
        from spectrt.runtime.serving import requests as validator
        from spectrt.runtime.serving.client import HEALTH_PARAMETER
        from spectrt.runtime.serving.scheduler import Overloaded, Request, Scheduler, warm_up
        from spectrt.runtime.serving.serve import STREAM_INTERVAL

        self.validator, self.Overloaded, self.Request = validator, Overloaded, Request
        self.health_parameter = HEALTH_PARAMETER  # the request parameter of a health probe (`_probe`)
        max_seq_len, max_tree_tokens = _number(params, "max_seq_len", 2048), _number(params, "max_tree_tokens", 64)
        target, draft, backend, dtype, max_seq_len, max_tree_tokens, tree = self._models(params, max_seq_len,
                                                                                          max_tree_tokens)
        load_start = time.perf_counter()
        # measure_kernels=false: the torch reference path's GEMM formulation is fixed, not timed at load
        self.pipe = Pipeline(target, draft, backend, dtype, max_seq_len, max_tree_tokens,
                             measure_kernels=_truthy(params.get("measure_kernels", "true")),
                             max_active=_number(params, "max_active", 8),
                             tree_budget=_number(params, "tree_budget", 0) or None,
                             prefill_budget=_number(params, "prefill_chunk", 0) or None,
                             prefix_cache=_truthy(params.get("prefix_cache", "true")))
        decoder, tokenizer, policy = self.pipe.decoder, self.pipe.tokenizer, self.pipe.policy
        # a token covers at most this many bytes of text: a longer prompt cannot fit, refuse it before tokenizing
        longest = max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(len(tokenizer)))
        max_tokens = _number(params, "max_tokens_limit", 1024)
        self.limits = validator.Limits(
            max_seq_len=max_seq_len, max_tokens=max_tokens,
            default_max_tokens=min(_number(params, "default_max_tokens", 128), max_tokens),
            max_tree_tokens=max_tree_tokens,
            max_tree_depth=_number(params, "max_tree_depth", 16),
            max_request_cost=_number(params, "max_request_cost", 16384),
            max_prompt_bytes=max_seq_len * max(longest, 1),
            max_request_seconds=_number(params, "max_request_seconds", 300.0, float),
            speculation=draft is not None or policy.suffix)
        self.chat_default = _truthy(params.get("chat_template", "true"))
        token_bytes = TokenBytes(tokenizer)
        self.logprob_json = lambda entries: validator.logprob_json(entries, token_bytes)
        try:
            self.default_tree = validator.parse_tree(tree or params.get("tree") or "auto", self.limits)
        except validator.RequestError as e:
            raise pb_utils.TritonModelException(f"model parameter tree: {e}") from None
        if _truthy(params.get("warmup", "true")):  # first forwards (allocator, scratch growth): now, not in a request
            try:
                warm_up(decoder, [self.pipe.encode("Hi"), self.pipe.encode("Hello")], self.default_tree)
            except RuntimeError as e:  # not READY: every request would fail the same way
                raise pb_utils.TritonModelException(f"spectrt {self.instance}: {e}") from None
        self.drain_seconds = _number(params, "drain_seconds", 5.0, float)
        self.metrics = TritonMetrics(model_name, decoder.max_active)
        self.metrics.count("server_restarts", int(os.environ.get("SPECTRT_SERVER_RESTARTS") or 0))  # supervise.py
        self.scheduler = Scheduler(decoder, tokenizer, self.metrics, _number(params, "max_queue_size", 64),
                                   _number(params, "max_queue_seconds", 30.0, float),
                                   _number(params, "stream_interval", STREAM_INTERVAL),
                                   _number(params, "max_stall_seconds", 60.0, float))
        return Loaded(target, draft, backend, dtype, max_seq_len, time.perf_counter() - load_start)

    def _path(self, value: str) -> Path:
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.base / path

    def _models(self, params: dict[str, str], max_seq_len: int, max_tree_tokens: int):
        """(target, draft or None, backend, dtype, max_seq_len, max_tree_tokens, default tree or None).

        engine_dir (an engines/<name> directory with manifest.json, from `spectrt engines`) wins when set:
        `spectrt.build.engines.engine_models` picks its target/draft models for the backend, and the manifest's
        max_seq_len and max_tree_tokens bound this model's. Otherwise target_dir ("" = <base>/artifacts/smollm2-
        135m-instruct, or $SPECTRT_ARTIFACTS/...) and draft_dir ("" = <target>-draft next to it, "none" = the
        target alone). Relative paths are relative to the model repository's parent directory.
        """
        from spectrt.runtime.engines.engine import resolve_dtype

        backend = params.get("backend") or "torch"
        dtype = params.get("dtype") or "auto"
        engine = params.get("engine_dir", "")
        if engine:
            from spectrt.runtime.engines.onnx_engine import engine_models

            engine = self._path(engine)
            manifest_file = engine / "manifest.json"
            if not manifest_file.is_file():
                raise pb_utils.TritonModelException(
                    f"engine_dir {engine} has no manifest.json: build it with `spectrt engines` (make engines)")
            manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
            max_seq_len = min(max_seq_len, int(manifest.get("max_seq_len", max_seq_len)))
            max_tree_tokens = int(manifest.get("max_tree_tokens", max_tree_tokens))
            target, draft = engine_models(engine, backend)
            tree = params.get("tree") or manifest.get("tree_defaults", {}).get("tree")
            return target, draft, backend, resolve_dtype(dtype, backend), max_seq_len, max_tree_tokens, tree
        from spectrt.runtime.engines.checkpoint import CheckpointError, resolve_models

        artifacts = Path(os.environ.get("SPECTRT_ARTIFACTS", self.base / "artifacts"))
        target_value, draft_value = params.get("target_dir", ""), params.get("draft_dir", "").strip()
        try:  # the one resolver every command uses: the embedded default, the target's default draft, "none"
            target, draft = resolve_models(self._path(target_value) if target_value else None,
                                           draft_value if draft_value.lower() in ("", "none") else
                                           self._path(draft_value), artifacts)
        except CheckpointError as e:
            raise pb_utils.TritonModelException(
                f"{e} (here: the model parameters target_dir / draft_dir in config.pbtxt, set by `spectrt serve "
                "--target/--draft`; draft_dir 'none' for no draft model)") from None
        return target, draft, backend, resolve_dtype(dtype, backend, target), max_seq_len, max_tree_tokens, None

    # ------------------------------------------------------------------------------------------ requests in
    def _rows(self, request) -> list[dict]:
        """Each row's raw field values (bytes, numbers, lists of bytes); every input's row count is text_input's."""
        validator = self.validator
        columns = {}
        for name in validator.FIELDS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:
                array = tensor.as_numpy()
                columns[name] = array.reshape(1, -1) if array.ndim < 2 else array.reshape(array.shape[0], -1)
        texts = columns.get("text_input")
        if texts is None:
            raise validator.RequestError("text_input is required (TYPE_STRING, shape [1, 1]: the prompt)")
        n = texts.shape[0]
        if n == 0:
            raise validator.RequestError("text_input has no rows: send one prompt a row, shape [1, 1]")
        for name, array in columns.items():
            if array.shape[0] != n:
                raise validator.RequestError(f"{name} has {array.shape[0]} rows but text_input has {n}")
        rows = []
        for i in range(n):
            fields = {}
            for name, array in columns.items():
                values = array[i]
                if name in ("bad_words", "stop_words"):
                    fields[name] = list(values)
                    continue
                if values.size != 1:
                    raise validator.RequestError(f"{name} must hold one value per row, got {values.size}")
                value = values[0]
                fields[name] = value.item() if hasattr(value, "item") and not isinstance(value, bytes) else value
            rows.append(fields)
        return rows

    def execute(self, requests):
        """Reserve, validate, tokenize, enqueue; the scheduler thread decodes and answers. Returns at once."""
        validator, tokenizer = self.validator, self.pipe.tokenizer
        for request in requests:
            sender = request.get_response_sender()
            reserved = 0
            try:
                if request.is_cancelled():  # abandoned before we looked at it: no work at all
                    sender.send(flags=FINAL)
                    continue
                # a health probe restarts a dead loop too: behind the OpenAI frontend, whose readiness sends one, a
                # dead loop's 503s kept every request (the only restart before) from reaching the model
                if not self.scheduler.alive:  # it died: restart it (what it held got error responses)
                    pb_utils.Logger.log_error(f"spectrt {self.instance}: scheduler thread died, restarting it")
                    self.scheduler.start()
                if self._probe(request, sender):
                    continue
                text = pb_utils.get_input_tensor_by_name(request, "text_input")
                rows = 1 if text is None else max(1, text.as_numpy().reshape(-1).shape[0])
                self.scheduler.reserve(rows)  # backpressure before any parsing or tokenizing
                reserved = rows
                fields = self._rows(request)
                made = [validator.make_row(f, self.limits, self.pipe.encode,
                                           lambda w: tokenizer.encode(w, add_special_tokens=False),
                                           self.chat_default, self.default_tree, self.pipe.grammar) for f in fields]
                if len(made) != reserved:
                    self.scheduler.release(reserved - len(made))
                self.scheduler.submit(self.Request(made, TritonSink(sender, made, self.logprob_json),
                                                   request.request_id()))
            except self.Overloaded as e:
                self._error(sender, str(e), "unavailable")
            except validator.RequestError as e:
                self.scheduler.release(reserved)
                self._error(sender, str(e), "invalid")
            except Exception as e:  # never leave a client without a final response
                self.scheduler.release(reserved)
                pb_utils.Logger.log_error(f"spectrt {self.instance}: request failed: {e!r}")
                self._error(sender, f"spectrt failed: {e}", "internal")
        return None

    def _probe(self, request, sender) -> bool:
        """Answer a health probe (request parameter `spectrt_health: true`, any `text_input`; False for any other
        request): a final "ok" while the decode loop advances, else an UNAVAILABLE error saying why not
        (`Scheduler.health`: requests in flight and no round of the loop for `max_stall_seconds`).

        Why a request: a wedged loop (a forward or a send that never returns) leaves its thread alive and this model
        READY, and the python backend of tritonserver 2.51 has no hook for a model's own readiness (a stub is ready
        while its process answers), so Triton's readiness cannot show it; nor can the Prometheus gauges, which the
        loop itself sets. `execute` runs on the stub's main thread, not the loop's, so it answers while the loop is
        stuck. The OpenAI frontend sends one with its readiness check (/health)."""
        if json.loads(request.parameters() or "{}").get(self.health_parameter) is not True:
            return False
        reason = self.scheduler.health()
        if reason is not None:
            self._error(sender, reason, "unavailable")
        else:
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("text_output", np.array([[b"ok"]], dtype=np.object_))]), flags=FINAL)
        return True

    @staticmethod
    def _error(sender, message: str, code: str) -> None:
        try:
            sender.send(error_response(message, code), flags=FINAL)
        except Exception as e:  # the client is gone: nothing left to tell it
            pb_utils.Logger.log_warn(f"spectrt: could not send the error response ({e!r}): {message}")

    def finalize(self):
        """Drain: refuse new requests, let in-flight ones finish for up to drain_seconds, end the rest UNAVAILABLE.
        A loop still inside a step after that ends its requests itself when the step returns, counting into the
        metrics as it does: they stay open then (closed under it, its counts would raise)."""
        if self.scheduler.stop(self.drain_seconds):
            self.metrics.close()
        else:
            pb_utils.Logger.log_error(f"spectrt {self.instance}: the decode loop did not stop: its requests end "
                                      "when its step returns")
        self.scheduler = self.pipe = None
