"""spectrt as a Triton python-backend model: decoupled, streaming tree speculative decoding.

Each model instance (a separate stub process) owns one `Pipeline`: a target + draft pair whose static KV
caches are allocated once, here at load. Triton hands an instance one request at a time, so a request
has its KV slot to itself; requests in flight = instance count (`instance_group`). The decoder is never
shared between threads.

Request schema (compatible with tensorrtllm_backend's ensemble): `text_input` (required), `max_tokens`,
`stream`, `temperature`, `top_k`, `top_p`, `seed` / `random_seed`, `end_id`, `pad_id`, `beam_width`,
`min_length`, `bad_words`, `stop_words`, `exclude_input_in_output`, `return_perf_metrics`, plus the
spectrt extensions `tree`, `children`, `apply_chat_template`. Streaming sends each accepted chunk's text
delta as soon as the target has verified it, then a final response (flagged final) with an empty
`text_output` and, if asked, the perf metrics. A non-streaming request gets one final response with the
whole text. Every request ends with exactly one final response, errors included, so no client waits forever.
"""

from __future__ import annotations

import json
import locale
import math
import os
import time
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
CANCEL_CHECK_SECONDS = 0.25  # how often a streaming request checks whether its client went away
TAU_BUCKETS = [1, 2, 3, 4, 5, 6, 8, 12, 16]
TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30]


class RequestError(ValueError):
    """A bad request: answered with a Triton INVALID_ARG error naming the problem."""


class Cancelled(Exception):
    """The client went away (stream closed or request cancelled): stop decoding for it."""


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


class TritonPythonModel:
    # ------------------------------------------------------------------------------------------ load
    def initialize(self, args):
        import torch
        from spectrt.runtime.pipeline import Pipeline
        from spectrt.runtime.sampling import SamplingParams

        self.torch, self.SamplingParams = torch, SamplingParams
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("spectrt needs model_transaction_policy { decoupled: true }")
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.model_name = args["model_name"]
        self.instance = args.get("model_instance_name", self.model_name)
        self.base = Path(args["model_repository"]).resolve().parent.parent  # <repo parent>: relative paths
        self.max_seq_len = int(params.get("max_seq_len") or 2048)
        self.max_tree_tokens = int(params.get("max_tree_tokens") or 64)
        self.max_tokens_limit = int(params.get("max_tokens_limit") or 1024)
        self.default_max_tokens = min(int(params.get("default_max_tokens") or 128), self.max_tokens_limit)
        self.chat_default = _truthy(params.get("chat_template", "true"))
        threads = int(params.get("threads") or 0)
        if threads <= 0:
            count = sum(g.get("count", 1) for g in config.get("instance_group", [])) or 1
            threads = max(1, len(os.sched_getaffinity(0)) // count)
        torch.set_num_threads(threads)

        target, draft, backend, dtype, tree = self._models(params)
        self.default_tree = tree if tree is not None else (params.get("tree") or "auto")  # the tuned policy
        load_start = time.perf_counter()
        self.pipe = Pipeline(target, draft, backend, dtype, self.max_seq_len, self.max_tree_tokens)
        self.has_draft = draft is not None
        if not _truthy(params.get("measure_kernels", "true")):  # fixed GEMM formulation: reproducible numerics
            for engine in (self.pipe.decoder.target, self.pipe.decoder.draft):
                if hasattr(getattr(engine, "linear", None), "measure"):
                    engine.linear.measure = False
        self.vocab_size = self.pipe.decoder.target.config.vocab_size
        tree_spec = str(self.default_tree)
        self.default_tree = self._tree(self.default_tree)  # validates the deployed default
        if _truthy(params.get("warmup", "true")):  # kernels are measured on first use: do it now, not in a request
            self.pipe.generate("Hi", 4, self.default_tree)
        self._metrics()
        kernels = getattr(getattr(self.pipe.decoder.target, "linear", None), "choice", {})
        if kernels:
            pb_utils.Logger.log_info(f"spectrt {self.instance}: target GEMM per (weight shape, rows): " + ", ".join(
                f"{k[0]}{'/1' if k[2] else '/n'}={'mm' if v else 'linear'}" for k, v in kernels.items()))
        tree_spec = tree_spec if self.default_tree is not None else "none (target alone)"
        pb_utils.Logger.log_info(
            f"spectrt {self.instance}: target {target}, draft {draft}, backend {backend}/{dtype}, tree {tree_spec}, "
            f"max_seq_len {self.max_seq_len}, {threads} thread(s), loaded in {time.perf_counter() - load_start:.1f}s"
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
        self.m_passes = counter("spectrt_target_passes_total", "Target verification passes")
        self.m_requests = counter("spectrt_requests_total", "Generations completed (one per row of a request)")
        self.m_tau = histogram("spectrt_tau", "Tokens emitted per target pass (tau; _sum/_count is the mean)",
                               TAU_BUCKETS)
        self.m_ttft = histogram("spectrt_time_to_first_token_seconds", "Request start to first text chunk",
                                TTFT_BUCKETS)

    # ------------------------------------------------------------------------------------------ inputs
    def _tree(self, spec):
        from spectrt.runtime.tree import Tree

        if spec is None or isinstance(spec, Tree):
            return spec
        spec = str(spec).strip()
        if spec.lower() == "auto":  # dynamic trees under the pipeline's policy (draft-less: suffix candidates)
            return "auto"
        if spec.lower() in NO_TREE or not self.has_draft:
            return None
        try:
            expansion = [int(x) for x in spec.replace(" ", "").split(",")]
        except ValueError:
            raise RequestError(f"tree {spec!r} is malformed: give branching per depth as integers, e.g. 2,1") from None
        if any(k < 1 for k in expansion):
            raise RequestError(f"tree {spec!r}: every depth needs at least 1 child")
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

    def _rows(self, request) -> list[dict]:
        texts = self._column(request, "text_input")
        if texts is None:
            raise RequestError("text_input is required (TYPE_STRING, shape [1, 1]: the prompt)")
        rows = []
        cols = {name: self._column(request, name) for name in (
            "max_tokens", "stream", "temperature", "top_k", "top_p", "seed", "random_seed", "end_id", "pad_id",
            "beam_width", "min_length", "bad_words", "stop_words", "exclude_input_in_output", "return_perf_metrics",
            "tree", "children", "apply_chat_template")}
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
            prompt = string(text[0], "text_input")
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
            if min_length > 1:
                raise RequestError(f"min_length {min_length} is not supported (generation stops at end_id)")
            for name in ("bad_words", "stop_words"):
                words = cols[name][i] if cols[name] is not None else []
                if any(string(w, name).strip() for w in words):
                    raise RequestError(f"{name} is not supported: send it empty or leave it out")
            children = string(scalar("children", i, "sample"), "children").strip() or "sample"
            if children not in CHILD_MODES:
                raise RequestError(f"children must be one of {CHILD_MODES}, got {children!r}")
            tree = scalar("tree", i, None)
            tree = self.default_tree if tree is None or not string(tree, "tree").strip() else \
                self._tree(string(tree, "tree"))
            chat = bool(scalar("apply_chat_template", i, self.chat_default))
            prompt_tokens = len(self.pipe.encode(prompt, chat))
            if prompt_tokens >= self.max_seq_len:
                raise RequestError(f"the prompt has {prompt_tokens} tokens but the context is max_seq_len="
                                   f"{self.max_seq_len} tokens (prompt + output): shorten the prompt")
            rows.append({
                "prompt": prompt, "max_tokens": max_tokens, "params": params, "tree": tree, "children": children,
                "chat": chat, "end_id": None if end_id is None else int(end_id),
                "stream": bool(scalar("stream", i, False)),
                "exclude_input": bool(scalar("exclude_input_in_output", i, True)),
                "perf": bool(scalar("return_perf_metrics", i, False)),
            })
        return rows

    # ------------------------------------------------------------------------------------------ outputs
    @staticmethod
    def _response(texts: list[str], perf: list[dict] | None = None, batch_index: int | None = None):
        tensors = [pb_utils.Tensor("text_output", np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_))]
        if perf is not None:
            for name, dtype in (("acceptance_rate", np.float32), ("total_accepted_draft_tokens", np.int32),
                                ("total_draft_tokens", np.int32), ("target_passes", np.int32),
                                ("output_tokens", np.int32), ("generation_seconds", np.float32)):
                tensors.append(pb_utils.Tensor(name, np.array([[p[name]] for p in perf], dtype=dtype)))
        if batch_index is not None:
            tensors.append(pb_utils.Tensor("batch_index", np.array([[batch_index]], dtype=np.int32)))
        return pb_utils.InferenceResponse(output_tensors=tensors)

    # ------------------------------------------------------------------------------------------ serving
    def execute(self, requests):
        for request in requests:
            self._serve(request)
        return None

    def _serve(self, request) -> None:
        sender = request.get_response_sender()
        try:
            rows = self._rows(request)
            stream = any(r["stream"] for r in rows)
            batched = len(rows) > 1
            texts, perfs = [], []
            for i, row in enumerate(rows):
                text, perf = self._generate(row, sender, stream, i if batched else None)
                if not row["exclude_input"] and not stream:
                    text = row["prompt"] + text
                texts.append(text)
                perfs.append(perf)
                if stream and i < len(rows) - 1:  # end of one row of a streamed batch: its metrics, not final
                    sender.send(self._response([""], [perf] if row["perf"] else None, i))
            if stream:
                last = rows[-1]
                sender.send(self._response([""], [perfs[-1]] if last["perf"] else None,
                                           len(rows) - 1 if batched else None), flags=FINAL)
            else:
                sender.send(self._response(texts, perfs if any(r["perf"] for r in rows) else None), flags=FINAL)
        except Cancelled:
            try:
                sender.send(flags=FINAL)
            except Exception:  # the stream is already gone
                pass
        except RequestError as e:
            self._error(sender, str(e), pb_utils.TritonError.INVALID_ARG)
        except Exception as e:  # never leave a client without a final response
            pb_utils.Logger.log_error(f"spectrt {self.instance}: request failed: {e!r}")
            self._error(sender, f"spectrt failed: {e}", pb_utils.TritonError.INTERNAL)

    @staticmethod
    def _error(sender, message: str, code) -> None:
        try:
            response = pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))
            sender.send(response, flags=FINAL)
        except Exception as e:  # the client is gone: nothing left to tell it
            pb_utils.Logger.log_warn(f"spectrt: could not send the error response ({e!r}): {message}")

    def _generate(self, row: dict, sender, stream: bool, batch_index: int | None) -> tuple[str, dict]:
        start = time.perf_counter()
        first = []
        sending = [0.0, 0, start]  # seconds spent handing chunks to Triton, chunks, last cancellation check

        def on_text(delta: str) -> None:
            t = time.perf_counter()
            if t - sending[2] > CANCEL_CHECK_SECONDS:  # a round trip to the server: not on every chunk
                sending[2] = t
                if sender.is_cancelled():
                    raise Cancelled()
            if stream:
                sender.send(self._response([delta], None, batch_index))
                sending[0] += time.perf_counter() - t
                sending[1] += 1
            if not first:
                first.append(time.perf_counter() - start)

        decoder = self.pipe.decoder
        eos = decoder.eos_ids
        if row["end_id"] is not None:
            decoder.eos_ids = {row["end_id"]}
        try:
            gen = self.pipe.generate(row["prompt"], row["max_tokens"], row["tree"], chat=row["chat"], on_text=on_text,
                                     params=row["params"], children=row["children"])
        except ValueError as e:  # the decoder's own input checks
            raise RequestError(str(e)) from None
        finally:
            decoder.eos_ids = eos
        stats = gen.stats
        proposed = sum(stats.verified) - len(stats.verified)  # candidates verified beyond each pass's root
        accepted = sum(stats.accepted)
        self.m_tokens.increment(stats.new_tokens)
        self.m_proposed.increment(proposed)
        self.m_accepted.increment(accepted)
        self.m_passes.increment(stats.target_passes)
        self.m_requests.increment(1)
        for a in stats.accepted:
            self.m_tau.observe(a + 1)
        if first:
            self.m_ttft.observe(first[0])
        pb_utils.Logger.log_verbose(
            f"spectrt {self.instance}: {stats.new_tokens} tokens in {time.perf_counter() - start:.3f}s, "
            f"{sending[1]} chunks streamed in {sending[0] * 1000:.1f} ms, tau {stats.tau:.2f}")
        perf = {"acceptance_rate": accepted / proposed if proposed else 0.0, "total_accepted_draft_tokens": accepted,
                "total_draft_tokens": proposed, "target_passes": stats.target_passes,
                "output_tokens": stats.new_tokens, "generation_seconds": time.perf_counter() - start}
        return gen.text, perf

    def finalize(self):
        self.pipe = None
        for name in ("m_tokens", "m_proposed", "m_accepted", "m_passes", "m_requests", "m_tau", "m_ttft"):
            setattr(self, name, None)  # metrics first, then their families
        self.metric_families = []
