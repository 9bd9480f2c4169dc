"""spectrt as a Triton python-backend model: decoupled, streaming, in-flight batching of token trees.

`execute()` validates and tokenizes each request (once, after a byte-length check), puts it on a bounded queue
and returns. One scheduler thread per instance owns a `BatchDecoder` (up to `max_active` requests, each with
its own static KV slots allocated at load): between steps it drops cancelled or expired requests, admits
waiting ones into free slots, runs one batched step (all trees drafted level by level together, one target
forward over the forest, chunked prefill sharing the step) and streams every request's new text from there.
One instance is the default: a second instance is another full copy of the models.

Request schema (tensorrtllm_backend's): `text_input` (required), `max_tokens`, `stream`, `temperature`,
`top_k`, `top_p`, `seed` / `random_seed`, `end_id`, `pad_id`, `beam_width`, `min_length`, `bad_words`,
`stop_words`, `exclude_input_in_output`, `return_perf_metrics`, `return_num_input_tokens`,
`return_num_output_tokens`, plus the spectrt extensions `tree`, `children`, `apply_chat_template`. Streaming
sends each verified chunk's text delta, then a final response (flagged final) with an empty `text_output`
and, if asked, the perf metrics; non-streaming gets one final response with the whole text. Every request
ends with exactly one final response (errors, cancellation and overload included).
"""

from __future__ import annotations

import json
import locale
import math
import os
import queue
import threading
import time
from dataclasses import dataclass, field
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
CHILD_MODES = ("sample", "topk")
NO_TREE = ("none", "ar", "0")
CANCEL_CHECK_SECONDS = 0.1  # how often the scheduler asks Triton whether a request's client went away
MAX_WORDS, MAX_WORD_TOKENS = 64, 32  # stop_words / bad_words per row, tokens per word
TAU_BUCKETS = [1, 2, 3, 4, 5, 6, 8, 12, 16]
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
QUEUE_BUCKETS = [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]
STEP_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256]
PERF = (("acceptance_rate", np.float32), ("total_accepted_draft_tokens", np.int32), ("total_draft_tokens", np.int32),
        ("target_passes", np.int32), ("output_tokens", np.int32), ("generation_seconds", np.float32))


class RequestError(ValueError):
    """A bad request: answered with a Triton INVALID_ARG error naming the problem."""


def _truthy(value: str) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def tree_size(expansion: list[int], limit: int) -> int:
    """Nodes of a SpecInfer expansion vector (root included), stopping early once past `limit`."""
    total, width = 1, 1
    for k in expansion:
        width *= k
        total += width
        if total > limit:
            break
    return total


@dataclass
class Group:
    """One Triton request: its rows (one decoder Job each), its response sender and streaming state."""

    sender: object
    rows: list[dict]
    arrived: float
    jobs: list = field(default_factory=list)
    streams: list = field(default_factory=list)  # TextStream per row
    unsent: list[int] = field(default_factory=list)  # tokens per row not yet reported in num_output_tokens
    texts: list[str] = field(default_factory=list)
    perfs: list = field(default_factory=list)
    remaining: int = 0
    first_token: float | None = None
    checked: float = 0.0
    done: bool = False

    @property
    def stream(self) -> bool:
        return any(r["stream"] for r in self.rows)


class TritonPythonModel:
    # ------------------------------------------------------------------------------------------ load
    def initialize(self, args):
        import torch
        from spectrt.runtime.batch import BatchDecoder, Job, budget_from_profile
        from spectrt.runtime.pipeline import Pipeline, TextStream
        from spectrt.runtime.profile import cost_profile_path
        from spectrt.runtime.sampling import SamplingParams

        self.SamplingParams, self.Job, self.TextStream = SamplingParams, Job, TextStream
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("spectrt needs model_transaction_policy { decoupled: true }")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.model_name = args["model_name"]
        self.instance = args.get("model_instance_name", self.model_name)
        self.base = Path(args["model_repository"]).resolve().parent.parent  # <repo parent>: relative paths
        number = lambda key, default, kind=int: kind(params.get(key) or default)  # noqa: E731
        self.max_seq_len = number("max_seq_len", 2048)
        self.max_tree_tokens = number("max_tree_tokens", 64)
        self.max_tokens_limit = number("max_tokens_limit", 1024)
        self.default_max_tokens = min(number("default_max_tokens", 128), self.max_tokens_limit)
        self.chat_default = _truthy(params.get("chat_template", "true"))
        self.max_active = number("max_active", 8)
        self.max_tree_depth = number("max_tree_depth", 16)
        self.max_request_cost = number("max_request_cost", 16384)
        self.max_queue_size = number("max_queue_size", 64)
        self.max_queue_seconds = number("max_queue_seconds", 30.0, float)
        threads = number("threads", 0)
        if threads <= 0:
            count = sum(g.get("count", 1) for g in config.get("instance_group", [])) or 1
            threads = max(1, len(os.sched_getaffinity(0)) // count)
        torch.set_num_threads(threads)

        target, draft, backend, dtype, tree = self._models(params)
        self.default_tree = tree if tree is not None else (params.get("tree") or "auto")  # the tuned policy
        load_start = time.perf_counter()
        # measure_kernels=false: the torch reference path's GEMM formulation is fixed, not timed at load
        self.pipe = Pipeline(target, draft, backend, dtype, self.max_seq_len, self.max_tree_tokens,
                             measure_kernels=_truthy(params.get("measure_kernels", "true")))
        decoder = self.pipe.decoder
        self.has_draft = draft is not None
        self.vocab_size = decoder.target.config.vocab_size
        tokenizer = self.pipe.tokenizer
        # a token covers at most this many bytes of text: a longer prompt cannot fit, refuse it before tokenizing
        longest = max(len(tokenizer.decode([i]).encode("utf-8")) for i in range(len(tokenizer)))
        self.max_prompt_bytes = self.max_seq_len * max(longest, 1)
        tree_spec = str(self.default_tree)
        self.default_tree = self._tree(self.default_tree)  # validates the deployed default
        budget = number("tree_budget", 0)
        artifacts = Path(os.environ.get("SPECTRT_ARTIFACTS", self.base / "artifacts"))
        profile = cost_profile_path(Path(target), dtype, artifacts)  # this target's, in this dtype
        if budget <= 0:  # from the measured cost curve when there is one, else two default trees' worth per slot
            budget = budget_from_profile(profile) or 0
            budget = max(budget, 2 * (len(self.default_tree) if self.default_tree is not None else 1))
        self.batch = BatchDecoder(decoder.target, decoder.draft, decoder.eos_ids, self.max_seq_len,
                                  self.max_tree_tokens, self.max_active, budget, number("prefill_chunk", 0))
        if _truthy(params.get("warmup", "true")):  # first forwards (allocator, scratch growth): now, not in a request
            self.batch.run([Job(self.pipe.encode("Hi"), 4, self.default_tree),
                            Job(self.pipe.encode("Hello"), 4, self.default_tree)])
        self._metrics()
        self.incoming: queue.Queue = queue.Queue()
        self.waiting: list[tuple[Group, int]] = []
        self.queued = 0  # rows accepted by execute() and not yet admitted or dropped
        self.lock = threading.Lock()
        self.active_groups: set[int] = set()
        self.groups: dict[int, Group] = {}
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name="spectrt-scheduler", daemon=True)
        self.thread.start()
        tree_spec = tree_spec if self.default_tree is not None else "none (target alone)"
        pb_utils.Logger.log_info(
            f"spectrt {self.instance}: target {target}, draft {draft}, backend {backend}/{dtype}, tree {tree_spec}, "
            f"max_seq_len {self.max_seq_len}, max_active {self.max_active}, tree budget {budget} tokens/step, "
            f"{threads} thread(s), loaded in {time.perf_counter() - load_start:.1f}s"
        )

    def _path(self, value: str) -> Path:
        path = Path(value).expanduser()
        return path if path.is_absolute() else self.base / path

    def _models(self, params: dict[str, str]):
        """(target, draft or None, backend, dtype, default tree or None) from the model parameters.

        engine_dir (an engines/<name> directory with manifest.json, from `spectrt engines`) wins when set:
        `spectrt.build.engines.engine_models` picks its target/draft models for the backend (the role dirs
        for onnxruntime/tensorrt, the recorded source checkpoints for torch), and the manifest's max_seq_len
        and max_tree_tokens bound this model's. Otherwise target_dir ("" = <base>/artifacts/smollm2-135m-
        instruct, or $SPECTRT_ARTIFACTS/...) and draft_dir ("" = <target>-draft next to it, "none" = the
        target alone). Relative paths are relative to the model repository's parent directory.
        """
        backend, dtype = params.get("backend") or "torch", params.get("dtype") or "fp32"
        engine = params.get("engine_dir", "")
        if engine:
            from spectrt.build.engines import engine_models

            engine = self._path(engine)
            manifest_file = engine / "manifest.json"
            if not manifest_file.is_file():
                raise pb_utils.TritonModelException(
                    f"engine_dir {engine} has no manifest.json: build it with `spectrt engines` (make engines)")
            manifest = json.loads(manifest_file.read_text(encoding="utf-8"))
            self.max_seq_len = min(self.max_seq_len, int(manifest.get("max_seq_len", self.max_seq_len)))
            self.max_tree_tokens = int(manifest.get("max_tree_tokens", self.max_tree_tokens))
            target, draft = engine_models(engine, backend)
            tree = params.get("tree") or manifest.get("tree_defaults", {}).get("tree")
            return target, draft, backend, dtype, tree
        artifacts = Path(os.environ.get("SPECTRT_ARTIFACTS", self.base / "artifacts"))
        target = self._path(params.get("target_dir") or str(artifacts / "smollm2-135m-instruct"))
        draft_value = params.get("draft_dir", "")
        if draft_value.strip().lower() == "none":
            draft = None
        else:
            draft = self._path(draft_value) if draft_value else target.parent / f"{target.name}-draft"
        for name, path in (("target_dir", target), ("draft_dir", draft)):
            if path is not None and not (path / "config.json").is_file():
                raise pb_utils.TritonModelException(
                    f"{name} {path} is not a checkpoint directory (no config.json): set the model parameter "
                    f"{name} in config.pbtxt (or `spectrt serve --target/--draft`), draft_dir 'none' for no draft"
                )
        return target, draft, backend, dtype, None

    def _metrics(self) -> None:
        labels = {"model": self.model_name, "version": "1"}

        self.metric_families = []  # a family must outlive its metrics: keep them all

        def family(name, doc, kind):
            self.metric_families.append(pb_utils.MetricFamily(name=name, description=doc, kind=kind))
            return self.metric_families[-1]

        def counter(name, doc):
            return family(name, doc, pb_utils.MetricFamily.COUNTER).Metric(labels=labels)

        def histogram(name, doc, buckets):
            return family(name, doc, pb_utils.MetricFamily.HISTOGRAM).Metric(labels=labels, buckets=buckets)

        self.m_tokens = counter("spectrt_tokens_generated_total", "Tokens generated (sent to clients)")
        self.m_proposed = counter("spectrt_draft_tokens_proposed_total", "Draft tree tokens proposed for verification")
        self.m_accepted = counter("spectrt_draft_tokens_accepted_total", "Draft tokens accepted by the target")
        self.m_passes = counter("spectrt_target_passes_total", "Target verification passes (per request)")
        self.m_requests = counter("spectrt_requests_total", "Generations completed (one per row of a request)")
        self.m_admitted = counter("spectrt_requests_admitted_total", "Rows that took a decoding slot (prefill began)")
        self.m_overloaded = counter("spectrt_requests_overloaded_total", "Rows refused: queue full or waited too long")
        self.m_steps = counter("spectrt_batch_steps_total", "Batched decoder steps (one target forward each)")
        self.m_active = family("spectrt_active_requests", "Requests holding a decoding slot (active batch size)",
                               pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
        self.m_waiting = family("spectrt_queued_requests", "Rows waiting for a decoding slot",
                                pb_utils.MetricFamily.GAUGE).Metric(labels=labels)
        self.m_tau = histogram("spectrt_tau", "Tokens emitted per target pass (tau; _sum/_count is the mean)",
                               TAU_BUCKETS)
        self.m_ttft = histogram("spectrt_time_to_first_token_seconds", "Request arrival to first text chunk",
                                TTFT_BUCKETS)
        self.m_queue = histogram("spectrt_queue_seconds", "Request arrival to its decoding slot", QUEUE_BUCKETS)
        self.m_step_tokens = histogram("spectrt_step_tokens", "Tokens emitted per batched step", STEP_BUCKETS)
        self.m_step_tree = histogram("spectrt_step_tree_tokens", "Target rows spent on trees per step (roots included)",
                                     STEP_BUCKETS)

    # ------------------------------------------------------------------------------------------ inputs
    def _tree(self, spec):
        from spectrt.runtime.tree import Tree

        if spec is None or isinstance(spec, Tree):
            return spec
        spec = str(spec).strip()
        if spec.lower() == "auto":  # the tuned policy's draft tree, static (the batched decoder verifies static
            policy = self.pipe.policy  # trees; dynamic trees and suffix candidates run in generate/bench)
            if not (self.has_draft and policy.draft and policy.depth > 0):
                return None
            expansion = [policy.width] + [1] * (policy.depth - 1)
            return Tree.from_expansion(expansion[:max(1, min(self.max_tree_depth, policy.budget - 1))])
        if spec.lower() in NO_TREE or not self.has_draft:
            return None
        try:
            expansion = [int(x) for x in spec.replace(" ", "").split(",")]
        except ValueError:
            raise RequestError(f"tree {spec!r} is malformed: give branching per depth as integers, e.g. 2,1") from None
        if any(k < 1 for k in expansion):
            raise RequestError(f"tree {spec!r}: every depth needs at least 1 child")
        if len(expansion) > self.max_tree_depth:
            raise RequestError(f"tree {spec[:40]!r} is {len(expansion)} deep, more than max_tree_depth="
                               f"{self.max_tree_depth}: send a shallower tree")
        if tree_size(expansion, self.max_tree_tokens) > self.max_tree_tokens:
            raise RequestError(f"tree {spec!r} has more than max_tree_tokens={self.max_tree_tokens} nodes")
        return Tree.from_expansion(expansion)

    @staticmethod
    def _column(request, name: str):
        """Input `name` as a list with one entry per batch row (None if the input is absent)."""
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            return None
        array = tensor.as_numpy()
        if array.ndim == 0:
            array = array.reshape(1)
        return [array[i].reshape(-1) for i in range(array.shape[0])]

    def _words(self, values, name: str, string) -> list[list[int]]:
        """stop_words / bad_words of one row: each non-empty string is one word, tokenized without special tokens."""
        words = [string(w, name) for w in values]
        words = [w for w in words if w.strip()]
        if len(words) > MAX_WORDS:
            raise RequestError(f"{name} has {len(words)} words, more than {MAX_WORDS}")
        out = []
        for w in words:
            if len(w.encode("utf-8")) > 16 * MAX_WORD_TOKENS:
                raise RequestError(f"a word of {name} is longer than {MAX_WORD_TOKENS} tokens")
            ids = self.pipe.tokenizer.encode(w, add_special_tokens=False)
            if len(ids) > MAX_WORD_TOKENS:
                raise RequestError(f"a word of {name} is longer than {MAX_WORD_TOKENS} tokens")
            out.append(ids)
        return out

    def _rows(self, request) -> list[dict]:
        texts = self._column(request, "text_input")
        if texts is None:
            raise RequestError("text_input is required (TYPE_STRING, shape [1, 1]: the prompt)")
        rows = []
        cols = {name: self._column(request, name) for name in (
            "max_tokens", "stream", "temperature", "top_k", "top_p", "seed", "random_seed", "end_id", "pad_id",
            "beam_width", "min_length", "bad_words", "stop_words", "exclude_input_in_output", "return_perf_metrics",
            "return_num_input_tokens", "return_num_output_tokens", "tree", "children", "apply_chat_template")}
        for name, col in cols.items():
            if col is not None and len(col) != len(texts):
                raise RequestError(f"{name} has {len(col)} rows but text_input has {len(texts)}")

        def scalar(name, i, default):
            col = cols[name]
            if col is None or col[i].size == 0:
                return default
            if col[i].size != 1:
                raise RequestError(f"{name} must hold one value per row, got {col[i].size}")
            value = col[i][0]
            return value.item() if hasattr(value, "item") else value

        def string(value, name):
            if isinstance(value, bytes):
                try:
                    return value.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise RequestError(f"{name} is not valid UTF-8 ({e.reason} at byte {e.start})") from None
            return str(value)

        for i, text in enumerate(texts):
            if text.size != 1:
                raise RequestError(f"text_input must hold one string per row, got {text.size}")
            raw = text[0]
            if len(raw) > self.max_prompt_bytes:  # before any decoding or tokenizing
                raise RequestError(f"text_input is {len(raw)} bytes: more than the context of max_seq_len="
                                   f"{self.max_seq_len} tokens can hold ({self.max_prompt_bytes} bytes); shorten it")
            prompt = string(raw, "text_input")
            if not prompt.strip():
                raise RequestError("text_input is empty: send the prompt text")
            max_tokens = int(scalar("max_tokens", i, self.default_max_tokens))
            if not 1 <= max_tokens <= self.max_tokens_limit:
                raise RequestError(f"max_tokens must be in [1, {self.max_tokens_limit}] (this model's limit), "
                                   f"got {max_tokens}")
            temperature = float(scalar("temperature", i, 0.0))
            top_p = float(scalar("top_p", i, 1.0))
            top_k = int(scalar("top_k", i, 0))
            for name, value in (("temperature", temperature), ("top_p", top_p)):
                if not math.isfinite(value):
                    raise RequestError(f"{name} must be a finite number, got {value}")
            seed = scalar("seed", i, None)
            seed = scalar("random_seed", i, None) if seed is None else seed
            try:
                params = self.SamplingParams(temperature, top_k, top_p,
                                             None if seed is None else int(seed) % (1 << 62))
            except ValueError as e:
                raise RequestError(str(e)) from None
            end_id = scalar("end_id", i, None)
            if end_id is not None and not 0 <= int(end_id) < self.vocab_size:
                raise RequestError(f"end_id must be a token id in [0, {self.vocab_size}), got {end_id}")
            beam_width = int(scalar("beam_width", i, 1))
            if beam_width not in (0, 1):
                raise RequestError(f"beam_width {beam_width} is not supported: spectrt decodes one beam (send 1)")
            min_length = int(scalar("min_length", i, 0))
            if min_length < 0:
                raise RequestError(f"min_length must be >= 0, got {min_length}")
            words = {name: self._words(cols[name][i] if cols[name] is not None else [], name, string)
                     for name in ("bad_words", "stop_words")}
            children = string(scalar("children", i, "sample"), "children").strip() or "sample"
            if children not in CHILD_MODES:
                raise RequestError(f"children must be one of {CHILD_MODES}, got {children!r}")
            tree = scalar("tree", i, None)
            tree = self.default_tree if tree is None or not string(tree, "tree").strip() else \
                self._tree(string(tree, "tree"))
            cost = (len(tree) if tree is not None else 1) * max_tokens
            if cost > self.max_request_cost:
                raise RequestError(f"tree of {len(tree)} nodes x max_tokens {max_tokens} = {cost} verify rows, more "
                                   f"than max_request_cost={self.max_request_cost}: send a smaller tree or max_tokens")
            chat = bool(scalar("apply_chat_template", i, self.chat_default))
            ids = self.pipe.encode(prompt, chat)  # the only tokenization of this prompt
            if len(ids) >= self.max_seq_len:
                raise RequestError(f"the prompt has {len(ids)} tokens but the context is max_seq_len="
                                   f"{self.max_seq_len} tokens (prompt + output): shorten the prompt")
            rows.append({
                "prompt": prompt, "ids": ids, "max_tokens": max_tokens, "params": params, "tree": tree,
                "children": children, "end_id": None if end_id is None else int(end_id), "min_length": min_length,
                "bad_words": words["bad_words"], "stop_words": words["stop_words"],
                "stream": bool(scalar("stream", i, False)),
                "exclude_input": bool(scalar("exclude_input_in_output", i, True)),
                "perf": bool(scalar("return_perf_metrics", i, False)),
                "n_in": bool(scalar("return_num_input_tokens", i, False)),
                "n_out": bool(scalar("return_num_output_tokens", i, False)),
            })
        return rows

    # ------------------------------------------------------------------------------------------ outputs
    @staticmethod
    def _response(texts: list[str], rows: list[dict], perf: list[dict] | None = None,
                  batch_index: int | None = None, n_out: list[int] | None = None, finish: list[str] | None = None):
        tensors = [pb_utils.Tensor("text_output", np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))]
        if finish is not None:  # the final response of each row: why it ended ("stop", "length")
            tensors.append(pb_utils.Tensor("finish_reason", np.array([[f.encode()] for f in finish], dtype=np.object_)))
        if perf is not None and any(r["perf"] for r in rows):
            for name, dtype in PERF:
                tensors.append(pb_utils.Tensor(name, np.array([[p[name]] for p in perf], dtype=dtype)))
        if any(r["n_in"] for r in rows):
            tensors.append(pb_utils.Tensor("num_input_tokens", np.array([[len(r["ids"])] for r in rows], np.uint32)))
        if n_out is not None and any(r["n_out"] for r in rows):
            tensors.append(pb_utils.Tensor("num_output_tokens", np.array([[n] for n in n_out], np.uint32)))
        if batch_index is not None:
            tensors.append(pb_utils.Tensor("batch_index", np.array([[batch_index]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    @staticmethod
    def _error(sender, message: str, code) -> None:
        try:
            response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))
            sender.send(response, flags=FINAL)
        except Exception as e:  # the client is gone: nothing left to tell it
            pb_utils.Logger.log_warn(f"spectrt: could not send the error response ({e!r}): {message}")

    @staticmethod
    def _close(sender) -> None:
        try:
            sender.send(flags=FINAL)
        except Exception:  # the stream is already gone
            pass

    # ------------------------------------------------------------------------------------------ requests in
    def execute(self, requests):
        """Validate, tokenize and enqueue; the scheduler thread decodes and answers. Returns at once."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                if request.is_cancelled():  # abandoned before we looked at it: no work at all
                    self._close(sender)
                    continue
                rows = self._rows(request)
                with self.lock:
                    if self.queued + len(rows) > self.max_queue_size:
                        self.m_overloaded.increment(len(rows))
                        self._error(sender, f"overloaded: {self.queued} requests are already queued "
                                    f"(max_queue_size={self.max_queue_size}); retry later",
                                    pb_utils.TritonError.UNAVAILABLE)
                        continue
                    self.queued += len(rows)
                self.incoming.put(Group(sender, rows, time.monotonic()))
            except RequestError as e:
                self._error(sender, str(e), pb_utils.TritonError.INVALID_ARG)
            except Exception as e:  # never leave a client without a final response
                pb_utils.Logger.log_error(f"spectrt {self.instance}: request failed: {e!r}")
                self._error(sender, f"spectrt failed: {e}", pb_utils.TritonError.INTERNAL)
        return None

    # ------------------------------------------------------------------------------------------ scheduler
    def _loop(self) -> None:
        while not self.stopping:
            try:
                self._tick()
            except Exception as e:  # a failed step ends the requests in it, never the scheduler
                pb_utils.Logger.log_error(f"spectrt {self.instance}: step failed: {e!r}")
                for group in list(self.groups.values()):
                    if any(job in self.batch.active for job in group.jobs):
                        self._fail(group, f"spectrt failed: {e}", pb_utils.TritonError.INTERNAL)

    def _tick(self) -> None:
        idle = not self.batch.active and not self.waiting
        try:
            group = self.incoming.get(timeout=0.1) if idle else self.incoming.get_nowait()
            while True:
                self._enqueue(group)
                group = self.incoming.get_nowait()
        except queue.Empty:
            pass
        now = time.monotonic()
        self._check(now)
        while self.batch.free and self.waiting:
            group, i = self.waiting.pop(0)
            self._dequeued(1)
            self.batch.add(group.jobs[i])
            self.m_admitted.increment(1)
            self.m_queue.observe(now - group.arrived)
        self.m_active.set(len(self.batch.active))
        self.m_waiting.set(len(self.waiting))
        if not self.batch.active:
            return
        info = self.batch.step()
        self.m_steps.increment(1)
        self.m_step_tokens.observe(info.emitted)
        self.m_step_tree.observe(info.tree_tokens)
        for job in info.finished:
            self._row_done(job)
        self.m_active.set(len(self.batch.active))

    def _enqueue(self, group: Group) -> None:
        from functools import partial

        for i, row in enumerate(group.rows):
            job = self.Job(row["ids"], row["max_tokens"], row["tree"], row["params"], row["children"],
                           None if row["end_id"] is None else {row["end_id"]}, row["min_length"], row["stop_words"],
                           row["bad_words"], on_tokens=partial(self._on_tokens, group, i), tag=(group, i))
            group.jobs.append(job)
            group.streams.append(self.TextStream(self.pipe.tokenizer, partial(self._on_text, group, i)))
            group.unsent.append(0)
            group.texts.append("")
            group.perfs.append(None)
        group.remaining = len(group.rows)
        self.groups[id(group)] = group
        try:
            for job in group.jobs:
                self.batch.check(job)
        except ValueError as e:
            self._dequeued(len(group.rows))
            self.groups.pop(id(group))
            self._error(group.sender, str(e), pb_utils.TritonError.INVALID_ARG)
            return
        self.waiting.extend((group, i) for i in range(len(group.rows)))

    def _dequeued(self, rows: int) -> None:
        with self.lock:
            self.queued -= rows

    def _check(self, now: float) -> None:
        """Drop requests whose client went away (queued or decoding) and queued ones that waited too long."""
        for group in list(self.groups.values()):
            if now - group.checked >= CANCEL_CHECK_SECONDS:
                group.checked = now
                if group.sender.is_cancelled():
                    self._drop(group)
                    self._close(group.sender)
                    continue
            if now - group.arrived > self.max_queue_seconds and any(g is group for g, _ in self.waiting):
                self.m_overloaded.increment(sum(g is group for g, _ in self.waiting))
                self._fail(group, f"overloaded: waited {now - group.arrived:.1f}s for a decoding slot "
                           f"(max_queue_seconds={self.max_queue_seconds:g}); retry later",
                           pb_utils.TritonError.UNAVAILABLE)

    def _drop(self, group: Group) -> None:
        queued = [(g, i) for g, i in self.waiting if g is group]
        if queued:
            self.waiting = [(g, i) for g, i in self.waiting if g is not group]
            self._dequeued(len(queued))
        for job in group.jobs:
            if job in self.batch.active:
                self.batch.cancel(job)
        self.groups.pop(id(group), None)
        group.done = True

    def _fail(self, group: Group, message: str, code) -> None:
        self._drop(group)
        self._error(group.sender, message, code)

    # ------------------------------------------------------------------------------------------ responses out
    def _on_tokens(self, group: Group, i: int, new: list[int]) -> None:
        group.unsent[i] += len(new)
        group.streams[i](new)

    def _on_text(self, group: Group, i: int, delta: str) -> None:
        if group.first_token is None:
            group.first_token = time.monotonic()
            self.m_ttft.observe(group.first_token - group.arrived)
        group.texts[i] += delta
        if group.stream:
            index = i if len(group.rows) > 1 else None
            group.sender.send(self._response([delta], [group.rows[i]], None, index, [group.unsent[i]]))
            group.unsent[i] = 0

    def _row_done(self, job) -> None:
        group, i = job.tag
        if job.finish == "cancelled":  # its stream callback failed: the client is gone
            self._drop(group)
            return
        stream = group.streams[i]
        text = self.pipe.tokenizer.decode(job.out, skip_special_tokens=True)
        if len(text) > stream.sent:  # what the streaming detokenizer held back (as Pipeline.generate does)
            delta, stream.sent = text[stream.sent:], len(text)
            try:
                self._on_text(group, i, delta)
            except Exception:  # this client is gone: end its request only
                self._drop(group)
                return
        stats = job.stats
        accepted = sum(stats.accepted) if job.proposed else 0
        self.m_tokens.increment(len(job.out))
        self.m_proposed.increment(job.proposed)
        self.m_accepted.increment(accepted)
        self.m_passes.increment(stats.target_passes)
        self.m_requests.increment(1)
        for a in stats.accepted:
            self.m_tau.observe(a + 1)
        group.perfs[i] = {"acceptance_rate": accepted / job.proposed if job.proposed else 0.0,
                          "total_accepted_draft_tokens": accepted, "total_draft_tokens": job.proposed,
                          "target_passes": stats.target_passes, "output_tokens": len(job.out),
                          "generation_seconds": time.monotonic() - group.arrived}
        group.remaining -= 1
        row, index = group.rows[i], (i if len(group.rows) > 1 else None)
        try:
            if group.stream:
                flags = FINAL if group.remaining == 0 else 0
                group.sender.send(self._response([""], [row], [group.perfs[i]], index, [group.unsent[i]], [job.finish]),
                                  flags=flags)
            elif group.remaining == 0:
                texts = [t if r["exclude_input"] else r["prompt"] + t
                         for r, t in zip(group.rows, group.texts, strict=True)]
                group.sender.send(self._response(texts, group.rows, group.perfs, None,
                                                 [len(j.out) for j in group.jobs], [j.finish for j in group.jobs]),
                                  flags=FINAL)
        except Exception as e:  # this client is gone: end its request only
            pb_utils.Logger.log_warn(f"spectrt {self.instance}: could not send a response ({e!r})")
            self._drop(group)
            return
        if group.remaining == 0:
            self.groups.pop(id(group), None)
            group.done = True

    def finalize(self):
        self.stopping = True
        self.thread.join(timeout=30)
        for group in list(self.groups.values()):
            self._fail(group, "the model is unloading: retry later", pb_utils.TritonError.UNAVAILABLE)
        while True:
            try:
                group = self.incoming.get_nowait()
            except queue.Empty:
                break
            self._error(group.sender, "the model is unloading: retry later", pb_utils.TritonError.UNAVAILABLE)
        self.batch = self.pipe = None
        for name in [n for n in vars(self) if n.startswith("m_")]:
            setattr(self, name, None)  # metrics first, then their families
        self.metric_families = []
