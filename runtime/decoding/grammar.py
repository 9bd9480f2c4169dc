"""Structured outputs inside the tree: a request's grammar (JSON schema, any JSON object, regex, EBNF) constrains the
target's distribution at every verified row by that row's own path, so speculation stays exact under constraints.

xgrammar (what vLLM, SGLang and TensorRT-LLM use; CPU, rollback) keeps one `GrammarMatcher` per request holding the
committed output. Each step `tree_masks` gives every node of the step's tree the allowed-token bitmask *after* its
path (row 0: the committed state, the root being the last committed token) with one `traverse_draft_tree` call, which
leaves the matcher unchanged; a node its parent's row forbids gets an all-zero row. The decode loop then

- drops forbidden drafted nodes before verifying (`allowed_nodes`: they could never be accepted; a child sampled from
  the draft's q is verified and rejected instead, which keeps its siblings' residual exact),
- masks each verified row's target logits with its row (`mask_logits`), so acceptance and the bonus token are the
  constrained AR's, token for token under greedy and in distribution under sampling (the draft's proposals are any
  distribution: only the target's is constrained),
- `advance`s the matcher over the emitted tokens.

Measured in ../shared/xgrammar-probe.md (xgrammar 0.2.8, this tokenizer): a tree's masks 20-55 us for 8 nodes, a JSON
schema compiles in ~11 ms (compiled grammars are cached per spec). The tokenizer's control tokens (`<|im_start|>`, ...)
are blanked so no grammar allows them inside a string; its end-of-sequence ids stay the grammar's stop tokens.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("json_object", "json_schema", "regex", "grammar")
MAX_SPEC_BYTES = 64 * 1024


class GrammarError(ValueError):
    """A structured-output spec that cannot be served; the message names the problem and the fix."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` in KINDS, `source` the schema (JSON text), regex or EBNF."""

    kind: str
    source: str = ""

    def as_json(self) -> str:
        return json.dumps({"type": self.kind, "value": self.source})


def parse_spec(text: str) -> GrammarSpec:
    """The request schema's `structured_output` field: {"type": "json_object"} | {"type": "json_schema", "schema": {..}}
    | {"type": "regex", "pattern": ".."} | {"type": "grammar", "ebnf": ".."} (`value` also names the source)."""
    if len(text.encode()) > MAX_SPEC_BYTES:
        raise GrammarError(f"structured_output is {len(text.encode())} bytes, more than {MAX_SPEC_BYTES}")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"structured_output is not JSON ({e}): send e.g. {{\"type\": \"json_object\"}}") from None
    if not isinstance(obj, dict) or obj.get("type") not in KINDS:
        raise GrammarError(f"structured_output needs a type among {', '.join(KINDS)}, got "
                           f"{obj.get('type') if isinstance(obj, dict) else obj!r}")
    kind = obj["type"]
    key = {"json_schema": "schema", "regex": "pattern", "grammar": "ebnf"}.get(kind)
    source = obj.get("value", obj.get(key)) if key else None
    if key and source is None:
        raise GrammarError(f"structured_output of type {kind} needs its {key!r}")
    if kind == "json_schema":
        if isinstance(source, str):
            try:
                source = json.loads(source)
            except json.JSONDecodeError as e:
                raise GrammarError(f"structured_output schema is not JSON ({e})") from None
        if not isinstance(source, dict):
            raise GrammarError("structured_output schema must be a JSON Schema object")
        source = json.dumps(source)  # key order kept: the output follows the properties in their order
    elif key and not isinstance(source, str):
        raise GrammarError(f"structured_output {key} must be a string")
    return GrammarSpec(kind, source or "")


class GrammarCompiler:
    """One tokenizer's grammar compiler: specs -> matchers, compiled grammars cached (a schema compiles once)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: Sequence[int]):
        try:
            import xgrammar as xgr
        except ImportError as e:  # a wheel install: `make setup` installs it (--no-deps: it would pull a CUDA torch)
            raise GrammarError(f"structured outputs need xgrammar ({e}): pip install --no-deps xgrammar==0.2.8 "
                               "apache-tvm-ffi==0.1.15.post2") from None

        self.xgr, self.vocab_size = xgr, vocab_size
        encoded = [""] * vocab_size
        for piece, i in tokenizer.get_vocab().items():
            if i < vocab_size:
                encoded[i] = piece
        special = set(getattr(tokenizer, "all_special_ids", ())) | {
            i for i, tok in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(tok, "special", True)}
        stops = sorted(stop_ids)
        encoded = ["" if i in special and i not in stops else s for i, s in enumerate(encoded)]
        base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        info = xgr.TokenizerInfo(encoded, base.vocab_type, vocab_size=vocab_size, stop_token_ids=stops,
                                 add_prefix_space=base.add_prefix_space)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1)
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        self.cache: dict[GrammarSpec, object] = {}
        self.lock = threading.Lock()  # the validator (serving threads) compiles; one compile at a time

    def compile(self, spec: GrammarSpec):
        with self.lock:
            compiled = self.cache.get(spec)
            if compiled is None:
                try:
                    if spec.kind == "json_object":
                        compiled = self.compiler.compile_builtin_json_grammar()
                    elif spec.kind == "json_schema":
                        compiled = self.compiler.compile_json_schema(spec.source, any_whitespace=False,
                                                                     strict_mode=True)
                    elif spec.kind == "regex":
                        compiled = self.compiler.compile_regex(spec.source)
                    else:
                        compiled = self.compiler.compile_grammar(spec.source)
                except Exception as e:  # xgrammar raises RuntimeError / ValueError with its parser's message
                    raise GrammarError(f"structured_output {spec.kind} cannot be compiled: {e}") from None
                if len(self.cache) >= 256:
                    self.cache.pop(next(iter(self.cache)))
                self.cache[spec] = compiled
        return compiled

    def state(self, spec: GrammarSpec | str) -> GrammarState:
        """A fresh matcher for one request (`spec` or the request field's JSON text)."""
        spec = parse_spec(spec) if isinstance(spec, str) else spec
        return GrammarState(self.xgr.GrammarMatcher(self.compile(spec)), self.vocab_size, spec, self.encode)


class GrammarState:
    """One request's matcher over its committed output (see the module doc)."""

    def __init__(self, matcher, vocab_size: int, spec: GrammarSpec, encode=None):
        self.matcher, self.vocab_size, self.spec, self.encode = matcher, vocab_size, spec, encode
        self.words = -(-vocab_size // 32)
        self.pruned = 0  # drafted nodes dropped before verification because the grammar forbids them
        self.forced = 0  # nodes added because the grammar forces their text (jump-forward candidates)

    def tree_masks(self, parents: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """[n, words] int32: row i allows the tokens that may follow node i's path (parents[0] is the root's -1)."""
        n = len(tokens)
        first_child = np.full(n, -1, dtype=np.int64)
        next_sibling = np.full(n, -1, dtype=np.int64)
        for i in range(n - 1, 0, -1):  # children in index order: a node's first child is its smallest
            p = parents[i]
            next_sibling[i] = first_child[p]
            first_child[p] = i
        masks = np.zeros((n, self.words), dtype=np.int32)  # rows under a forbidden node are not written: zeroed
        if self.matcher.is_terminated():
            return masks
        self.matcher.traverse_draft_tree(first_child, next_sibling, np.asarray(tokens, dtype=np.int64), masks,
                                         time_threshold=-1.0)
        return masks

    def jump_tokens(self, path: Sequence[int]) -> list[int]:
        """The tokens of the text the grammar forces after `path` (tokens past the committed output), as the
        tokenizer writes that text alone (`{"name": "` after an opening brace: one text, many tokenizations, so no
        single token is forced); [] where nothing is. The matcher is replayed along the path and rolled back."""
        matcher, accepted = self.matcher, 0
        if self.encode is None or matcher.is_terminated():
            return []
        try:
            for token in path:
                if not matcher.accept_token(int(token)) or matcher.is_terminated():
                    return []
                accepted += 1
            text = matcher.find_jump_forward_string()
        finally:
            if accepted:  # a refused token left the history as it was: undo only the accepted ones
                matcher.rollback(accepted)
        return self.encode(text) if text else []

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit emitted tokens (each one the constrained distribution allowed)."""
        for token in tokens:
            if self.matcher.is_terminated():
                return
            if not self.matcher.accept_token(int(token)):
                raise RuntimeError(f"the grammar refused emitted token {token}: constrained decoding went wrong")


def allowed(masks: np.ndarray, row: int, token: int) -> bool:
    return bool((int(masks[row, token >> 5]) >> (token & 31)) & 1)


def forced_token(row: np.ndarray) -> int | None:
    """The one token a mask row allows, None if it allows several or none."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    hits = np.flatnonzero(bits)
    return int(hits[0]) if len(hits) == 1 else None


def allowed_nodes(masks: np.ndarray, parents: Sequence[int], tokens: Sequence[int],
                  sampled: Sequence[bool] | None = None) -> list[int]:
    """Indices of the nodes to verify, in order: the root, and every node whose whole path the grammar allows. A
    `sampled` node (drawn from the draft's q, verified by the q-ratio rule) stays, forbidden or not, and so does its
    subtree: dropping it would change the residual its verified siblings are accepted against (a rejection subtracts
    its q), so it is verified and rejected instead (its target probability is 0). A point candidate (deterministic:
    the draft's top-k, a suffix match) may go: rejecting it leaves the residual unchanged."""
    keep, kept, ok = [0], [True] * len(tokens), [True] * len(tokens)
    for i in range(1, len(tokens)):
        p = parents[i]
        ok[i] = ok[p] and allowed(masks, p, tokens[i])
        kept[i] = kept[p] and (ok[i] or bool(sampled is not None and sampled[i]))
        if kept[i]:
            keep.append(i)
    return keep


def banned_rows(masks: np.ndarray, best: Sequence[int]) -> bool:
    """Whether any row's unconstrained argmax `best[i]` is forbidden there (else greedy needs no masking)."""
    return any(not allowed(masks, i, int(b)) for i, b in enumerate(best))


def mask_logits(logits: torch.Tensor, masks: np.ndarray) -> torch.Tensor:
    """`logits` [n, V] with every token a row's mask forbids at -inf, in place (a row allowing nothing, under a
    terminated grammar, is left as it is: the request ends at its end-of-sequence token)."""
    bits = np.unpackbits(masks.view(np.uint8), axis=-1, bitorder="little")[:, :logits.shape[1]].astype(bool)
    banned = ~bits & bits.any(axis=1)[:, None]
    if logits.dtype == torch.float32:
        np.copyto(logits.numpy(), -np.inf, where=banned)
        return logits
    return logits.masked_fill_(torch.from_numpy(banned), -torch.inf)
