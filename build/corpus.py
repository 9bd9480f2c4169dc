"""The distillation corpus: the target's own answers to a prompt corpus, with its top-k log-probs, cached.

Sequence-level distillation: the target answers every prompt of `build/prompts/distill.txt` (chat template +
generation prompt, exactly as served), batched with left padding. For every generated token we keep the
target's top-k log-probabilities (computed on the full vocabulary, so the k probabilities are exact and
`1 - sum` is the mass of the rest). These come for free during generation; recomputing target logits during
training would cost a full 30-layer forward plus the 576x49152 head per token, more than the draft's own
forward+backward. Answers are cached per (target weights checksum, generation settings, conversation): a
corpus edit only generates the new conversations, another target never reads them, and the generation
seconds already spent count against a run's data budget, so a second run trains from its first second.

Corpus format (`read_prompts`): one conversation per line; `#` lines and blank lines are ignored;
a plain line is one user message; a line starting with `[` is a JSON list of
`{"role", "content"}` messages (multi-turn or custom system message) ending with a user message.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from spectrt.build.distill import DistillConfig, atomic_save
from spectrt.runtime.resources import package_path

PROMPTS_DIR = package_path("build/prompts")
DISTILL_PROMPTS = PROMPTS_DIR / "distill.txt"
HELDOUT_PROMPTS = PROMPTS_DIR / "heldout.txt"

Conversation = list[dict[str, str]]


def read_prompts(path: Path) -> list[Conversation]:
    """Conversations of a corpus file (format in the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt corpus {path} does not exist: pass a text file with one prompt per line")
    convs: list[Conversation] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            try:
                conv = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: a line starting with '[' must be a JSON list of messages ({e})") from e
            if (
                not isinstance(conv, list)
                or not conv
                or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in conv)
                or conv[-1]["role"] != "user"
            ):
                raise ValueError(
                    f"{path}:{n}: expected a JSON list of {{\"role\", \"content\"}} messages ending with a user message"
                )
            convs.append([{"role": m["role"], "content": m["content"]} for m in conv])
        else:
            convs.append([{"role": "user", "content": line}])
    if not convs:
        raise ValueError(f"prompt corpus {path} is empty: add one prompt per line (see build/prompts/distill.txt)")
    return convs


def conv_key(conv: Conversation) -> str:
    return hashlib.sha1(json.dumps(conv, sort_keys=True).encode()).hexdigest()


def _encode(tokenizer, conv: Conversation, max_tokens: int) -> list[int]:
    text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids[-max_tokens:]


# --------------------------------------------------------------------------------------------------
# Target data


def target_fingerprint(target: Path) -> str:
    """Content hash of a checkpoint's config and weights (0.7 s for 517 MB)."""
    h = hashlib.blake2b(digest_size=16)
    h.update((Path(target) / "config.json").read_bytes())
    for shard in sorted(Path(target).glob("*.safetensors")):
        with open(shard, "rb") as f:
            h.update(hashlib.file_digest(f, "blake2b").digest())
    return h.hexdigest()


def _eos_ids(target: Path, tokenizer) -> list[int]:
    ids: set[int] = set()
    gen = Path(target) / "generation_config.json"
    for source in (json.loads(gen.read_text()) if gen.is_file() else {}, {"eos_token_id": tokenizer.eos_token_id}):
        eos = source.get("eos_token_id")
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(int(e) for e in eos)
    return sorted(ids)


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def _sample_step(logits: torch.Tensor, temperature: float, top_k: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(next tokens, top-k log-probs, their ids) for a batch of fp32 logits: sampled at `temperature`, else argmax."""
    values, indices = logits.log_softmax(-1).topk(top_k, dim=-1)
    if temperature > 0:
        return torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).squeeze(1), values, indices
    return indices[:, 0], values, indices


class _TargetGenerator:
    """The target in `dtype` (body and LM head); batched left-padded generation.

    Log-probs are computed in fp32 from the head's output. Measured against the fp32 target on
    held-out answers (teacher-forced): bf16 body + fp32 head agrees on 98.8% of argmaxes, bf16 body
    + bf16 head on 97.6% (KL between the two heads 3e-4 nats); the bf16 head costs 17 ms instead of
    46-67 ms per batch-32 step, i.e. ~1.35x more training data per second.
    """

    def __init__(self, target: Path, dtype: str):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        if model.get_output_embeddings() is None:
            raise ValueError(f"{target} has no LM head: the draft needs the target's logits")
        self.head = model.get_output_embeddings().weight.detach().to(_dtype(dtype)).contiguous()
        self.body = model.model.to(_dtype(dtype)).eval()
        self.config = model.config

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[list[int]],
        max_new_tokens: int,
        temperature: float,
        eos: Sequence[int],
        pad_id: int,
        top_k: int,
        generator: torch.Generator,
    ) -> list[dict]:
        from transformers import DynamicCache

        batch = len(prompts)
        width = max(len(p) for p in prompts)
        ids = torch.full((batch, width), pad_id, dtype=torch.long)
        mask = torch.zeros((batch, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        hidden = self.body(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                           use_cache=True).last_hidden_state[:, -1]
        next_pos = pos[:, -1] + 1
        rows = torch.arange(batch)  # original index of each live row
        tokens: list[list[int]] = [[] for _ in range(batch)]
        top_ids: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        top_logp: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        eos_t = torch.tensor(list(eos), dtype=torch.long)
        for step in range(max_new_tokens):
            # mm(W, h^T)^T: MKL's faster path for skinny products (DESIGN.md), 46 vs 67 ms in fp32 at batch 32
            logits = torch.mm(self.head, hidden.to(self.head.dtype).T).T.float()
            tok, values, indices = _sample_step(logits, temperature, top_k, generator)
            for j, r in enumerate(rows.tolist()):
                tokens[r].append(int(tok[j]))
                top_ids[r].append(indices[j].to(torch.int32))
                top_logp[r].append(values[j].to(torch.float16))
            live = ~torch.isin(tok, eos_t)
            if step == max_new_tokens - 1 or not live.any():
                break
            if not live.all():
                keep = live.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tok, mask, next_pos = rows[keep], tok[keep], mask[keep], next_pos[keep]
            mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype)], dim=1)
            hidden = self.body(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                               past_key_values=cache, use_cache=True).last_hidden_state[:, -1]
            next_pos = next_pos + 1
        return [
            {
                "input_ids": torch.tensor(list(prompts[i]) + tokens[i], dtype=torch.int32),
                "prompt_len": len(prompts[i]),
                "top_ids": torch.stack(top_ids[i]),
                "top_logp": torch.stack(top_logp[i]),
            }
            for i in range(batch)
        ]


class _NativeGenerator:
    """The target on the native CPU forward (runtime/kernels.py): every live answer of a batch advances in one
    `forward_many` per step, which streams the weights once for all of them with no per-op dispatch, and in
    `dtype` weights with fp32 activations (bf16: half the memory traffic, closer to the fp32 target than a bf16
    body). Same records as `_TargetGenerator`; used whenever the native forward runs here."""

    def __init__(self, target: Path, dtype: str):
        from spectrt.runtime.model import Transformer

        self.model = Transformer.load(target, _dtype(dtype))

    @torch.inference_mode()
    def generate(self, prompts: Sequence[list[int]], max_new_tokens: int, temperature: float, eos: Sequence[int],
                 pad_id: int, top_k: int, generator: torch.Generator) -> list[dict]:
        model, window = self.model, 64
        capacity = max(len(p) for p in prompts) + max_new_tokens + window
        caches = [model.new_cache(capacity, window) for _ in prompts]
        causal = torch.ones(window, window, dtype=torch.bool).tril()
        last = []
        for prompt, cache in zip(prompts, caches, strict=True):  # prefill: compute-bound chunks, one prompt each
            for start in range(0, len(prompt), window):
                chunk = torch.tensor(prompt[start:start + window])
                logits = model.forward(chunk, torch.arange(start, start + len(chunk)),
                                       causal[:len(chunk), :len(chunk)], cache)
                cache.commit(len(chunk))
            last.append(logits[-1])
        logits = torch.stack(last)
        live = list(range(len(prompts)))
        tokens: list[list[int]] = [[] for _ in prompts]
        top_ids: list[list[torch.Tensor]] = [[] for _ in prompts]
        top_logp: list[list[torch.Tensor]] = [[] for _ in prompts]
        eos_set, one = set(eos), torch.ones(1, 1, dtype=torch.bool)
        for step in range(max_new_tokens):
            tok, values, indices = _sample_step(logits, temperature, top_k, generator)
            for j, r in enumerate(live):
                tokens[r].append(int(tok[j]))
                top_ids[r].append(indices[j].to(torch.int32))
                top_logp[r].append(values[j].to(torch.float16))
            keep = [j for j, r in enumerate(live) if tokens[r][-1] not in eos_set]
            if step == max_new_tokens - 1 or not keep:
                break
            live = [live[j] for j in keep]
            segments = [(tok[j:j + 1], torch.tensor([caches[r].length]), one, caches[r])
                        for j, r in zip(keep, live, strict=True)]
            logits = torch.cat(model.forward_many(segments))
            for r in live:
                caches[r].commit(1)
        return [
            {
                "input_ids": torch.tensor(list(prompts[i]) + tokens[i], dtype=torch.int32),
                "prompt_len": len(prompts[i]),
                "top_ids": torch.stack(top_ids[i]),
                "top_logp": torch.stack(top_logp[i]),
            }
            for i in range(len(prompts))
        ]


def generate_distill_data(
    target: Path,
    conversations: Sequence[Conversation],
    cache_dir: Path,
    cfg: DistillConfig,
    eval_set: bool = False,
    deadline: float | None = None,
    progress: bool = True,
    time_budget_s: float | None = None,
) -> tuple[list[dict], dict]:
    """The target's answers (token ids + top-k log-probs) to `conversations`, from cache when possible.

    Each conversation is answered once (round 0, in a seeded random order so that a deadline leaves a
    representative subset); with sampling (temperature > 0), further rounds draw new answers to the
    same prompts, up to `samples_per_prompt`, while time remains. Generation stops starting new
    batches at `deadline` (time.monotonic()) or once this cache's generation seconds, summed over all
    calls, reach `time_budget_s` (so a rerun whose cache already holds its data budget generates nothing);
    what is done is cached (per target weights checksum, generation settings and conversation) and reused
    by later calls. Returns (records, stats).
    """
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    if not conversations:
        raise ValueError("no prompts to generate from: the corpus is empty")
    target, cache_dir = Path(target), Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cfg.generation_key(eval_set)
    fp = hashlib.sha1(json.dumps({"target": target_fingerprint(target), **key}, sort_keys=True).encode()).hexdigest()
    path = cache_dir / f"{'eval' if eval_set else 'distill'}-{fp[:16]}.pt"
    cache: dict[str, dict] = torch.load(path, weights_only=True) if path.is_file() else {}
    spent_path = path.with_suffix(".json")  # generation seconds already spent on this cache
    spent_before = json.loads(spent_path.read_text())["generation_s"] if spent_path.is_file() and cache else 0.0
    unique = dict(zip((conv_key(c) for c in conversations), conversations, strict=True))
    rounds = 1 if eval_set or key["temperature"] == 0 else max(1, cfg.samples_per_prompt)

    def sample_key(k: str, r: int) -> str:
        return k if r == 0 else f"{k}#{r}"

    todo: list[tuple[str, str, int]] = []  # (cache key, conversation key, round)
    for r in range(rounds):
        order = sorted(unique)
        perm = torch.randperm(len(order), generator=torch.Generator().manual_seed(cfg.seed + 7919 * r)).tolist()
        todo += [(sample_key(order[i], r), order[i], r) for i in perm if sample_key(order[i], r) not in cache]
    t0 = time.monotonic()
    generated_tokens, generation_s = 0, 0.0  # generation_s: up to the last batch saved (what the sidecar records)

    def out_of_time() -> bool:  # never before the first answer exists (a run always gets some data)
        if not any(sample_key(k, 0) in cache for k in unique):
            return False
        now = time.monotonic()
        return (deadline is not None and now > deadline) or (
            time_budget_s is not None and spent_before + now - t0 >= time_budget_s)

    if todo and not out_of_time():
        tokenizer = AutoTokenizer.from_pretrained(target)
        eos = _eos_ids(target, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)
        from spectrt.runtime.kernels import native_unavailable

        gen = (_NativeGenerator if native_unavailable() is None else _TargetGenerator)(target, key["dtype"])
        encoded = {k: _encode(tokenizer, unique[k], cfg.max_prompt_tokens) for k in {t[1] for t in todo}}
        bs = cfg.eval_batch_size if eval_set else cfg.gen_batch_size
        # sort by prompt length within groups of 4 batches of one round: little padding, order stays random
        group = 4 * bs
        todo = [t for r in range(rounds) for part in [[t for t in todo if t[2] == r]]
                for g in range(0, len(part), group)
                for t in sorted(part[g:g + group], key=lambda t: len(encoded[t[1]]))]
        bar = tqdm(total=len(todo), desc="target answers" + (" (held-out)" if eval_set else ""),
                   unit="answer", disable=not progress)
        for b, s in enumerate(range(0, len(todo), bs)):
            if out_of_time():
                break
            chunk = todo[s:s + bs]
            torch_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + 10_007 * chunk[0][2] + b)
            recs = gen.generate([encoded[t[1]] for t in chunk], key["max_new_tokens"], key["temperature"], eos,
                                pad, cfg.top_k, torch_gen)
            for (ck, _, _), rec in zip(chunk, recs, strict=True):
                cache[ck] = rec
                generated_tokens += len(rec["top_ids"])
            atomic_save(cache, path)
            generation_s = time.monotonic() - t0
            spent_path.write_text(json.dumps({"generation_s": round(spent_before + generation_s, 3)}))
            bar.update(len(chunk))
            bar.set_postfix(tok_s=f"{generated_tokens / (time.monotonic() - t0):.0f}")
        bar.close()
        del gen
    records = [cache[sample_key(k, r)] for r in range(rounds) for k in unique if sample_key(k, r) in cache]
    stats = {
        "cache": str(path),
        "prompts": len(conversations),
        "prompts_answered": sum(k in cache for k in unique),
        "answers": len(records),
        "tokens": int(sum(len(r["top_ids"]) for r in records)),
        "generated_tokens": generated_tokens,
        "generation_s": round(generation_s, 3),  # ms resolution: the native generator is fast
        "generation_s_total": round(spent_before + generation_s, 3),
        **key,
    }
    if not records:
        raise ValueError("no target answers were generated: raise budget_minutes or data_fraction")
    return records, stats

