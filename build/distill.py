"""Distillation: train a slice's layers to match the target's answers (build/corpus.py), within a time budget.

loss = kl_weight * KL(target || draft) + ce_weight * CE(target argmax) at the generated positions. The KL is
exact on the coarsened distribution {top-k ids, "everything else"}. Embeddings, LM head (tied in SmolLM2)
and final norm are frozen and stay bit-identical to the target's. With a vocabulary-subset head (FR-Spec,
`vocab_subset`), the draft's softmax runs over the subset's ids only, exactly as it is served
(runtime/engines/model.py `_logits`): target ids outside it count as "everything else". AdamW, bf16 autocast, WSD
schedule (warmup, constant, linear decay over the last part of the time budget), checkpoint + resume, tqdm
bar with loss and ETA.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch


@dataclass
class DistillConfig:
    """Everything that shapes the draft; the defaults are the measured choices for a 2-core CPU.

    Measured on SmolLM2-135M-Instruct, 4-layer slice, 2 shared (busy) cores, held-out top-1 against
    the fp32 target's greedy answers (48 prompts):
    - data: sampling at T=0.7 beat greedy answers of the same 128 prompts, same 80 steps:
      top-1 21.3% vs 18.7%, top-3 35.1% vs 32.4% (29% of sampled tokens are not the argmax: more
      varied contexts; the CE target stays the argmax, the KL carries the rest);
    - data is the bottleneck (a 4-minute run trained 3.3 epochs on 10k tokens: 50% top-1 on its
      own data, 22% held-out), so ~2/3 of the budget generates data (~1.5 epochs of training);
    - bf16 generation: the body runs 1.6-2x faster than fp32; a bf16 head 17 vs 46-67 ms per
      batch-32 step, at 97.6% argmax agreement with the fp32 target (98.8% with an fp32 head);
    - keeping the target's top-k log-probs from generation instead of recomputing them: a
      teacher-forced target forward costs ~7 ms/token here, the draft's whole train step ~2-3;
    - bf16 autocast training: 1083 vs 282 tok/s (fp32), 4 layers + head, fwd+bwd;
    - lr/batch: 60 steps x 1024 tokens: lr 1e-3 21.1%, 3e-3 22.0%, 1e-2 9.2%; 120 x 512 tokens:
      2e-3 25.2%, 3e-3 23.6%; 240 x 256 tokens, 1.5e-3: 24.3% -> lr 2e-3, 512-token batches;
    - train_norm: 25.2% / 40.2% (trained) vs 25.2% / 40.1% (frozen): no gain, stays shared;
    - vocab_subset (FR-Spec head over the K ids most frequent in the target's answers, trained and
      served alike). Draft step (4 layers, fp32, T=1, 1 thread) as a share of a target step: full head
      18.1%, K=16k 11.4%, 8k 10.7%, 4k 9.0% (the 4 layers alone ~9%); held-out target argmaxes inside
      the subset (an 11k-token corpus): 16k 94.9%, 8k 90.2%, 4k 83.6%, 2k 78.5% -> K=8192. A bf16
      draft was slower (8k head: 12.5% vs 10.7%), so the draft runs in the target's precision.
    """

    # data generation
    max_new_tokens: int = 128
    temperature: float = 0.7  # 0 = greedy
    samples_per_prompt: int = 4  # with sampling: answers per prompt (the shipped set: 4 x 5,461 prompts)
    gen_batch_size: int = 32  # requests decoded together (build/generation.py)
    gen_dtype: str = "bfloat16"  # target precision for training data: the fastest exact one on the native forward
    eval_dtype: str = "float32"  # held-out answers are the fp32 target's, as served
    eval_max_new_tokens: int = 96
    top_k: int = 32  # target log-probs kept per generated token
    max_prompt_tokens: int = 512  # longer conversations keep their last tokens
    data_fraction: float = 0.65  # share of the budget (from the start) after which no new data is generated
    # loss
    kl_weight: float = 1.0
    ce_weight: float = 1.0
    kl_temperature: float = 1.0
    # optimisation
    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 10
    decay_fraction: float = 0.3  # linear decay to min_lr_ratio over the last 30% of the run
    min_lr_ratio: float = 0.05
    grad_clip: float = 1.0
    batch_tokens: int = 512  # padded tokens per step
    train_norm: bool = False
    vocab_subset: int = 8192  # draft head over the K most frequent answer ids (0 = full vocabulary)
    amp: bool = True  # bf16 autocast
    seed: int = 0
    checkpoint_every_s: float = 120.0
    eval_batch_size: int = 16
    # EAGLE-3 feature head (build/eagle3.py); the schedule, clipping and loss above are shared
    head_lr: float = 2e-3
    # the head's data share: at 0.65 it trained 1.8 epochs and was still step-limited (train top-1 = held-out 32.4%);
    # at 0.4, 5.5 epochs, held-out 35.3% (train 49%: now data-limited). 10-minute runs, shipped answers, 2 cores.
    head_data_fraction: float = 0.4
    head_batch_tokens: int = 2048  # padded tokens per step
    head_init_std: float = 0.02
    head_train_lm_head: bool = False  # lm_head starts as the target's subset rows
    ttt_steps: int = 3  # training-time test: draft levels unrolled on the head's own outputs
    ttt_decay: float = 0.8  # weight of step i: ttt_decay ** i (EAGLE-3)
    tf_rows_per_call: int = 512  # teacher forcing: rows per target forward

    def generation_key(self, eval_set: bool) -> dict:
        """What decides the target's answers besides the target and the conversation (corpus caches, shipped data).
        v6: answers only (log-probs come from teacher forcing), made by the decode loop with one seed per answer."""
        if eval_set:
            return {"dtype": self.eval_dtype, "temperature": 0.0, "max_new_tokens": self.eval_max_new_tokens,
                    "max_prompt_tokens": self.max_prompt_tokens, "v": 6}
        return {"dtype": self.gen_dtype, "temperature": self.temperature, "max_new_tokens": self.max_new_tokens,
                "max_prompt_tokens": self.max_prompt_tokens, "seed": self.seed, "v": 6}


# one greedy answer a prompt (`spectrt draft --greedy-answers`, `ship answers --greedy`): one definition, because the
# shipped greedy answers are found by the generation key these settings make
GREEDY_ANSWERS = {"temperature": 0.0, "samples_per_prompt": 1}

BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # /proc/cpuinfo flags of CPUs with bf16 arithmetic


def bf16_pays(native: bool = False, flags: set[str] | None = None) -> bool:
    """Whether bf16 compute is fast here: on the native forward always (bf16 weights, fp32 arithmetic: half the
    weight bytes), on torch (training's autocast, a torch-path target) only where the CPU has bf16 arithmetic
    (AVX512-BF16 or AMX-BF16; `flags`: this CPU's by default). Elsewhere oneDNN emulates bf16, slower than fp32,
    so fp32 runs. Every trainer and the teacher-forcing target take their precision from here."""
    from spectrt.runtime.engines.kernels import cpu_flags

    return native or bool(BF16_FLAGS & (cpu_flags() if flags is None else set(flags)))


def load_draft(slice_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(slice_dir, dtype=torch.float32)


def trainable_names(model, train_norm: bool) -> list[str]:
    names = [n for n, _ in model.named_parameters() if n.startswith("model.layers.")]
    if train_norm:
        names.append("model.norm.weight")
    return names


def frozen_names(model, train_norm: bool) -> list[str]:
    """Parameters that must stay bit-identical to the target's (embeddings, LM head unless tied to
    them, final norm unless `train_norm`); tied aliases are listed once, under their first name."""
    trainable = set(trainable_names(model, train_norm))
    seen: set[int] = set()
    names = []
    for n, p in model.named_parameters(remove_duplicate=False):
        if n in trainable or p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        names.append(n)
    return names


def _batches(records: Sequence[dict], batch_tokens: int) -> list[list[int]]:
    """Record indices grouped by length so each batch holds <= batch_tokens padded tokens."""
    order = sorted(range(len(records)), key=lambda i: len(records[i]["input_ids"]))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = len(records[i]["input_ids"]) - 1
        if cur and (len(cur) + 1) * width > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def _collate(records: Sequence[dict], idx: Sequence[int], pad_id: int):
    """Inputs (right-padded), loss positions and target top-k for one batch."""
    seqs = [records[i] for i in idx]
    width = max(len(r["input_ids"]) - 1 for r in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    rows, cols = [], []
    for b, r in enumerate(seqs):
        x = r["input_ids"][:-1].long()
        ids[b, : len(x)] = x
        n = len(r["top_ids"])
        rows.append(torch.full((n,), b, dtype=torch.long))
        cols.append(torch.arange(r["prompt_len"] - 1, r["prompt_len"] - 1 + n))
    top_ids = torch.cat([r["top_ids"] for r in seqs]).long()
    top_logp = torch.cat([r["top_logp"] for r in seqs]).float()
    return ids, torch.cat(rows), torch.cat(cols), top_ids, top_logp


def distill_loss(logits: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor, cfg: DistillConfig,
                 need_grad: bool = False):
    """Loss of draft `logits` [N, V] against the target's top-k, with its gradient computed in closed form.

    Returns (sums of loss, kl, ce and top-1 hits over the N rows, d(sum loss)/d(logits) or None).
    T = 1: exact KL(target || draft) on the partition {the target's k ids, all other ids}, plus
    CE on the target's argmax. T != 1: KL of both distributions conditioned on the target's top-k
    (the target's full tempered normaliser is not stored), scaled by T^2 (Hinton).
    `top_ids` < 0 marks ids outside the logits' vocabulary (training on a vocabulary subset): their
    mass counts as "all other ids" and a row whose argmax is outside gets no CE.
    The gradient is written without autograd: one pass over the [N, V] logits instead of the ~6 an
    autograd log_softmax/gather graph makes (1.2-1.5x faster head on this CPU).
    """
    kw, cw, t = cfg.kl_weight, cfg.ce_weight, cfg.kl_temperature
    z = logits.float()
    lse = z.logsumexp(-1)
    valid = top_ids >= 0
    ids = top_ids.clamp(min=0)
    zk = z.gather(1, ids)
    q_logp = zk - lse[:, None]
    v0 = valid[:, 0].float()
    ce = -q_logp[:, 0] * v0
    p = torch.where(valid, top_logp.exp(), 0.0)
    if t == 1.0:
        qk = torch.where(valid, q_logp.exp(), 0.0)
        p_rest = (1 - p.sum(-1)).clamp(min=0)
        q_rest = (1 - qk.sum(-1)).clamp(min=1e-8)
        kl = (p * (torch.where(valid, top_logp, 0.0) - q_logp)).sum(-1)
        kl = kl + p_rest * (p_rest.clamp(min=1e-8).log() - q_rest.log())
    else:
        pt = torch.where(valid, top_logp / t, -torch.inf).log_softmax(-1)
        qt = torch.where(valid, zk / t, -torch.inf).log_softmax(-1)
        kl = torch.where(valid, pt.exp() * (pt - qt), 0.0).sum(-1) * t * t
    loss = kw * kl + cw * ce
    hits = (z.argmax(-1) == top_ids[:, 0]).sum()
    sums = torch.stack([loss.sum(), kl.sum(), ce.sum(), hits.float()])
    if not need_grad:
        return sums, None
    # d/dz: CE -> q - e_a; T=1 KL -> q - p on K, q * (1 - p_rest/q_rest) off K; T!=1 KL -> T (qt - pt) on K
    if t == 1.0:
        scale = kw * (1 - p_rest / q_rest) + cw * v0
        grad_k = (kw + cw * v0[:, None]) * qk - kw * p
    else:
        scale = cw * v0
        grad_k = cw * v0[:, None] * q_logp.exp() + kw * t * (qt.exp() - pt.exp())
    grad_k[:, 0] -= cw * v0
    if z is logits:
        z = z.clone()
    q = z.sub_(lse[:, None]).exp_()  # reuses z's memory
    correction = torch.where(valid, grad_k - q_logp.exp() * scale[:, None], 0.0)
    grad = q.mul_(scale[:, None])
    grad.scatter_add_(1, ids, correction.to(grad.dtype))
    return sums, grad


def _lr_factor(cfg: DistillConfig, step: int, progress: float) -> float:
    """WSD: linear warmup over the first steps, constant, linear decay over the last `decay_fraction`."""
    warm = 1.0
    if cfg.warmup_steps > 0:
        warm = min(1.0, (step + 1) / cfg.warmup_steps)
    decay = 1.0
    if cfg.decay_fraction > 0 and progress > 1 - cfg.decay_fraction:
        frac = min(1.0, (progress - (1 - cfg.decay_fraction)) / cfg.decay_fraction)
        decay = 1 - frac * (1 - cfg.min_lr_ratio)
    return warm * decay


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _load_state(path: Path, meta: dict, keys: tuple[str, ...], params: dict, names: list[str], opt,
                progress: bool) -> tuple[int, int, int] | None:
    """Resume a run `_save_state` checkpointed: its trained params and optimizer into `params`/`opt`, returning
    (step, epoch, data position); None when there is no checkpoint or it was made for another model or data (its
    `meta` differs on `keys`: it is then ignored, with a line saying so)."""
    if not Path(path).is_file():
        return None
    state = torch.load(path, weights_only=True)
    if any(state["meta"].get(k) != meta[k] for k in keys):
        if progress:
            print(f"{path}: made for another draft or target, starting fresh", flush=True)
        return None
    with torch.no_grad():
        for n in names:
            params[n].copy_(state["params"][n])
    opt.load_state_dict(state["optimizer"])
    return state["step"], state["epoch"], state["pos"]


def _save_state(path: Path, model, names: list[str], opt, step: int, epoch: int, pos: int, meta: dict,
                finished: bool) -> None:
    params = dict(model.named_parameters())
    atomic_save(
        {
            "step": step,
            "epoch": epoch,
            "pos": pos,
            "params": {n: params[n].detach().clone() for n in names},
            "optimizer": opt.state_dict(),
            "meta": meta,
            "finished": finished,
        },
        path,
    )


def train_draft(
    slice_dir: Path,
    records: Sequence[dict],
    state_path: Path,
    cfg: DistillConfig,
    budget_s: float | None = None,
    max_steps: int | None = None,
    resume: bool = True,
    progress: bool = True,
    on_step: Callable[[int, dict], None] | None = None,
    tag: str = "",
    vocab_ids: torch.Tensor | None = None,
):
    """Distill the slice on `records`; returns (model with trained weights, stats).

    `vocab_ids`: the subset head's target ids (None: full head); the softmax runs over them only.

    Stops at `budget_s` seconds or `max_steps` total steps (whichever first; one is required).
    The LR schedule follows the time budget, or the step budget when `max_steps` is given (then a run
    is deterministic and an interrupted + resumed run matches an uninterrupted one). State (trainable
    weights, AdamW moments, step, data position) is written to `state_path` every
    `checkpoint_every_s`, at the end, and on KeyboardInterrupt; a later call with `resume=True`
    continues from it if it was made for the same draft shape and `tag` (make_draft: the target's
    fingerprint); otherwise training starts fresh. `on_step(step, running_metrics)` is called after
    every step (a KeyboardInterrupt raised there stops training like Ctrl-C).
    """
    from tqdm.auto import tqdm

    if budget_s is None and max_steps is None:
        raise ValueError("train_draft needs budget_s or max_steps")
    if not records:
        raise ValueError("no training data: the distillation corpus produced no target answers")
    cfg = replace(cfg, amp=cfg.amp and bf16_pays())
    torch.manual_seed(cfg.seed)
    model = load_draft(slice_dir)
    model.train()
    names = trainable_names(model, cfg.train_norm)
    params = dict(model.named_parameters())
    for p in model.parameters():
        p.requires_grad_(False)
    for n in names:
        params[n].requires_grad_(True)
    opt = torch.optim.AdamW([params[n] for n in names], lr=cfg.lr, betas=cfg.betas,
                            weight_decay=cfg.weight_decay)
    meta = {"layers": model.config.num_hidden_layers, "train_norm": cfg.train_norm,
            "trainable": names, "records": len(records), "tag": tag}
    resumed = _load_state(state_path, meta, ("layers", "trainable", "tag"), params, names, opt, progress) \
        if resume else None
    step, epoch, pos = resumed or (0, 0, 0)
    start_step = step
    head = model.get_output_embeddings().weight
    head_c = head.detach().to(torch.bfloat16) if cfg.amp else head.detach()
    remap = None
    if vocab_ids is not None:
        remap = subset_remap(vocab_ids, head.shape[0])
        head_c = head_c[vocab_ids].contiguous()
    body = model.model
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    batches = _batches(records, cfg.batch_tokens)
    if pos >= len(batches):  # resumed on less data than before
        epoch, pos = epoch + 1, 0
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.amp else contextlib.nullcontext()
    t0 = time.monotonic()
    last_ckpt = t0
    run = {"loss": 0.0, "kl": 0.0, "ce": 0.0, "top1": 0.0}
    seen_tokens = 0
    bar = tqdm(total=round(budget_s) if budget_s else max_steps - start_step, disable=not progress,
               desc=f"distill {meta['layers']}-layer draft", unit="s" if budget_s else "step",
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    chunk = 1024
    stopped_by = "budget"
    try:
        while True:
            elapsed = time.monotonic() - t0
            if max_steps is not None and step >= max_steps:
                stopped_by = "max_steps"
                break
            if budget_s is not None and elapsed >= budget_s:
                break
            prog = step / max_steps if max_steps is not None else elapsed / budget_s
            for g in opt.param_groups:
                g["lr"] = cfg.lr * _lr_factor(cfg, step, prog)
            order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(cfg.seed + epoch))
            ids, rows, cols, top_ids, top_logp = _collate(records, batches[int(order[pos])], pad)
            if remap is not None:
                top_ids = remap[top_ids]
            with amp:
                hidden = body(input_ids=ids).last_hidden_state
            sel = hidden[rows, cols]
            n_tok = len(rows)
            sums = torch.zeros(4)
            grad_sel = torch.empty(sel.shape, dtype=head_c.dtype)
            with torch.no_grad():
                h_all = sel.detach().to(head_c.dtype)
                for s in range(0, n_tok, chunk):
                    logits = h_all[s:s + chunk] @ head_c.T
                    part, g = distill_loss(logits, top_ids[s:s + chunk], top_logp[s:s + chunk], cfg, need_grad=True)
                    grad_sel[s:s + chunk] = (g.to(head_c.dtype) @ head_c) / n_tok
                    sums += part
                    del logits, g
            sel.backward(grad_sel.to(sel.dtype))
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_([params[n] for n in names], cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            seen_tokens += n_tok
            pos += 1
            if pos >= len(batches):
                epoch, pos = epoch + 1, 0
            m = (sums / n_tok).tolist()
            for k, v in zip(run, m, strict=True):
                run[k] = v if step == start_step + 1 else 0.9 * run[k] + 0.1 * v
            if on_step is not None:
                on_step(step, dict(run))
            now = time.monotonic()
            if budget_s:
                bar.n = min(round(now - t0), bar.total)
            else:
                bar.update(1)
            bar.set_postfix_str(f"step {step} loss {run['loss']:.3f} kl {run['kl']:.3f} top1 {run['top1']:.2f}")
            if now - last_ckpt > cfg.checkpoint_every_s:
                _save_state(state_path, model, names, opt, step, epoch, pos, meta, finished=False)
                last_ckpt = now
    except KeyboardInterrupt:
        _save_state(state_path, model, names, opt, step, epoch, pos, meta, finished=False)
        bar.close()
        raise
    bar.close()
    _save_state(state_path, model, names, opt, step, epoch, pos, meta, finished=True)
    stats = {
        "steps": step,
        "autocast_bf16": cfg.amp,
        "steps_this_run": step - start_step,
        "resumed_from_step": start_step,
        "train_s": round(time.monotonic() - t0, 1),
        "tokens_this_run": seen_tokens,
        "epochs": round(epoch + pos / len(batches), 2),
        "batches_per_epoch": len(batches),
        "stopped_by": stopped_by,
        "final_running": {k: round(v, 4) for k, v in run.items()},
    }
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, stats



def subset_remap(vocab_ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Target id -> row of the subset head, -1 for ids outside it."""
    remap = torch.full((vocab,), -1, dtype=torch.long)
    remap[vocab_ids] = torch.arange(len(vocab_ids))
    return remap


@torch.inference_mode()
def evaluate(model, records: Sequence[dict], vocab_ids: torch.Tensor | None = None, batch_tokens: int = 4096) -> dict:
    """Agreement of `model` (fp32, subset head `vocab_ids` if given) with the target at every generated position.

    top1: the draft's argmax is the target's argmax; top3: the target's argmax is in the draft's
    top 3; kl: mean KL(target || draft) on {target top-k, rest}; coverage: share of the target's
    argmaxes inside the subset (the ceiling of top-1).
    """
    model.eval()
    cfg = DistillConfig()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    head = model.get_output_embeddings().weight
    remap = None
    if vocab_ids is not None:
        remap, head = subset_remap(vocab_ids, head.shape[0]), head[vocab_ids]
    n = hit1 = hit3 = inside = 0
    kl_sum = 0.0
    for idx in _batches(records, batch_tokens):
        ids, rows, cols, top_ids, top_logp = _collate(records, idx, pad)
        if remap is not None:
            top_ids = remap[top_ids]  # -1: outside the subset, never matched
        hidden = model.model(input_ids=ids).last_hidden_state[rows, cols]
        logits = hidden.float() @ head.T
        top3 = logits.topk(3, dim=-1).indices
        want = top_ids[:, :1]
        hit1 += int((top3[:, :1] == want).sum())
        hit3 += int((top3 == want).any(-1).sum())
        inside += int((want >= 0).sum())
        kl_sum += float(distill_loss(logits, top_ids, top_logp, cfg)[0][1])
        n += len(rows)
    return {"tokens": n, "top1": round(hit1 / n, 4), "top3": round(hit3 / n, 4), "kl": round(kl_sum / n, 4),
            "coverage": round(inside / n, 4)}
