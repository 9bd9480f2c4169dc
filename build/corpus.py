"""The distillation corpus: the target's own answers to a prompt corpus, and the records a draft trains on.

Sequence-level distillation: the target answers every prompt of `build/prompts/distill.txt` (chat template +
generation prompt, exactly as served), with sampling several answers per prompt. Answers come, in this order, from
1. **shipped answers** (`build/answers/`, package data): the embedded target's answers as token ids (uint16, lzma),
   made once by `ship_answers` (`python -m spectrt.cli.ship answers`), with the generator settings and a sha256 of the
   tokens, keyed by the target's weights checksum: a fresh machine spends its draft budget training, and another
   target, or other settings, never reads them;
2. the corpus cache (per target checksum and settings, in the draft's work dir): answers generated earlier;
3. generation through the decode loop (build/generation.py: plain batched decoding, as served), within a budget.
Every sampled answer has its own seed, from (seed, conversation, round): an answer does not depend on the batch it
was generated in (the native forward is row invariant), so any answer can be regenerated alone, which is how the
shipped file is tested.

Teacher forcing (`teacher_force`) turns answers into training records: one batched target forward over prompt +
answer gives, per answer token, the target's top-k log-probabilities (on the full vocabulary, so the k probabilities
are exact and `1 - sum` is the rest's mass) and, for an EAGLE-3 head, the target's low/mid/high features at every
position. Rows of many answers share each forward (compute-bound: measured ~1 ms per token on 2 cores), several
times cheaper per token than generating the answer.

Corpus format (`read_prompts`): one conversation per line; `#` lines and blank lines are ignored;
a plain line is one user message; a line starting with `[` is a JSON list of
`{"role", "content"}` messages (multi-turn or custom system message) ending with a user message.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from spectrt.build.distill import GREEDY_ANSWERS, DistillConfig, atomic_save, bf16_pays
from spectrt.runtime.engines.checkpoint import eos_ids
from spectrt.runtime.engines.engine import resolve_dtype
from spectrt.runtime.resources import package_path

PROMPTS_DIR = package_path("build/prompts")
DISTILL_PROMPTS = PROMPTS_DIR / "distill.txt"
HELDOUT_PROMPTS = PROMPTS_DIR / "heldout.txt"
# the target's own user turns (build/synth.py), one file per seed, each deduplicated against the held-out prompts and
# the files of the seeds before it
SYNTH_SEEDS = (0, 1)
STEERED_SEEDS = (2, 3, 4, 5, 6, 7, 8, 9, 10)  # steered by written openers: the greedy answers' files (make ship-draft)
def synth_prompts_path(seed: int) -> Path:
    """The file of the prompts the target synthesized with `seed` (`python -m spectrt.cli.ship prompts`)."""
    return PROMPTS_DIR / f"synth-seed{seed}.txt"


SYNTH_PROMPTS = tuple(synth_prompts_path(seed) for seed in SYNTH_SEEDS)
TRAIN_PROMPTS = (DISTILL_PROMPTS, *SYNTH_PROMPTS)  # the written prompts, then the target's own
ANSWERS_DIR = package_path("build/answers")
SHIPPED_FORMAT = 1

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
    """A conversation's prompt ids as the runtime makes them (`Pipeline.encode`): the chat template where the target
    has one, else the turns' text as plain text (a base model)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer.encode("\n".join(turn["content"] for turn in conv))
    return ids[-max_tokens:]


# --------------------------------------------------------------------------------------------------
# Target answers


# config.json keys that say who wrote the file, not what the model is: transformers 5.25 converts the embedded GGUF
# to byte-identical weights but stamps its own version, which must not orphan the shipped answers and draft
CONFIG_PROVENANCE = ("transformers_version",)


def target_fingerprint(target: Path) -> str:
    """Content hash of a checkpoint's config (less its provenance stamp) and weights (0.7 s for 517 MB)."""
    h = hashlib.blake2b(digest_size=16)
    config = json.loads((Path(target) / "config.json").read_text(encoding="utf-8"))
    h.update(json.dumps({k: v for k, v in config.items() if k not in CONFIG_PROVENANCE}, sort_keys=True).encode())
    for shard in sorted(Path(target).glob("*.safetensors")):
        with open(shard, "rb") as f:
            h.update(hashlib.file_digest(f, "blake2b").digest())
    return h.hexdigest()


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


ENGINE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def answer_seed(seed: int, key: str, sample: int) -> int:
    """The sampling seed of one answer: (seed, conversation key, round) alone decide it."""
    return int(hashlib.sha256(f"{seed}:{key}:{sample}".encode()).hexdigest()[:15], 16)


def _record(prompt: Sequence[int], answer: Sequence[int]) -> dict:
    return {"input_ids": torch.tensor(list(prompt) + list(answer), dtype=torch.int32), "prompt_len": len(prompt)}


def _sample_key(key: str, sample: int) -> str:
    return key if sample == 0 else f"{key}#{sample}"


def _answers_key(target: Path, cfg: DistillConfig, eval_set: bool) -> tuple[str, dict]:
    """(target weights checksum, generation settings): what decides an answer besides its conversation."""
    return target_fingerprint(target), cfg.generation_key(eval_set)


def generate_distill_data(
    target: Path,
    conversations: Sequence[Conversation],
    cache_dir: Path,
    cfg: DistillConfig,
    eval_set: bool = False,
    deadline: float | None = None,
    progress: bool = True,
    time_budget_s: float | None = None,
    shipped: bool = True,
) -> tuple[list[dict], dict]:
    """The target's answers (records: `input_ids` = prompt + answer, int32; `prompt_len`) to `conversations`.

    Each conversation is answered once (round 0, in a seeded random order so that a deadline leaves a
    representative subset); with sampling (temperature > 0), further rounds draw new answers to the
    same prompts, up to `samples_per_prompt`. Answers shipped for this target and settings (`shipped`) and
    cached ones are used first; the rest are generated, starting no new answer after `deadline`
    (time.monotonic()) or once the generation seconds spent on these conversations, summed over all calls, reach
    `time_budget_s` (so a rerun whose cache already holds its data budget generates nothing). Generated answers are
    cached (per target weights checksum, generation settings and conversation). Returns (records, stats).
    """
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer

    if not conversations:
        raise ValueError("no prompts to generate from: the corpus is empty")
    target, cache_dir = Path(target), Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    fingerprint, key = _answers_key(target, cfg, eval_set)
    fp = hashlib.sha1(json.dumps({"target": fingerprint, **key}, sort_keys=True).encode()).hexdigest()
    path = cache_dir / f"{'eval' if eval_set else 'distill'}-{fp[:16]}.pt"
    cache: dict[str, dict] = torch.load(path, weights_only=True) if path.is_file() else {}
    from_ship = load_shipped(fingerprint, key) if shipped else {}
    spent_path = path.with_suffix(".json")  # generation seconds already spent on this cache
    spent_total = json.loads(spent_path.read_text())["generation_s"] if spent_path.is_file() and cache else 0.0
    unique = dict(zip((conv_key(c) for c in conversations), conversations, strict=True))
    rounds = 1 if eval_set or key["temperature"] == 0 else max(1, cfg.samples_per_prompt)
    known = {**cache, **from_ship}
    # the seconds spent on these conversations' answers (the cache's total, shared by answer count): a rerun whose
    # answers are cached generates nothing, and a new prompt file keeps its own budget (charged the whole cache's
    # seconds, a user's prompts after a default run got one batch of answers)
    mine = {_sample_key(k, r) for r in range(rounds) for k in unique}
    spent_before = spent_total * sum(k in mine for k in cache) / len(cache) if cache else 0.0

    todo: list[tuple[str, str, int]] = []  # (cache key, conversation key, round)
    for r in range(rounds):
        order = sorted(unique)
        perm = torch.randperm(len(order), generator=torch.Generator().manual_seed(cfg.seed + 7919 * r)).tolist()
        todo += [(_sample_key(order[i], r), order[i], r) for i in perm if _sample_key(order[i], r) not in known]
    t0 = time.monotonic()
    generated_tokens, generation_s = 0, 0.0  # generation_s: up to the last batch saved (what the sidecar records)

    def out_of_time() -> bool:  # never before the first answer exists (a run always gets some data)
        if not any(_sample_key(k, 0) in known for k in unique):
            return False
        now = time.monotonic()
        return (deadline is not None and now > deadline) or (
            time_budget_s is not None and spent_before + now - t0 >= time_budget_s)

    if todo and not out_of_time():
        from spectrt.build.generation import Request, generate
        from spectrt.runtime.decoding.sampling import SamplingParams
        from spectrt.runtime.engines.engine import load_engine

        _steady_heap()  # without it the process grew ~4 MB an answer (6,000 greedy answers: past 24 GB)
        tokenizer = AutoTokenizer.from_pretrained(target)
        eos = sorted(eos_ids(target, tokenizer))
        engine = load_engine(target, "torch", ENGINE_DTYPES[key["dtype"]], measure_kernels=False)
        encoded = {k: _encode(tokenizer, unique[k], cfg.max_prompt_tokens) for k in {t[1] for t in todo}}
        requests = [Request(encoded[conv], SamplingParams(key["temperature"], seed=answer_seed(cfg.seed, conv, r))
                            if key["temperature"] > 0 else SamplingParams(), key["max_new_tokens"], tag=ck)
                    for ck, conv, r in todo]
        bar = tqdm(total=len(todo), desc="target answers" + (" (held-out)" if eval_set else ""),
                   unit="answer", disable=not progress)
        saved = time.monotonic()

        def save() -> None:
            nonlocal generation_s, saved
            atomic_save(cache, path)
            generation_s, saved = time.monotonic() - t0, time.monotonic()
            spent_path.write_text(json.dumps({"generation_s": round(spent_total + generation_s, 3)}))

        batch = cfg.eval_batch_size if eval_set else cfg.gen_batch_size
        for request, ids, finish, end in generate(engine, requests, set(eos), batch,
                                                  admit=lambda: not out_of_time()):
            # the end-of-sequence token is part of the answer (the draft learns where answers end): the one that
            # ended it, of several (a GGUF's end-of-generation ids, Llama 3's generation_config)
            ended = [end] if finish == "stop" and end is not None else []
            cache[request.tag] = known[request.tag] = _record(request.prompt_ids, ids + ended)
            generated_tokens += len(ids) + len(ended)
            bar.update(1)
            bar.set_postfix(tok_s=f"{generated_tokens / (time.monotonic() - t0):.0f}")
            if time.monotonic() - saved > 30:
                save()
        save()
        bar.close()
    keys = [_sample_key(k, r) for r in range(rounds) for k in unique if _sample_key(k, r) in known]
    records = [known[k] for k in keys]
    stats = {
        "cache": str(path),
        "prompts": len(conversations),
        "prompts_answered": sum(k in known for k in unique),
        "answers": len(records),
        "shipped_answers": sum(k in from_ship for k in keys),
        "tokens": int(sum(len(r["input_ids"]) - r["prompt_len"] for r in records)),
        "generated_tokens": generated_tokens,
        "generation_s": round(generation_s, 3),  # ms resolution: the native generator is fast
        "generation_s_total": round(spent_total + generation_s, 3),  # this cache's, every prompt set
        **key,
    }
    if not records:
        raise ValueError("no target answers were generated: raise budget_minutes or data_fraction")
    return records, stats


# --------------------------------------------------------------------------------------------------
# Shipped answers (package data)


def _tokens_sha256(table: list, payload: bytes) -> str:
    return hashlib.sha256(json.dumps(table).encode() + payload).hexdigest()


def write_shipped(path: Path, target: Path, sets: dict[str, tuple[dict, dict[str, dict]]]) -> Path:
    """Write `path`.json + `path`.tokens.xz: per set name, (generation settings, {cache key: record}).

    The tokens (prompt + answer of every record, in the table's order) are stored as uint16 (uint32 for
    vocabularies above 65536), lzma-compressed; the table holds each record's key, prompt length and length, and
    a sha256 over table and raw tokens guards the pair."""
    path = Path(path)
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    dtype = np.uint16 if vocab <= 2**16 else np.uint32
    meta = {"format": SHIPPED_FORMAT, "target": target_fingerprint(target), "target_name": Path(target).name,
            "generator": "python -m spectrt.cli.ship answers (build/corpus.py)", "dtype": np.dtype(dtype).name,
            "sets": {}}
    chunks = []
    for name, (key, records) in sets.items():
        table = [[k, int(r["prompt_len"]), len(r["input_ids"])] for k, r in sorted(records.items())]
        payload = np.concatenate([records[k]["input_ids"].numpy() for k, _, _ in table]).astype(dtype).tobytes()
        chunks.append(payload)
        meta["sets"][name] = {"key": key, "records": table, "tokens": len(payload) // np.dtype(dtype).itemsize,
                              "answer_tokens": sum(n - p for _, p, n in table),
                              "sha256": _tokens_sha256(table, payload)}
    path.parent.mkdir(parents=True, exist_ok=True)
    packed = lzma.compress(b"".join(chunks), preset=9 | lzma.PRESET_EXTREME)
    (path.parent / f"{path.name}.tokens.xz").write_bytes(packed)
    (path.parent / f"{path.name}.json").write_text(json.dumps(meta, separators=(",", ":")) + "\n")
    return path


def load_shipped(fingerprint: str, key: dict, answers_dir: Path = ANSWERS_DIR) -> dict[str, dict]:
    """{cache key: record} of the shipped answers made by the target with this weights checksum and these
    generation settings; {} when none were shipped for them. A file whose tokens fail their sha256 is refused."""
    for meta_path in sorted(Path(answers_dir).glob("*.json")):
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != SHIPPED_FORMAT or meta.get("target") != fingerprint:
            continue
        match = [name for name, s in meta["sets"].items() if s["key"] == key]
        if not match:
            continue
        raw = lzma.decompress(meta_path.with_suffix(".tokens.xz").read_bytes())
        offset, itemsize = 0, np.dtype(meta["dtype"]).itemsize
        for name, s in meta["sets"].items():
            size = s["tokens"] * itemsize
            if name == match[0]:
                part = raw[offset:offset + size]
                if _tokens_sha256(s["records"], part) != s["sha256"]:
                    raise ValueError(f"{meta_path}: the shipped answers fail their sha256 (a corrupted package): "
                                     "reinstall spectrt or delete the file to regenerate them")
                ids = np.frombuffer(part, dtype=meta["dtype"]).astype(np.int32)
                out, pos = {}, 0
                for k, prompt_len, n in s["records"]:
                    out[k] = {"input_ids": torch.from_numpy(ids[pos:pos + n].copy()), "prompt_len": prompt_len}
                    pos += n
                return out
            offset += size
    return {}


# --------------------------------------------------------------------------------------------------
# Teacher forcing


def _prompt_groups(records: Sequence[dict]) -> list[list[int]]:
    """Indices of records grouped by identical prompt ids (the sampled answers to one conversation)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(tuple(r["input_ids"][:r["prompt_len"]].tolist()), []).append(i)
    return list(groups.values())


class DiskFeatures:
    """A teacher-forced record's target features, left in its cache file and read when indexed (`r["features"][a:b]`
    reads those rows, `[:]` all of them, as on a tensor). Why: held in memory, the features of 28,456 answers took
    ~16 GB (0.58 MB an answer: bf16 rows of 3 x hidden at every prompt and answer position), near a 24 GB machine's
    end, so more data could not be trained on. A read costs ~1.4 ms (a training batch reads ~14: ~2% of its step)."""

    def __init__(self, path: Path, index: int, shape: tuple[int, ...], dtype: torch.dtype):
        self.path, self.index, self.shape, self.dtype = path, index, shape, dtype

    def __getitem__(self, key) -> torch.Tensor:
        # mmap: only the rows read are paged in; the mapping ends with the last view of it
        return torch.load(self.path, weights_only=True, mmap=True)[self.index]["features"][key]


def _on_disk(records: list[dict], path: Path) -> list[dict]:
    """`records` (the contents of cache file `path`, in order) with their features left in that file."""
    return [{**r, "features": DiskFeatures(path, j, tuple(r["features"].shape), r["features"].dtype)}
            if "features" in r else r for j, r in enumerate(records)]


def _load_lazily(path: Path) -> list[dict]:
    """A cache file's records, their features left on disk (`DiskFeatures`): the rest (token ids, top-k labels,
    ~0.2 KB an answer token) is copied out of the mapping, so nothing keeps the file mapped."""
    mapped = torch.load(path, weights_only=True, mmap=True)
    return _on_disk([{k: v.clone() if isinstance(v, torch.Tensor) and k != "features" else v for k, v in r.items()}
                     for r in mapped], path)


def _steady_heap() -> None:
    """Fix glibc's mmap threshold at 128 KB (the default it starts from). Why: freeing each forward's 100 MB logits
    raised the dynamic threshold to 32 MB, so every later temporary came from the heap, interleaved with the
    records kept; the heap fragmented and the process grew ~15 MB per answer (the head's 4,922 shipped answers were
    OOM-killed at 24 GB, a third of the way). Measured on 200 answers: +0.63 GB resident without, +0.12 GB with
    (what the kept records hold). No-op where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD; setting it also turns the dynamic adjustment off
    except (OSError, AttributeError):
        pass


def _group_segment(records: Sequence[dict], group: list[int]):
    """One tree over a prompt and its answers: the prompt once (causal), each answer a branch that sees the prompt and
    its own earlier tokens, at the positions it has in its own record. Returns tokens, positions, mask and, per
    record, the rows of its positions 0..n-1 in the tree."""
    p = records[group[0]]["prompt_len"]
    prompt = records[group[0]]["input_ids"][:p].long()
    answers = [records[i]["input_ids"][p:].long() for i in group]
    total = p + sum(len(a) for a in answers)
    mask = torch.zeros(total, total, dtype=torch.bool)
    mask[:p, :p] = torch.ones(p, p, dtype=torch.bool).tril()
    positions, rows, start = [torch.arange(p)], [], p
    for a in answers:
        end = start + len(a)
        mask[start:end, :p] = True
        mask[start:end, start:end] = torch.ones(len(a), len(a), dtype=torch.bool).tril()
        positions.append(torch.arange(p, p + len(a)))
        rows.append(torch.cat([torch.arange(p), torch.arange(start, end)]))
        start = end
    return torch.cat([prompt, *answers]), torch.cat(positions), mask, rows


@torch.inference_mode()
def teacher_force(
    target: Path | object,
    records: Sequence[dict],
    dtype: str,
    top_k: int,
    feature_layers: Sequence[int] = (),
    deadline: float | None = None,
    rows_per_call: int = 512,
    seed: int = 0,
    progress: bool = True,
    desc: str = "teacher forcing",
    cache_dir: Path | None = None,
) -> tuple[list[dict], dict]:
    """Records with the target's view of each answer, from batched target forwards over prompts and answers.

    Adds `top_ids` [A, k] int32 and `top_logp` [A, k] fp16 (the target's top-k log-probs predicting each of the A
    answer tokens) and, with `feature_layers`, `features` [n, 3 * hidden] bf16 (EAGLE-3 target features at every
    position, `Transformer.forward_features`). The answers to one prompt share it: one tree per prompt (the prompt
    once, each answer a branch; on the native forward every row is what a causal forward of its own record gives),
    which saves the prompt's rows for every further answer. Prompts are processed in a seeded random order, several
    per forward (about `rows_per_call` rows), and none is started after `deadline`: what is returned is a
    representative subset. `target` is a checkpoint dir or a loaded `Transformer`. Returns (records, stats).

    With `cache_dir` (the caller keys it by target) every prompt's records are also written there, one file per prompt
    named by its tokens and the settings, and read back instead of forced again: teacher forcing the shipped 1.25M
    answer tokens takes 35-70 minutes on 2 cores, so a run cut short by its deadline or the session keeps its work and
    the next run, with more data or a longer budget, forces only what is new.
    The records returned then leave their features in those files (`DiskFeatures`), so memory does not bound the data.
    They come in the seeded prompt order whatever was cached (a prompt's cached answers before its new ones), so a
    training run resumed on the same data sees the same batches: records read from the cache first and forced ones
    after made a resumed epoch's position point at other batches (length ties batch in record order).
    """
    from spectrt.runtime.engines.kernels import native_unavailable
    from spectrt.runtime.engines.model import Transformer
    from tqdm.auto import tqdm

    _steady_heap()
    t0 = time.monotonic()
    if not isinstance(target, Transformer):  # the native forward when it runs here (native=None)
        fast = _dtype(dtype) != torch.bfloat16 or bf16_pays(native=native_unavailable() is None)
        # bf16 labels from AMX tiles' bf16dot where it runs (`resolve_dtype`'s `auto`): 2.1x the rate (Intel Xeon
        # model 207, 2 cores, 400 shipped greedy answers with features, interleaved twice: 1,492-1,674 vs 719-794
        # tokens/s), their top-1 labels the bf16 forward's on 99.5% of positions (near-ties apart)
        dots = fast and _dtype(dtype) == torch.bfloat16 and resolve_dtype("auto") == "bf16dot"  # native only
        target = Transformer.load(Path(target), _dtype(dtype) if fast else torch.float32, pair_dots=dots)
    model = target
    groups = _prompt_groups(records)
    groups = [groups[i] for i in torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed))]
    done: dict[tuple[int, int], list[dict]] = {}  # (prompt's place in the seeded order, part) -> its records
    places = [(k, 0) for k in range(len(groups))]  # where each group still to force goes
    tokens = rows_run = cached = cached_tokens = 0
    if cache_dir is not None:
        settings = f"{_precision(model)}-k{top_k}-f{'.'.join(map(str, feature_layers))}"
        cache_dir = Path(cache_dir) / settings
        cache_dir.mkdir(parents=True, exist_ok=True)
        missing, places = [], []
        for k, g in enumerate(groups):
            # a prompt's earlier answers may be cached as the group they formed before a round was added (the
            # shipped set's 4th round: 0 of 5,461 groups hit by name): its longest cached prefix, then the rest
            m = next((m for m in range(len(g), 0, -1) if (cache_dir / _group_file(records, g[:m])).is_file()), 0)
            for part_no, part in enumerate((g[:m], g[m:])):
                path = cache_dir / _group_file(records, part) if part else None
                if path is None:
                    continue
                if not path.is_file():
                    missing.append(part)
                    places.append((k, part_no))
                    continue
                kept = done[k, part_no] = _load_lazily(path)
                cached += len(kept)
                cached_tokens += sum(len(r["input_ids"]) for r in kept)
        groups = missing

    def in_order() -> list[dict]:
        return [rec for place in sorted(done) for rec in done[place]]

    if not groups:
        out = in_order()
        return out, _tf_stats(out, records, cached, cached_tokens, 0, 0, time.monotonic() - t0, model,
                              feature_layers)
    segments = [_group_segment(records, g) for g in groups]
    longest = max(len(s[0]) for s in segments)
    calls, cur, rows = [], [], 0
    for k, seg in enumerate(segments):
        if cur and rows + len(seg[0]) > max(rows_per_call, longest):
            calls.append(cur)
            cur, rows = [], 0
        cur.append(k)
        rows += len(seg[0])
    calls.append(cur)
    caches = model.new_caches(max(len(c) for c in calls), longest, longest)
    bar = tqdm(total=len(records), initial=cached, desc=desc, unit="answer", disable=not progress)
    for call in calls:
        if deadline is not None and done and time.monotonic() > deadline:
            break
        batch = []
        for k, cache in zip(call, caches, strict=False):
            cache.reset()
            batch.append((*segments[k][:3], cache))
        if feature_layers:
            logits, features = model.forward_features(batch, feature_layers)
        else:
            logits, features = model.forward_many(batch), None
        for j, k in enumerate(call):
            rows_run += len(segments[k][0])
            out = done[places[k]] = []
            for i, rec_rows in zip(groups[k], segments[k][3], strict=True):
                rec, p = records[i], records[i]["prompt_len"]
                values, indices = logits[j][rec_rows[p - 1:-1]].float().log_softmax(-1).topk(top_k, dim=-1)
                new = {"input_ids": rec["input_ids"], "prompt_len": p, "top_ids": indices.to(torch.int32),
                       "top_logp": values.to(torch.float16)}
                if features is not None:
                    new["features"] = features[j][rec_rows].to(torch.bfloat16)
                out.append(new)
                tokens += len(rec["input_ids"])
            if cache_dir is not None:  # then its features are read back from there when trained on
                path = cache_dir / _group_file(records, groups[k])
                atomic_save(out, path)
                done[places[k]] = _on_disk(out, path)
            bar.update(len(groups[k]))
        bar.set_postfix(tok_s=f"{tokens / (time.monotonic() - t0):.0f}")
    bar.close()
    out = in_order()
    return out, _tf_stats(out, records, cached, cached_tokens, tokens, rows_run, time.monotonic() - t0, model,
                          feature_layers)


def _group_file(records: Sequence[dict], group: list[int]) -> str:
    """A prompt's cache file name: a hash of its records' tokens (prompt and answers, in order)."""
    h = hashlib.sha256()
    for i in group:
        h.update(np.asarray(records[i]["input_ids"], dtype=np.int64).tobytes())
        h.update(str(records[i]["prompt_len"]).encode() + b";")
    return h.hexdigest()[:32] + ".pt"


def _tf_stats(out, records, cached, cached_tokens, tokens, rows_run, seconds, model, feature_layers) -> dict:
    """`tokens` and the rate count what was forced in this call; `cached` records were read from the cache."""
    return {"records": len(out), "of": len(records), "cached": cached, "cached_tokens": cached_tokens,
            "tokens": tokens, "forward_rows": rows_run, "seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
            "dtype": _precision(model), "feature_layers": list(feature_layers)}


def _precision(model) -> str:
    """The forward's precision as a cache key and report: bf16dot's labels are not bf16's, so they never mix."""
    return "bf16dot" if model.native is not None and model.native.pairs else str(model.dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------
# Making the shipped answers (`python -m spectrt.cli.ship answers`; resumable: each call adds to the shipped file)


def ship_answers(target: Path, work_dir: Path, out: Path | None = None, minutes: float = 8.0,
                 rounds: int = DistillConfig.samples_per_prompt,
                 prompts: Sequence[Path] = TRAIN_PROMPTS, greedy: bool = False) -> Path:
    """Generate the target's answers to the held-out and training prompts for `minutes`, then write every answer
    made so far (answers already shipped kept) as the package's shipped answers; returns the output stem.

    `greedy`: one greedy answer per training prompt instead (`spectrt draft --greedy-answers`), in a file of its own
    (`<target>-greedy`; the held-out answers are greedy already and ship with the sampled set). Why ship what
    regenerates exactly: 720k answer tokens take 22 minutes on 2 cores, and a machine's cache dies with it."""
    cfg = DistillConfig(**GREEDY_ANSWERS) if greedy else DistillConfig(samples_per_prompt=rounds)
    out = Path(out) if out is not None else ANSWERS_DIR / (Path(target).name + ("-greedy" if greedy else ""))
    deadline = time.monotonic() + 60 * minutes
    fingerprint, sets = target_fingerprint(target), {}
    train = [c for path in prompts for c in read_prompts(path)]
    parts = (("eval", read_prompts(HELDOUT_PROMPTS), True), ("distill", train, False))
    for name, convs, eval_set in parts[1:] if greedy else parts:
        _, stats = generate_distill_data(target, convs, work_dir, cfg, eval_set=eval_set, deadline=deadline)
        key = cfg.generation_key(eval_set)
        n_rounds = 1 if eval_set else cfg.samples_per_prompt
        wanted = {_sample_key(conv_key(c), r) for c in convs for r in range(n_rounds)}
        cached = torch.load(stats["cache"], weights_only=True) if Path(stats["cache"]).is_file() else {}
        # every answer the output ships already stays (another call's prompt files: the bare command once rewrote
        # the greedy file with its default prompts' answers alone, 34k answers down to 461), this call's are added
        answers = {**load_shipped(fingerprint, key, out.parent), **{k: v for k, v in cached.items() if k in wanted}}
        sets[name] = (key, answers)
        print(f"{name}: {sum(k in answers for k in wanted)} of {len(wanted)} answers to these prompts, "
              f"{len(answers)} shipped ({sum(len(r['input_ids']) - r['prompt_len'] for r in answers.values())} "
              "answer tokens)")
    return write_shipped(out, target, sets)
