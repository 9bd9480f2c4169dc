"""Text in, text out: tokenizer + chat template + the decode loop (`Decoder`) over a target/draft pair.

The CLI, the benchmark and the Triton model all go through `Pipeline`, so they share one
loading path, one set of input checks and one streaming detokenizer.
"""

from __future__ import annotations

import gc
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spectrt.runtime.decoding.decoder import GREEDY, Decoder, DecodeStats
from spectrt.runtime.decoding.grammar import GrammarSpec, GrammarState
from spectrt.runtime.decoding.penalties import Penalties
from spectrt.runtime.decoding.policy import Policy, load_policy, policy_path
from spectrt.runtime.decoding.sampling import SamplingParams
from spectrt.runtime.decoding.text import TextStream
from spectrt.runtime.decoding.tree import AUTO, Tree, parse_tree_arg
from spectrt.runtime.engines.checkpoint import DEFAULT_ARTIFACTS, eos_ids
from spectrt.runtime.engines.eagle3 import Eagle3Head, is_eagle3
from spectrt.runtime.engines.engine import DTYPES, check_draft_matches, draft_dtype, load_engine, resolve_dtype
from transformers import AutoTokenizer

BORROW_ORDER = ("bf16", "bf16dot", "fp32")  # whose tuned policy a precision without one borrows, first found first


def default_policy(target: Path, draft: Path | None, dtype: str, artifacts: Path = DEFAULT_ARTIFACTS) -> Policy:
    """The policy `spectrt tune` saved for this target/draft/dtype (in `artifacts`, else next to the target:
    a served model's working directory is not the user's); else one tuned for another precision of the same models
    on this machine (`BORROW_ORDER`), with a warning naming the command that tunes this one; else the untuned default
    (draft-less speculation with suffix candidates when there is no draft).

    Why borrow: `make demo` tunes the default precision only, and the untuned default's cost curve (another
    machine's) priced trees too cheap on AVX2, so `--dtype fp32` lost to its own AR on a prompt (0.76x). A policy
    tuned here carries this machine's measured curve and draft acceptance; bf16's is the conservative one to lend:
    its one-row forward is the cheaper (half the weight bytes), so each tree row costs more against it than in fp32.
    """
    names = Path(target).name, Path(draft).name if draft else None
    wheres = (Path(artifacts), Path(target).parent)
    for where in wheres:
        tuned = load_policy(policy_path(where, *names, dtype))
        if tuned is not None:
            return tuned
    for other in (d for d in BORROW_ORDER if d != dtype):
        for where in wheres:
            tuned = load_policy(policy_path(where, *names, other))
            if tuned is not None:
                warnings.warn(f"no speculation policy tuned for {dtype} here: using the one tuned for {other} "
                              f"({policy_path(where, *names, other)}); `spectrt tune --dtype {dtype}` tunes one",
                              stacklevel=2)
                return tuned
    return Policy() if draft is not None else Policy(budget=16, depth=0, draft=False)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: DecodeStats

    def as_dict(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "finish_reason": self.finish_reason,
                "stats": self.stats.as_dict()}


def trained_context(target: Path) -> int | None:
    """The target's trained context (config.json `max_position_embeddings`, which a RoPE scaling such as Llama 3's
    or YaRN already extends), or None where its config does not say."""
    config = Path(target) / "config.json"
    if not config.is_file():
        return None
    limit = json.loads(config.read_text(encoding="utf-8")).get("max_position_embeddings")
    return limit if isinstance(limit, int) and limit > 0 else None


def check_context(target: Path, max_seq_len: int) -> None:
    """Refuse a context past the target's trained one: RoPE past it degrades silently, with no error to say why."""
    limit = trained_context(target)
    if limit is not None and limit < max_seq_len:
        raise ValueError(f"--max-seq-len {max_seq_len} exceeds {target.name}'s trained context of {limit} tokens "
                         f"(max_position_embeddings in its config.json): use --max-seq-len {limit} or less, or a "
                         "checkpoint whose RoPE scaling extends its context")


class Pipeline:
    def __init__(self, target: Path, draft: Path | None = None, backend: str = "torch", dtype: str = "auto",
                 max_seq_len: int = 2048, max_tree_tokens: int = 64, policy: Policy | None = None,
                 artifacts: Path = DEFAULT_ARTIFACTS, measure_kernels: bool = True, max_active: int = 1,
                 tree_budget: int | None = None, prefill_budget: int | None = None, prefix_cache: bool = True):
        target = Path(target)
        check_context(target, max_seq_len)
        self.dtype = dtype = resolve_dtype(dtype, backend, target)
        self.policy = policy or default_policy(target, draft, dtype, artifacts)
        head = draft is not None and is_eagle3(Path(draft))  # an EAGLE-3 feature head (SpecForge's layout)
        if draft is not None and not head:
            check_draft_matches(target, Path(draft))
        self.tokenizer = AutoTokenizer.from_pretrained(target)
        self.eos = eos = eos_ids(target, self.tokenizer)
        self._grammars = None
        target_engine = load_engine(target, backend, dtype, measure_kernels)
        if head and backend == "torch":  # it reads the target's features and embedding: loaded for this target
            draft_engine = Eagle3Head.load(Path(draft), target_engine, DTYPES[draft_dtype(backend, dtype)])
        elif head:  # the head's own graph beside a target graph that returns the features it reads
            from spectrt.runtime.engines.graph_head import GraphHead
            from spectrt.runtime.engines.onnx_engine import check_features

            draft_engine = GraphHead.load(Path(draft), target_engine.config, backend=backend)
            check_features(target_engine.graph_features, draft_engine.feature_layers, target)
        else:
            draft_engine = None if draft is None else load_engine(Path(draft), backend, draft_dtype(backend, dtype),
                                                                  measure_kernels)
        self.decoder = Decoder(
            target_engine,
            draft_engine,
            eos_ids=eos,
            max_seq_len=max_seq_len,
            max_tree_tokens=max_tree_tokens,
            max_active=max_active,
            policy=self.policy,
            tree_budget=tree_budget,
            prefill_budget=prefill_budget,
            prefix_cache=prefix_cache,
        )
        # What is loaded now is long-lived: out of the collector's reach (vLLM freezes after start-up too). Why: a full
        # collection otherwise walks the tokenizer's and the engines' objects, a ~200 ms pause inside some step:
        # `spectrt profile`'s batch-8 loop (bf16, 64 tokens, interleaved runs) spent 5.2-5.9 ms of host work a step
        # without, 2.3-2.5 with; batch 1 unchanged. A dropped Pipeline is still freed: it holds no reference cycle
        # (tested), and frozen objects are only exempt from cycle collection, not from reference counting.
        gc.collect()
        gc.freeze()

    def grammar(self, spec: str | GrammarSpec) -> GrammarState:
        """A fresh grammar state for one request's structured output (`structured_output` JSON text or a spec);
        the compiler is made on first use (the tokenizer's vocabulary, ~0.3 s) and caches compiled grammars."""
        if self._grammars is None:
            from spectrt.runtime.decoding.grammar import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.decoder.vocab_size, sorted(self.eos))
        return self._grammars.state(spec)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if not prompt or not prompt.strip():
            raise ValueError("the prompt is empty: pass some text with --prompt")
        if chat and self.tokenizer.chat_template:
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
            )
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return self.tokenizer.encode(prompt)

    def generate(self, prompt: str, max_new_tokens: int = 128, tree: Tree | Policy | str | None = AUTO,
                 chat: bool = True, on_text: Callable[[str], None] | None = None,
                 params: SamplingParams = GREEDY, children: str = "sample",
                 structured_output: str | GrammarSpec | GrammarState | None = None,
                 penalties: Penalties | None = None
                 ) -> Generation:
        """Generate; `tree`: "auto" (the pipeline's policy), a Policy, a static Tree or expansion string
        ("2,1"), or None to run the target alone (the autoregressive baseline); `structured_output`: what the output
        follows (runtime/decoding/grammar.py `parse_spec`'s JSON, e.g. '{"type": "json_object"}', or a fresh state from
        `grammar`, whose counters the caller reads after), exactly under speculation."""
        policy = None
        if isinstance(tree, str):
            tree = parse_tree_arg(tree)
        if tree == AUTO:
            tree, policy = None, self.policy
        elif isinstance(tree, Policy):
            tree, policy = None, tree
        stream = TextStream(self.tokenizer) if on_text is not None else None

        def on_tokens(ids: list[int]) -> None:
            delta = stream.push(ids)
            if delta:
                on_text(delta)

        result = self.decoder.generate(self.encode(prompt, chat), max_new_tokens, tree,
                                       on_tokens=on_tokens if stream is not None else None, params=params,
                                       children=children, policy=policy,
                                       grammar=structured_output if isinstance(structured_output, GrammarState)
                                       else None if structured_output is None else self.grammar(structured_output),
                                       penalties=penalties)
        if stream is not None and (rest := stream.finish()):
            on_text(rest)
        text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return Generation(text, result.token_ids, result.finish_reason, result.stats)
