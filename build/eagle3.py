"""Training an EAGLE-3 feature head (runtime/engines/eagle3.py runs it) on teacher-forced target features.

The module's parameters carry SpecForge's names (`fc`, `midlayer.*`, `norm`, `lm_head`, buffers `d2t`, `t2d`), so
its state dict is the checkpoint (`save_head`). Training (`train_head`) is EAGLE-3's training-time test: step 0 runs
the head on the target's features of every position; step i > 0 feeds each row its own output hidden from step
i - 1 and the next true token, as drafting a chain i levels deep does, attending to the target-feature rows up to
its root (step 0, causal) and to its own earlier steps (the chain's ancestors), at position + i. Each step's logits
over the draft vocabulary are trained by KL to the target's top-k plus CE on the target's argmax (build/distill.py
`distill_loss`, closed-form gradient), step i weighted `ttt_decay ** i`.

Measured choices are in `DistillConfig` (build/distill.py), shared with the slice: one budget, one progress bar.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spectrt.build.distill import (
    DistillConfig,
    _batches,
    _load_state,
    _lr_factor,
    _save_state,
    bf16_pays,
    distill_loss,
    subset_remap,
)
from spectrt.build.slice import TOKENIZER_FILES
from spectrt.runtime.engines.eagle3 import ARCHITECTURE, default_feature_layers
from spectrt.runtime.engines.families import rope_frequencies
from spectrt.runtime.engines.model import ModelConfig, rope_tables, rotate
from torch import nn


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        q_dim, kv_dim = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.q_proj = nn.Linear(2 * c.hidden_size, q_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _MidLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.self_attn, self.mlp = _Attention(c), _MLP(c)
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)


def head_config(target: ModelConfig) -> ModelConfig:
    """The head's one LLaMA layer: the target's shape (hidden, heads, MLP, RoPE), plain LLaMA (no biases/q-k norms)."""
    return ModelConfig(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                       intermediate_size=target.intermediate_size, num_layers=1, num_heads=target.num_heads,
                       num_kv_heads=target.num_kv_heads, head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps,
                       rope_theta=target.rope_theta, tie_word_embeddings=False, rope_scaling=target.rope_scaling)


class Eagle3Module(nn.Module):
    """The trainable head; `state_dict()` is SpecForge's EAGLE-3 checkpoint layout."""

    def __init__(self, target: ModelConfig, draft_ids: torch.Tensor, init_std: float = 0.02):
        super().__init__()
        c = self.config = head_config(target)
        self.fc = nn.Linear(3 * target.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, len(draft_ids), bias=False)
        ids = draft_ids.long()
        self.register_buffer("d2t", ids - torch.arange(len(ids)))
        t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.register_buffer("t2d", t2d)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=init_std)
        inv_freq, self.rope_scale = rope_frequencies(c)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def draft_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t)) + self.d2t

    def init_from_target(self, head: torch.Tensor, norm: torch.Tensor) -> None:
        """lm_head = the target's rows of the draft vocabulary, norm = the target's final norm (SpecForge initialises
        lm_head from the target too): the head starts out speaking the target's output space."""
        with torch.no_grad():
            self.lm_head.weight.copy_(head[self.draft_ids].float())
            self.norm.weight.copy_(norm.float())

    def unroll(self, features: torch.Tensor, next_tokens: torch.Tensor, embed: torch.Tensor,
               steps: int) -> list[torch.Tensor]:
        """Training-time test over a batch: output hidden [B, N, H] of each step 0..steps-1.

        `features` [B, N, 3 * Ht]: the target's features at positions 0..N-1; `next_tokens` [B, N + steps - 1]: the
        token each row consumes at step i is next_tokens[:, t + i] (the true token at position t + 1 + i); `embed`
        the target's (frozen) input embedding. Row t of step i sits at position t + 1 + i and attends to the step-0
        rows 0..t (target features) and to its own rows of steps 1..i (its chain), as in tree drafting.
        """
        c, mid = self.config, self.midlayer
        b, n, _ = features.shape
        hq, hk, d = c.num_heads, c.num_kv_heads, c.head_dim
        group, scale = hq // hk, 1.0 / math.sqrt(d)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keys, values, outs = [], [], []
        g = self.fc(features)
        for i in range(steps):
            x = embed[next_tokens[:, i:i + n]]
            a = torch.cat([mid.input_layernorm(x), mid.hidden_norm(g)], dim=-1)
            q = mid.self_attn.q_proj(a).view(b, n, hk, group, d).permute(0, 2, 3, 1, 4)  # [B, Hk, G, N, D]
            k = mid.self_attn.k_proj(a).view(b, n, hk, d).transpose(1, 2)  # [B, Hk, N, D]
            v = mid.self_attn.v_proj(a).view(b, n, hk, d).transpose(1, 2)
            cos, sin = rope_tables(torch.arange(n) + 1 + i, self.inv_freq, self.rope_scale, q.dtype)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
            keys.append(k)
            values.append(v)
            scores = torch.einsum("bkgnd,bkmd->bkgnm", q, keys[0]) * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            chain = [(q * kj[:, :, None]).sum(-1, keepdim=True) * scale for kj in keys[1:]]  # [B, Hk, G, N, 1]
            probs = torch.cat([scores, *chain], dim=-1).float().softmax(-1).to(q.dtype)
            o = torch.einsum("bkgnm,bkmd->bkgnd", probs[..., :n], values[0])
            for j, vj in enumerate(values[1:]):
                o = o + probs[..., n + j:n + j + 1] * vj[:, :, None]
            o = o.permute(0, 3, 1, 2, 4).reshape(b, n, hq * d)
            h = g + mid.self_attn.o_proj(o)
            hn = mid.post_attention_layernorm(h)
            h = h + mid.mlp.down_proj(F.silu(mid.mlp.gate_proj(hn)) * mid.mlp.up_proj(hn))
            outs.append(h)
            g = h
        return outs


class _SubsetHeadLoss(torch.autograd.Function):
    """sum over rows of distill_loss(normed hidden @ W^T): forward computes loss and gradients in chunks (the
    closed form of build/distill.py), backward scales them; W's gradient only when it is trainable."""

    @staticmethod
    def forward(ctx, hn, weight, top_ids, top_logp, cfg, need_weight_grad, chunk=1024):
        # bf16 GEMMs with autocast (the slice's head measured 17 vs 46-67 ms per batch in fp32), fp32 softmax/loss
        dtype = torch.bfloat16 if cfg.amp else torch.float32
        sums = torch.zeros(4)
        grad_h = torch.empty(hn.shape, dtype=dtype)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32) if need_weight_grad else None
        w = weight.detach().to(dtype)
        for s in range(0, len(hn), chunk):
            h = hn[s:s + chunk].detach().to(dtype)
            part, g = distill_loss(h @ w.T, top_ids[s:s + chunk], top_logp[s:s + chunk], cfg, need_grad=True)
            g = g.to(dtype)
            grad_h[s:s + chunk] = g @ w
            if grad_w is not None:
                grad_w += (g.T @ h).float()
            sums += part
        ctx.save_for_backward(grad_h, grad_w if grad_w is not None else torch.empty(0))
        ctx.need_weight_grad = need_weight_grad
        ctx.mark_non_differentiable(sums)
        return sums[0].clone(), sums

    @staticmethod
    def backward(ctx, grad_loss, _grad_sums):
        grad_h, grad_w = ctx.saved_tensors
        return (grad_h.float() * grad_loss, grad_w * grad_loss if ctx.need_weight_grad else None,
                None, None, None, None, None)


def _digest(tensors: Sequence[torch.Tensor]) -> str:
    """A short sha256 of the tensors' values (what a training state was made from)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        h.update(str(t.dtype).encode())
    return h.hexdigest()[:16]


def _collate(records: Sequence[dict], idx: Sequence[int], pad_id: int, steps: int, remap: torch.Tensor):
    """Features [B, N, 3Ht], next tokens [B, N + steps - 1], and per step position p = t + 1 + i the target's top-k
    ([B, N + steps, k], ids remapped to draft rows, -1 outside) with the mask of positions that have one."""
    seqs = [records[i] for i in idx]
    n = max(len(r["input_ids"]) - 1 for r in seqs)
    k = seqs[0]["top_ids"].shape[1]
    feats = torch.zeros(len(seqs), n, seqs[0]["features"].shape[1], dtype=seqs[0]["features"].dtype)
    nxt = torch.full((len(seqs), n + steps), pad_id, dtype=torch.long)
    top_ids = torch.full((len(seqs), n + steps, k), -1, dtype=torch.long)
    top_logp = torch.zeros(len(seqs), n + steps, k)
    valid = torch.zeros(len(seqs), n + steps, dtype=torch.bool)
    for b, r in enumerate(seqs):
        ids, p = r["input_ids"].long(), r["prompt_len"]
        feats[b, :len(ids) - 1] = r["features"][:len(ids) - 1]  # a slice: rows left on disk read only these
        nxt[b, :len(ids) - 1] = ids[1:]
        a = len(r["top_ids"])  # prediction positions p - 1 .. p - 2 + a predict the answer tokens
        top_ids[b, p - 1:p - 1 + a] = remap[r["top_ids"].long()]
        top_logp[b, p - 1:p - 1 + a] = r["top_logp"].float()
        valid[b, p - 1:p - 1 + a] = True
    return feats, nxt, top_ids, top_logp, valid


def train_head(
    records: Sequence[dict],
    target_config: ModelConfig,
    embed: torch.Tensor,
    target_head: torch.Tensor,
    target_norm: torch.Tensor,
    draft_ids: torch.Tensor,
    state_path: Path,
    cfg: DistillConfig,
    budget_s: float | None = None,
    max_steps: int | None = None,
    resume: bool = True,
    progress: bool = True,
    on_step: Callable[[int, dict], None] | None = None,
    tag: str = "",
    pad_id: int = 0,
    evaluate: Callable[[Eagle3Module], dict] | None = None,
    evaluate_every_s: float = 300.0,
    init: dict[str, torch.Tensor] | None = None,
) -> tuple[Eagle3Module, dict]:
    """Train a head on teacher-forced `records` (with `features`, `top_ids`, `top_logp`); returns (module, stats).

    Budget, checkpoint/resume, schedule and progress bar as `train_draft` (build/distill.py) for the slice. With
    `evaluate` (module -> held-out metrics) the learning curve is measured every `evaluate_every_s` of training and
    returned as `stats["curve"]`: minutes, steps, answer tokens seen, held-out top-1 by draft depth. `init` (a
    head's state dict, `load_head_init`) replaces the starting weights when no training state is resumed.
    """
    from tqdm.auto import tqdm

    if budget_s is None and max_steps is None:
        raise ValueError("train_head needs budget_s or max_steps")
    if not records or "features" not in records[0]:
        raise ValueError("no training data with target features: teacher-force the answers with feature layers")
    cfg = replace(cfg, amp=cfg.amp and bf16_pays())  # read by the autocast below and by _SubsetHeadLoss
    torch.manual_seed(cfg.seed)
    model = Eagle3Module(target_config, draft_ids, cfg.head_init_std)
    model.init_from_target(target_head, target_norm)
    frozen = () if cfg.head_train_lm_head else ("lm_head.weight",)
    names = [n for n, _ in model.named_parameters() if n not in frozen]
    params = dict(model.named_parameters())
    for n, p in params.items():
        p.requires_grad_(n in names)
    opt = torch.optim.AdamW([params[n] for n in names], lr=cfg.head_lr, betas=cfg.betas,
                            weight_decay=cfg.weight_decay)
    # the draft vocabulary itself and the starting head, not only their sizes: a state trained on other ids (its
    # LM head rows under another id map, with --train-lm-head) or from another head is not this run's to continue
    meta = {"kind": "eagle3", "trainable": names, "records": len(records), "tag": tag, "vocab": _digest([draft_ids]),
            "init": None if init is None else _digest([init[n] for n in sorted(init)]), "ttt_steps": cfg.ttt_steps}
    resumed = _load_state(state_path, meta, ("kind", "trainable", "tag", "vocab", "init"), params, names, opt,
                          progress) if resume else None
    step, epoch, pos = resumed or (0, 0, 0)
    if init is not None and resumed is None:
        if not torch.equal(init.get("d2t", torch.zeros_like(model.d2t)), model.d2t):  # none: the full vocabulary
            raise ValueError("the starting head's draft vocabulary differs from this run's: pass its draft_ids")
        with torch.no_grad():  # frozen ones too: a head trained with --train-lm-head keeps its LM head rows
            for n, p in params.items():
                if n in init:
                    p.copy_(init[n].float())
    start_step = step
    remap = subset_remap(draft_ids.long(), target_config.vocab_size)
    embed_c = embed.detach().to(torch.bfloat16 if cfg.amp else torch.float32)
    batches = _batches(records, cfg.head_batch_tokens)
    if pos >= len(batches):
        epoch, pos = epoch + 1, 0
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if cfg.amp else contextlib.nullcontext()
    weights = [cfg.ttt_decay ** i for i in range(cfg.ttt_steps)]
    t0 = last_ckpt = time.monotonic()
    run = {"loss": 0.0, "kl": 0.0, "top1": 0.0, "top1_deep": 0.0}
    seen = 0
    bar = tqdm(total=round(budget_s) if budget_s else max_steps - start_step, disable=not progress,
               desc=f"train EAGLE-3 head (ttt {cfg.ttt_steps})", unit="s" if budget_s else "step",
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]")
    stopped_by = "budget"
    curve: list[dict] = []
    evaluating_s = 0.0  # time spent measuring the curve, not counted against the training budget
    last_eval = t0

    def measure() -> None:
        nonlocal evaluating_s, last_eval
        start = time.monotonic()
        model.eval()
        metrics = evaluate(model)
        model.train()
        curve.append({"minutes": round((start - t0 - evaluating_s) / 60, 2), "steps": step,
                      "answer_tokens_seen": seen, "heldout_top1": metrics["top1"],
                      "heldout_top1_by_step": metrics["top1_by_step"]})
        evaluating_s += time.monotonic() - start
        last_eval = time.monotonic()

    model.train()
    try:
        while True:
            if evaluate is not None and (not curve or time.monotonic() - last_eval > evaluate_every_s):
                measure()
            elapsed = time.monotonic() - t0 - evaluating_s
            if max_steps is not None and step >= max_steps:
                stopped_by = "max_steps"
                break
            if budget_s is not None and elapsed >= budget_s:
                break
            prog = step / max_steps if max_steps is not None else elapsed / budget_s
            for grp in opt.param_groups:
                grp["lr"] = cfg.head_lr * _lr_factor(cfg, step, prog)
            order = torch.randperm(len(batches), generator=torch.Generator().manual_seed(cfg.seed + epoch))
            feats, nxt, top_ids, top_logp, valid = _collate(records, batches[int(order[pos])], pad_id,
                                                            cfg.ttt_steps, remap)
            n = feats.shape[1]
            with amp:  # bf16 features in fp32: exact, and what fp32 training (no bf16 arithmetic here) needs
                outs = model.unroll(feats.float(), nxt, embed_c, cfg.ttt_steps)
            loss = torch.zeros(())
            totals = torch.zeros(4)
            hits, rows = [], []
            for i, h in enumerate(outs):
                sel = valid[:, 1 + i:1 + i + n]
                if not sel.any():
                    continue
                with amp:
                    hn = model.norm(h[sel])
                m = int(sel.sum())
                part_loss, sums = _SubsetHeadLoss.apply(hn, model.lm_head.weight, top_ids[:, 1 + i:1 + i + n][sel],
                                                        top_logp[:, 1 + i:1 + i + n][sel], cfg,
                                                        cfg.head_train_lm_head)
                loss = loss + weights[i] * part_loss / m
                if i == 0:
                    totals = sums / m
                hits.append(float(sums[3]))
                rows.append(m)
            loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_([params[n_] for n_ in names], cfg.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            pos += 1
            seen += int(valid.sum())
            if pos >= len(batches):
                epoch, pos = epoch + 1, 0
            m = {"loss": float(loss.detach()), "kl": float(totals[1]), "top1": float(totals[3]),
                 "top1_deep": sum(hits[1:]) / max(sum(rows[1:]), 1)}
            for k_, v in m.items():
                run[k_] = v if step == start_step + 1 else 0.9 * run[k_] + 0.1 * v
            if on_step is not None:
                on_step(step, dict(run))
            now = time.monotonic()
            if budget_s:
                bar.n = min(round(now - t0 - evaluating_s), bar.total)
            else:
                bar.update(1)
            bar.set_postfix_str(f"step {step} loss {run['loss']:.3f} top1 {run['top1']:.2f} "
                                f"deeper {run['top1_deep']:.2f}")
            if now - last_ckpt > cfg.checkpoint_every_s:
                _save_state(state_path, model, names, opt, step, epoch, pos, meta, finished=False)
                last_ckpt = now
    except KeyboardInterrupt:
        _save_state(state_path, model, names, opt, step, epoch, pos, meta, finished=False)
        bar.close()
        raise
    bar.close()
    _save_state(state_path, model, names, opt, step, epoch, pos, meta, finished=True)
    if evaluate is not None and curve[-1]["steps"] != step:
        measure()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    stats = {"steps": step, "autocast_bf16": cfg.amp, "steps_this_run": step - start_step,
             "resumed_from_step": start_step, "train_s": round(time.monotonic() - t0, 1),
             "answer_tokens_this_run": seen, "epochs": round(epoch + pos / len(batches), 2),
             "batches_per_epoch": len(batches), "stopped_by": stopped_by,
             "final_running": {k_: round(v, 4) for k_, v in run.items()}}
    if evaluate is not None:
        stats["curve"] = curve
    return model, stats


@torch.inference_mode()
def evaluate_head(model: Eagle3Module, records: Sequence[dict], embed: torch.Tensor, steps: int = 3,
                  batch_tokens: int = 4096, pad_id: int = 0) -> dict:
    """Agreement with the target at every answer position: `top1`/`top3` at step 0 (the first draft level: the
    target's argmax is the head's top-1 / in its top 3, as `evaluate` measures the slice), `top1_by_step` for
    steps 0..steps-1 (a chain of i true tokens drafted from the head's own outputs), `kl`, `coverage`."""
    model.eval()
    cfg = DistillConfig()
    remap = subset_remap(model.draft_ids, model.config.vocab_size)
    hit1 = [0] * steps
    rows = [0] * steps
    hit3 = inside = 0
    kl_sum = 0.0
    for idx in _batches(records, batch_tokens):
        feats, nxt, top_ids, top_logp, valid = _collate(records, idx, pad_id, steps, remap)
        n = feats.shape[1]
        outs = model.unroll(feats.float(), nxt, embed.float(), steps)
        for i, h in enumerate(outs):
            sel = valid[:, 1 + i:1 + i + n]
            logits = model.lm_head(model.norm(h[sel])).float()
            want = top_ids[:, 1 + i:1 + i + n][sel]
            top3 = logits.topk(3, dim=-1).indices
            hit1[i] += int((top3[:, 0] == want[:, 0]).sum())
            rows[i] += len(want)
            if i == 0:
                hit3 += int((top3 == want[:, :1]).any(-1).sum())
                inside += int((want[:, 0] >= 0).sum())
                kl_sum += float(distill_loss(logits, want, top_logp[:, 1:1 + n][sel], cfg)[0][1])
    n0 = max(rows[0], 1)
    return {"tokens": rows[0], "top1": round(hit1[0] / n0, 4), "top3": round(hit3 / n0, 4),
            "kl": round(kl_sum / n0, 4), "coverage": round(inside / n0, 4),
            "top1_by_step": [round(h / max(r, 1), 4) for h, r in zip(hit1, rows, strict=True)]}


def load_head_init(head_dir: Path, target: ModelConfig, feature_layers: Sequence[int]) -> dict[str, torch.Tensor]:
    """The state dict of an EAGLE-3 head in `head_dir` to continue training from (`train_head(init=...)`), checked
    against the target it will train for: hidden sizes and feature layers. Raises ValueError saying what differs."""
    config_path, weights = Path(head_dir) / "config.json", Path(head_dir) / "model.safetensors"
    if not (config_path.is_file() and weights.is_file()):
        raise ValueError(f"--init-from {head_dir}: not an EAGLE-3 head (config.json and model.safetensors needed)")
    config = json.loads(config_path.read_text())
    layers = config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    if config.get("architectures") != [ARCHITECTURE] or config.get("target_hidden_size") != target.hidden_size:
        raise ValueError(f"--init-from {head_dir}: not an EAGLE-3 head for a target of hidden size "
                         f"{target.hidden_size}")
    if list(layers or ()) != [int(j) for j in feature_layers]:
        raise ValueError(f"--init-from {head_dir}: reads target layers {layers}, this target's head reads "
                         f"{list(feature_layers)}")
    if config.get("vocab_size") != target.vocab_size:
        raise ValueError(f"--init-from {head_dir}: made for a vocabulary of {config.get('vocab_size')} ids, this "
                         f"target has {target.vocab_size}")
    return load_file(weights)


def save_head(model: Eagle3Module, target: Path, out_dir: Path, feature_layers: Sequence[int],
              extra: dict | None = None) -> Path:
    """Write the head in SpecForge's EAGLE-3 layout (config.json + model.safetensors, no embed_tokens: the target's
    is used) plus the target's tokenizer files, so it is a draft for that target like any other."""
    target, out_dir = Path(target), Path(out_dir)
    raw = json.loads((target / "config.json").read_text())
    c = model.config
    config = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": raw.get("rope_scaling"),
        "rope_parameters": raw.get("rope_parameters"),  # transformers 5 writes scaled RoPE here only
        "max_position_embeddings": raw.get("max_position_embeddings", 2048), "vocab_size": c.vocab_size,
        "draft_vocab_size": len(model.d2t), "target_hidden_size": model.fc.weight.shape[1] // 3,
        "tie_word_embeddings": False, "torch_dtype": "float32",
        "bos_token_id": raw.get("bos_token_id"), "eos_token_id": raw.get("eos_token_id"),
        "pad_token_id": raw.get("pad_token_id"),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [int(j) for j in feature_layers]},
        "spectrt_draft": {"kind": "eagle3", **(extra or {})},
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "model.safetensors.tmp"
    save_file(state, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (target / name).is_file():
            shutil.copy(target / name, out_dir / name)
    return out_dir


__all__ = ["Eagle3Module", "default_feature_layers", "evaluate_head", "head_config", "load_head_init", "save_head",
           "train_head"]
