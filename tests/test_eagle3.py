"""EAGLE-3 feature head: target features from every engine, SpecForge's checkpoint layout, greedy tree decoding with
the head == AR, training, shipped answers.

A tiny random LLaMA (tests/test_draft.py `make_tiny_target`) carries the head and decoding tests; the feature tests
and the shipped answers use the real embedded target.
"""

from __future__ import annotations

import gc
import json
import math
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from spectrt.build import corpus as C
from spectrt.build import draft as D
from spectrt.build import eagle3 as B
from spectrt.build.distill import GREEDY_ANSWERS, DistillConfig
from spectrt.runtime.decoding.propose import Eagle3Proposer, gather_rows
from spectrt.runtime.decoding.sampling import top_tokens
from spectrt.runtime.decoding.tree import Tree, greedy_accept
from spectrt.runtime.engines.eagle3 import Eagle3Head, default_feature_layers, is_eagle3
from spectrt.runtime.engines.kernels import native_unavailable
from spectrt.runtime.engines.model import ModelConfig, Transformer
from test_draft import TINY, _corpus_lines, make_tiny_target

SPECFORGE_WEIGHTS = {
    "fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "midlayer.input_layernorm.weight",
    "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight", "norm.weight", "lm_head.weight",
    "d2t", "t2d",
}


def _causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp("tiny") / "target", layers=4)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[Path, Path]:
    lines = _corpus_lines()
    d = tmp_path_factory.mktemp("corpus")
    (d / "train.txt").write_text("\n".join(lines[:150]) + "\n")
    (d / "heldout.txt").write_text("\n".join(lines[-12:]) + "\n")
    return d / "train.txt", d / "heldout.txt"


@pytest.fixture(scope="module")
def trained(tiny, corpora, tmp_path_factory) -> Path:
    """One short real EAGLE-3 run on the tiny target (shared by the decoding and report tests)."""
    out = tmp_path_factory.mktemp("run") / "head"
    return D.make_draft(tiny, out, kind="eagle3", budget_minutes=3, prompts=corpora[0], heldout=corpora[1],
                        max_steps=60, progress=False, **{**TINY, "head_batch_tokens": 1024})


# ------------------------------------------------------------------------------------------- features


def _assert_close_rows(got: torch.Tensor, want: torch.Tensor, blocks: int) -> None:
    """Each row's feature block within 1e-4 of its largest value (the logit tolerance of tests/test_kernels.py)."""
    g, w = got.view(len(got), blocks, -1), want.view(len(want), blocks, -1)
    scale = w.abs().amax(-1, keepdim=True)
    assert ((g - w).abs() <= 1e-4 * scale + 1e-5).all(), float(((g - w).abs() / scale).max())


def test_features_equal_the_reference_hidden_states(target_dir):
    """torch engine == transformers' hidden_states exactly; native forward within tolerance, for a chunk and a tree
    over a prefix, through forward_many with two segments."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    engines = {"torch": Transformer.load(target_dir, native=False, measure_kernels=False),
               "native": Transformer.load(target_dir, native=True)}
    layers = default_feature_layers(engines["torch"].config.num_layers)
    assert layers == (2, 15, 27)
    prompt = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 28])
    tree = Tree.from_expansion((2, 2))  # 7 nodes after the prompt: siblings share positions
    tree_tokens = torch.tensor([28, 411, 253, 3365, 198, 11173, 359])
    n = len(prompt)
    want_prompt = torch.cat([h[0] for h in
                             (hf(prompt[None], output_hidden_states=True).hidden_states[j] for j in layers)], -1)
    want_tree = []
    for i in range(len(tree)):  # each node's features = those of its own path decoded causally
        path = [i]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        seq = torch.cat([prompt, tree_tokens[path[::-1]]])
        out = hf(seq[None], output_hidden_states=True).hidden_states
        want_tree.append(torch.cat([out[j][0, -1] for j in layers]))
    want_tree = torch.stack(want_tree)
    for name, engine in engines.items():
        caches = engine.new_caches(2, 64, 16)
        logits, feats = engine.forward_features([(prompt, torch.arange(n), _causal(n), caches[0]),
                                                 (prompt[:5], torch.arange(5), _causal(5), caches[1])], layers)
        assert feats[0].shape == (n, 3 * 576) and feats[0].dtype == torch.float32
        if name == "torch":
            assert torch.equal(feats[0], want_prompt)
        _assert_close_rows(feats[0], want_prompt, 3)
        _assert_close_rows(feats[1], want_prompt[:5], 3)
        caches[0].commit(n)
        _, (tree_feats,) = engine.forward_features([(tree_tokens, tree.positions(n), tree.mask, caches[0])], layers)
        _assert_close_rows(tree_feats, want_tree, 3)
        plain = engine.forward_many([(tree_tokens, tree.positions(n), tree.mask, caches[0])])[0]
        assert torch.equal(plain, engine.forward_features([(tree_tokens, tree.positions(n), tree.mask, caches[0])],
                                                          layers)[0][0])  # logits unchanged by asking for features
    with pytest.raises(ValueError, match=r"feature layers must lie in \[0, 30\]"):
        engines["native"].forward_features([(prompt, torch.arange(n), _causal(n), caches[0])], [2, 31, 4])


def test_native_features_are_row_invariant(target_dir):
    """A tree row's features are bitwise those of its node decoded alone (the verify forward's features are what the
    head reads after acceptance, so they must not depend on the tree's shape)."""
    engine = Transformer.load(target_dir, native=True)
    layers = default_feature_layers(engine.config.num_layers)
    prompt = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356])
    tree = Tree.from_expansion((3, 2))
    tokens = torch.tensor([28, 411, 253, 3365, 198, 11173, 359, 2683, 5646, 28])[:len(tree)]
    cache = engine.new_cache(64, 16)
    engine.forward(prompt, torch.arange(len(prompt)), _causal(len(prompt)), cache)
    cache.commit(len(prompt))
    _, (tree_feats,) = engine.forward_features([(tokens, tree.positions(len(prompt)), tree.mask, cache)], layers)
    for i in range(len(tree)):
        path = [i]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        path = path[::-1]
        chain = engine.new_cache(64, 16)
        engine.forward(prompt, torch.arange(len(prompt)), _causal(len(prompt)), chain)
        chain.commit(len(prompt))
        sub = torch.tensor(path)
        _, (alone,) = engine.forward_features(
            [(tokens[sub], tree.positions(len(prompt))[sub], _causal(len(path)), chain)], layers)
        assert torch.equal(alone[-1], tree_feats[i]), i


# ------------------------------------------------------------------------------------------- layout


def _random_module(target: Transformer, k: int = 100, seed: int = 0) -> B.Eagle3Module:
    torch.manual_seed(seed)
    ids = torch.randperm(target.config.vocab_size)[:k].sort().values
    module = B.Eagle3Module(target.config, ids, init_std=0.2)
    with torch.no_grad():
        for p in module.parameters():  # norms away from 1 so the test sees them
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return module.eval()


def _chain_logits(head: Eagle3Head, target: Transformer, layers, ids: torch.Tensor, root: int, depth: int):
    """Runtime logits of drafting a chain of true tokens `ids[root + 1 : root + 1 + depth]` after catching the head up
    on the target's features of positions 0..root - 1 (rows for tokens 1..root)."""
    cache_t = target.new_cache(128, 32)
    _, (feats,) = target.forward_features([(ids[:root], torch.arange(root), _causal(root), cache_t)], layers)
    cache = head.new_cache(128, 32)
    logits, hidden = head.forward(ids[1:root + 1], torch.arange(1, root + 1), _causal(root), cache,
                                  head.project(feats))
    cache.commit(root)
    out, g = [logits[-1]], hidden[-1:]
    for d in range(1, depth):
        tok = ids[root + d:root + d + 1]
        mask = torch.ones(1, d, dtype=torch.bool)
        logits, g = head.forward(tok, torch.tensor([root + d]), mask, cache, g)
        out.append(logits[-1])
    return torch.stack(out)


def test_specforge_layout_round_trip(tiny, tmp_path):
    """save_head writes SpecForge's names and config; the runtime head loads it and computes the training module's
    logits, for target-feature rows (step 0) and for chain rows drafted from its own outputs (steps 1, 2)."""
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    layers = default_feature_layers(target.config.num_layers)
    module = _random_module(target)
    out = B.save_head(module, tiny, tmp_path / "head", layers, {"note": "test"})
    state = load_file(out / "model.safetensors")
    assert set(state) == SPECFORGE_WEIGHTS
    assert state["lm_head.weight"].shape == (100, 64) and state["fc.weight"].shape == (64, 3 * 64)
    assert state["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # attention input: embedding + hidden (2H)
    assert state["t2d"].dtype == torch.bool and int(state["t2d"].sum()) == 100
    assert torch.equal(torch.arange(100) + state["d2t"], module.draft_ids)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 100 and config["target_hidden_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(layers) and is_eagle3(out)
    assert (out / "tokenizer.json").is_file()

    head = Eagle3Head.load(out, target)
    ids = torch.tensor([1, 40, 41, 42, 43, 7, 99, 250, 8, 13, 300, 301])
    root, depth = 8, 3
    runtime = _chain_logits(head, target, layers, ids, root, depth)
    _, (feats,) = target.forward_features([(ids, torch.arange(len(ids)), _causal(len(ids)),
                                            target.new_cache(64, 16))], layers)
    with torch.no_grad():
        hs = module.unroll(feats[None, :root], ids[None, 1:root + depth], target.embed, depth)
        trained = torch.stack([module.lm_head(module.norm(h[0, root - 1])) for h in hs])
    assert torch.isinf(runtime).sum(-1).tolist() == [384 - 100] * depth  # -inf outside the draft vocabulary
    torch.testing.assert_close(runtime[:, module.draft_ids], trained, rtol=1e-4, atol=1e-4)


def _reference_row(w: dict, embed: torch.Tensor, tok: torch.Tensor, g: torch.Tensor, k_all, v_all, q_pos: int,
                   eps: float, heads: int, kv_heads: int, theta: float):
    """EAGLE-3's layer for one query row written out from the paper's equations, independent of engines/eagle3.py."""
    def rms(x, weight):
        return weight * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):
        d = x.shape[-1]
        inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
        ang = pos.float()[:, None] * inv
        c, s = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        return x * c + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * s

    a = torch.cat([rms(embed[tok], w["midlayer.input_layernorm.weight"]), rms(g, w["midlayer.hidden_norm.weight"])])
    d = w["midlayer.self_attn.o_proj.weight"].shape[1] // heads
    q = (w["midlayer.self_attn.q_proj.weight"] @ a).view(heads, d)
    k = (w["midlayer.self_attn.k_proj.weight"] @ a).view(kv_heads, d)
    v = (w["midlayer.self_attn.v_proj.weight"] @ a).view(kv_heads, d)
    q = rope(q, torch.tensor([q_pos]).expand(heads))
    k = rope(k, torch.tensor([q_pos]).expand(kv_heads))
    keys = torch.cat([k_all, k[:, None]], 1)  # [kv_heads, L + 1, d]
    vals = torch.cat([v_all, v[:, None]], 1)
    rep = heads // kv_heads
    att = torch.stack([torch.softmax(keys[h // rep] @ q[h] / math.sqrt(d), -1) @ vals[h // rep] for h in range(heads)])
    h = g + w["midlayer.self_attn.o_proj.weight"] @ att.reshape(-1)
    x = rms(h, w["midlayer.post_attention_layernorm.weight"])
    h = h + w["midlayer.mlp.down_proj.weight"] @ (F.silu(w["midlayer.mlp.gate_proj.weight"] @ x)
                                                  * (w["midlayer.mlp.up_proj.weight"] @ x))
    return w["lm_head.weight"] @ rms(h, w["norm.weight"]), h, keys, vals


def test_handmade_specforge_checkpoint_loads(tiny, tmp_path):
    """A head written by hand in SpecForge's layout (no embed_tokens, no layer ids: the defaults, pytorch_model.bin
    as older releases ship it) loads through Eagle3Head and computes the EAGLE-3 equations."""
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    hsz, heads, kv, d, inter, kd = 64, 4, 2, 16, 128, 50
    g = torch.Generator().manual_seed(1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    draft = torch.randperm(384, generator=g)[:kd].sort().values
    t2d = torch.zeros(384, dtype=torch.bool)
    t2d[draft] = True
    w = {"fc.weight": rnd(hsz, 3 * hsz), "midlayer.self_attn.q_proj.weight": rnd(heads * d, 2 * hsz),
         "midlayer.self_attn.k_proj.weight": rnd(kv * d, 2 * hsz),
         "midlayer.self_attn.v_proj.weight": rnd(kv * d, 2 * hsz),
         "midlayer.self_attn.o_proj.weight": rnd(hsz, heads * d), "midlayer.mlp.gate_proj.weight": rnd(inter, hsz),
         "midlayer.mlp.up_proj.weight": rnd(inter, hsz), "midlayer.mlp.down_proj.weight": rnd(hsz, inter),
         "midlayer.input_layernorm.weight": 1 + rnd(hsz), "midlayer.hidden_norm.weight": 1 + rnd(hsz),
         "midlayer.post_attention_layernorm.weight": 1 + rnd(hsz), "norm.weight": 1 + rnd(hsz),
         "lm_head.weight": rnd(kd, hsz), "d2t": draft - torch.arange(kd), "t2d": t2d}
    out = tmp_path / "specforge-head"
    out.mkdir()
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hsz,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "vocab_size": 384,
              "draft_vocab_size": kd, "hidden_act": "silu", "max_position_embeddings": 2048, "torch_dtype": "float16",
              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    (out / "config.json").write_text(json.dumps(config))
    torch.save({k: (v.half() if v.is_floating_point() else v) for k, v in w.items()}, out / "pytorch_model.bin")
    w = {k: (v.half().float() if v.is_floating_point() else v) for k, v in w.items()}

    head = Eagle3Head.load(out, target)
    assert head.feature_layers == (2, 2, 1)  # default_feature_layers(4): (2, L // 2, L - 3)
    torch.testing.assert_close(head.head_ids, draft)
    feats = rnd(3, 3 * hsz)
    tokens = torch.tensor([5, 77, 300])
    cache = head.new_cache(32, 8)
    logits, hidden = head.forward(tokens, torch.tensor([4, 5, 6]), _causal(3), cache, head.project(feats))
    keys = torch.zeros(kv, 0, d)
    vals = torch.zeros(kv, 0, d)
    for r in range(3):
        want, h, keys, vals = _reference_row(w, target.embed, tokens[r], w["fc.weight"] @ feats[r], keys, vals, 4 + r,
                                             1e-5, heads, kv, 10000.0)
        torch.testing.assert_close(logits[r, draft], want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(hidden[r], h, rtol=1e-4, atol=1e-4)
    assert (logits[:, ~t2d] == -torch.inf).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_head_matches_the_reference(tiny, tmp_path, dtype):
    """The native head forward (one C++ call per level; bf16 weights with fp32 arithmetic) = the fp32 torch path on
    the same (bf16-representable) weights, for catch-up rows and a tree level; batched segments = separate forwards,
    bitwise (row invariance)."""
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    module = _random_module(target)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.bfloat16().float())
    out = B.save_head(module, tiny, tmp_path / "head", (2, 2, 1))
    heads = {False: Eagle3Head.load(out, target, torch.float32, native=False),
             True: Eagle3Head.load(out, target, dtype, native=True)}
    feats = torch.randn(6, 3 * 64, generator=torch.Generator().manual_seed(3))
    tokens, tree = torch.tensor([5, 77, 300, 12, 9, 41]), Tree.from_expansion((2, 1))
    results = {}
    for native, head in heads.items():
        caches = head.new_caches(2, 64, 8)
        logits, hidden = head.forward(tokens, torch.arange(1, 7), _causal(6), caches[0], head.project(feats))
        caches[0].commit(6)
        level = head.forward_many([(torch.tensor([8, 9, 10, 11]), torch.tensor([7, 7, 8, 8]), tree.mask[1:, 1:],
                                    caches[0], hidden[[5, 5, 0, 1]]),
                                   (tokens[:3], torch.arange(1, 4), _causal(3), caches[1], head.project(feats[:3]))])
        results[native] = (logits, hidden, level)
    tol = {"rtol": 1e-4, "atol": 1e-4}
    (ref_logits, ref_hidden, ref_level), (nat_logits, nat_hidden, nat_level) = results[False], results[True]
    ids = heads[True].head_ids
    torch.testing.assert_close(nat_logits[:, ids], ref_logits[:, ids], **tol)
    torch.testing.assert_close(nat_hidden, ref_hidden, **tol)
    for (a, b), (c, d) in zip(nat_level, ref_level, strict=True):
        torch.testing.assert_close(a[:, ids], c[:, ids], **tol)
        torch.testing.assert_close(b, d, **tol)
    assert torch.equal(nat_level[1][0], nat_logits[:3]) and torch.equal(nat_level[1][1], nat_hidden[:3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_projects_target_features_itself(tiny, tmp_path, dtype):
    """Segments whose inputs are target features (the loop's catch-up rows) give what `project` then the forward
    gives, bitwise on the native head (fc runs inside its one call) and on the torch path; features mixed with
    hidden inputs in one call are refused with the widths named."""
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    out = B.save_head(_random_module(target), tiny, tmp_path / "head", (2, 2, 1))
    feats = torch.randn(7, 3 * 64, generator=torch.Generator().manual_seed(5))
    tokens = torch.tensor([5, 77, 300, 12, 9, 41, 3])
    for native in (False, True) if native_unavailable() is None else (False,):
        head = Eagle3Head.load(out, target, dtype if native else torch.float32, native=native)
        results = []
        for project in (True, False):
            caches = head.new_caches(2, 64, 8)
            first, rest = (head.project(feats[:4]), head.project(feats[4:])) if project else (feats[:4], feats[4:])
            results.append(head.forward_many([(tokens[:4], torch.arange(1, 5), _causal(4), caches[0], first),
                                              (tokens[4:], torch.arange(1, 4), _causal(3), caches[1], rest)],
                                             full_vocab=False))
            assert caches[0].k.abs().sum() > 0
        for (a, b), (c, d) in zip(*results, strict=True):
            assert torch.equal(a, c) and torch.equal(b, d)
        caches = head.new_caches(2, 64, 8)
        with pytest.raises(ValueError, match="target features"):
            head.forward_many([(tokens[:2], torch.arange(1, 3), _causal(2), caches[0], feats[:2]),
                               (tokens[2:4], torch.arange(1, 3), _causal(2), caches[1], head.project(feats[2:4]))])


def test_head_logit_rows_keep_the_hidden_of_every_row(tiny, tmp_path):
    """A catch-up drafts from its last row: with `logit_rows` the head computes that row's logits only (none for a
    prompt chunk), bitwise the full call's, while every row's output hidden (the children's input) is unchanged."""
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    out = B.save_head(_random_module(target), tiny, tmp_path / "head", (2, 2, 1))
    feats = torch.randn(7, 3 * 64, generator=torch.Generator().manual_seed(6))
    tokens = torch.tensor([5, 77, 300, 12, 9, 41, 3])
    for native in (False, True) if native_unavailable() is None else (False,):
        head = Eagle3Head.load(out, target, native=native)
        results = []
        for logit_rows in (None, [1, 0]):
            caches = head.new_caches(2, 64, 8)
            results.append(head.forward_many([(tokens[:4], torch.arange(1, 5), _causal(4), caches[0], feats[:4]),
                                              (tokens[4:], torch.arange(1, 4), _causal(3), caches[1], feats[4:])],
                                             full_vocab=False, logit_rows=logit_rows))
        (full_a, hidden_a), (full_b, hidden_b) = results[0]
        (cut_a, cut_hidden_a), (cut_b, cut_hidden_b) = results[1]
        assert cut_a.shape == (1, 100) and torch.equal(cut_a, full_a[-1:]) and cut_b.shape == (0, 100)
        assert torch.equal(cut_hidden_a, hidden_a) and torch.equal(cut_hidden_b, hidden_b)


def test_the_proposer_reads_draft_vocabulary_columns(tiny, tmp_path):
    """The loop reads a head's draft-vocabulary logits (no 384- or 49k-wide -inf rows to fill and scan): they are the
    full rows' columns at head_ids, bitwise, on both paths; their top-k as target ids is the full rows' top-k."""
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    out = B.save_head(_random_module(target), tiny, tmp_path / "head", (2, 2, 1))
    feats = torch.randn(5, 3 * 64, generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor([5, 77, 300, 12, 9])
    for native in (False, True) if native_unavailable() is None else (False,):
        head = Eagle3Head.load(out, target, native=native)
        rows = {}
        for full in (True, False):
            rows[full] = head.forward(tokens, torch.arange(1, 6), _causal(5), head.new_cache(32, 8),
                                      head.project(feats), full_vocab=full)
        (sub, sub_hidden), (full_rows, full_hidden) = rows[False], rows[True]
        assert sub.shape == (5, 100) and torch.equal(sub, full_rows[:, head.head_ids])
        assert torch.equal(sub_hidden, full_hidden) and torch.equal(head.full_rows(sub), full_rows)
        proposer = Eagle3Proposer(head, 1, 32, 8, target)
        (toks, probs), (want_toks, want_probs) = proposer._top(sub, 3), top_tokens(full_rows, 3)
        assert toks == want_toks
        assert all(r == pytest.approx(w, rel=1e-6) for r, w in zip(probs, want_probs, strict=True))


def test_a_full_vocabulary_head_gives_the_proposer_the_rows_it_asks_for(tiny, tmp_path):
    """A head over the whole vocabulary (`--vocab-subset 0`, or a SpecForge head without `d2t`) returns the logits of
    the rows the proposer names: a catch-up of five rows drafts from its last row. (Passed by position, the rows
    landed in the head's `full_vocab` and every row came back: drafting then read the first, an earlier position.)"""
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    out = B.save_head(_random_module(target, k=target.config.vocab_size), tiny, tmp_path / "head", (2, 2, 1))
    feats = torch.randn(6, 3 * 64, generator=torch.Generator().manual_seed(5))
    ids = [5, 77, 300, 12, 9, 41]
    for native in (False, True) if native_unavailable() is None else (False,):
        head = Eagle3Head.load(out, target, native=native)
        proposer = Eagle3Proposer(head, 1, 32, 8, target)
        assert proposer.vocab_ids is None  # the whole vocabulary: no subset columns
        proposer.take(0, 0, feats)
        seg = proposer.chunk(0, ids, len(ids))
        assert seg.tokens.shape[0] == 5
        (last,) = proposer._run([seg], [1])
        every = head.forward(seg.tokens, seg.positions, seg.tree_mask, head.new_cache(32, 8), seg.hidden)[0]
        assert last.shape[0] == 1 and torch.equal(last[0], every[-1])


def test_mismatched_heads_are_refused(tiny, tmp_path):
    target = Transformer.load(tiny, native=False, measure_kernels=False)
    out = B.save_head(_random_module(target), tiny, tmp_path / "head", (2, 2, 1))
    config = json.loads((out / "config.json").read_text())
    for change, message in (({"target_hidden_size": 128}, "128-wide target features"),
                            ({"vocab_size": 500}, "differs from the target's"),
                            ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 9, 1]}}, "must be 3 ids"),
                            ({"num_hidden_layers": 2}, "num_hidden_layers 1"),
                            ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 head")):
        (out / "config.json").write_text(json.dumps({**config, **change}))
        with pytest.raises(ValueError, match=message):
            Eagle3Head.load(out, target)
    (out / "config.json").write_text(json.dumps(config))
    state = load_file(out / "model.safetensors")
    state["d2t"][3] += 1000
    save_file(state, out / "model.safetensors")
    with pytest.raises(ValueError, match="d2t must map"):
        Eagle3Head.load(out, target)


# ------------------------------------------------------------------------------------------- decoding


def eagle_generate(target: Transformer, head: Eagle3Head, prompt: list[int], max_new: int, tree: Tree,
                   eos: int = 2) -> tuple[list[int], int, int]:
    """A minimal greedy tree-speculative loop with the head (the lead wires the head into runtime/decoding/decoder.py):
    verify with the target's features, catch the head up on the accepted tokens' true features, draft the static
    `tree` level by level from the head's own outputs. Returns (tokens, accepted draft tokens, target passes)."""
    layers, window = head.feature_layers, 32
    tcache, hcache = target.new_cache(256, window), head.new_cache(256, window)
    ids = list(prompt)
    p = len(ids)
    _, (pending,) = target.forward_features([(torch.tensor(ids[:-1]), torch.arange(p - 1), _causal(p - 1), tcache)],
                                            layers)
    tcache.commit(p - 1)
    out, accepted, passes = [], 0, 0
    while len(out) < max_new:
        n = tcache.length  # the root ids[-1] sits at position n; the head has rows for positions 1..hcache.length
        rows = torch.tensor(ids[hcache.length + 1:n + 1])
        logits, hidden = head.forward(rows, torch.arange(hcache.length + 1, n + 1), _causal(len(rows)), hcache,
                                      head.project(pending))
        hcache.commit(len(rows))
        node_tokens, node_hidden = [ids[-1]], {0: hidden[-1]}
        node_logits = {0: logits[-1]}
        for depth in range(1, tree.max_depth + 1):
            level = tree.levels[depth]
            for i in level:
                parent = tree.parents[i]
                rank = tree.children[parent].index(i)
                node_tokens.append(int(node_logits[parent].topk(rank + 1).indices[rank]))
            if depth < tree.max_depth:
                first, last = level[0], level[-1]
                lg, hd = head.forward(torch.tensor(node_tokens[first:last + 1]), torch.full((len(level),), n + depth),
                                      tree.mask[first:last + 1, 1:last + 1], hcache,
                                      torch.stack([node_hidden[tree.parents[i]] for i in level]))
                for j, i in enumerate(level):
                    node_logits[i], node_hidden[i] = lg[j], hd[j]
        tokens = torch.tensor(node_tokens)
        (tl,), (tf,) = target.forward_features([(tokens, tree.positions(n), tree.mask, tcache)], layers)
        passes += 1
        path, bonus = greedy_accept(tree, tokens.tolist(), tl.argmax(-1).tolist())
        tcache.compact(path)
        pending = tf[path]
        new = [node_tokens[i] for i in path[1:]] + [bonus]
        accepted += len(path) - 1
        if eos in new:
            new = new[:new.index(eos)]
            out.extend(new)
            break
        out.extend(new)
        ids.extend(new)
    return out[:max_new], accepted, passes


def _ar(target: Transformer, prompt: list[int], max_new: int, eos: int = 2) -> list[int]:
    cache = target.new_cache(256, 64)
    logits = target.forward(torch.tensor(prompt), torch.arange(len(prompt)), _causal(len(prompt)), cache)
    cache.commit(len(prompt))
    out = []
    while len(out) < max_new:
        tok = int(logits[-1].argmax())
        if tok == eos:
            break
        out.append(tok)
        logits = target.forward(torch.tensor([tok]), torch.tensor([cache.length]), torch.ones(1, 1, dtype=torch.bool),
                                cache)
        cache.commit(1)
    return out


@pytest.mark.parametrize("native", [False, True])
def test_greedy_tree_decoding_with_the_head_equals_autoregressive(tiny, trained, native):
    """The target verifies every drafted token: the head changes how many tokens a pass yields, never which."""
    target = Transformer.load(tiny, native=native, measure_kernels=False)
    head = Eagle3Head.load(trained, target)
    accepted = passes = 0
    for tree in (Tree.from_expansion((2, 2, 1)), Tree.from_expansion((1, 1, 1))):
        for prompt in ([1, 40, 41, 42, 43], [1, 7, 99, 250, 8, 13], [1, 300, 301, 302]):
            ar = _ar(target, prompt, 40)
            spec, acc, n = eagle_generate(target, head, prompt, 40, tree)
            assert spec == ar
            accepted, passes = accepted + acc, passes + n
    assert accepted > 0 and passes < 6 * 40  # the trained head is accepted: the loop is exercised


@pytest.mark.parametrize("native", [False, True])
def test_decoder_with_the_head_equals_autoregressive(tiny, trained, native):
    """The head through THE decode loop (Eagle3Proposer): static trees and dynamic trees, a batch of one and three
    requests batched, a prompt longer than the draft window (catch-up in chunks): greedy output == AR, and the head's
    tokens are accepted."""
    from spectrt.runtime.decoding.decoder import AUTO, Decoder, Job
    from spectrt.runtime.decoding.policy import Policy

    target = Transformer.load(tiny, native=native, measure_kernels=False)
    head = Eagle3Head.load(trained, target)
    prompts = [[1, 40, 41, 42, 43], [1, 7, 99, 250, 8, 13], [1, 300, 301, 302], [1] + list(range(50, 90))]
    want = [_ar(target, p, 30) for p in prompts]
    for tree in (Tree.from_expansion((2, 2, 1)), AUTO):
        for max_active in (1, 3):
            decoder = Decoder(target, head, {2}, max_seq_len=128, max_tree_tokens=16, max_active=max_active,
                              policy=Policy(suffix=False, verify_ms=((1, 1.0), (64, 1.0)),  # speculation pays
                                            draft_ms=((1, 1e-3), (64, 2e-3))))
            jobs = [Job(p, 30, tree=tree) for p in prompts]
            decoder.run(jobs)
            assert [j.out for j in jobs] == want, (tree, max_active)
            accepted = sum(sum(j.stats.accepted) for j in jobs)
            passes = sum(j.stats.target_passes for j in jobs)
            assert accepted > 0 and all(j.stats.draft_passes > 0 for j in jobs), (tree, max_active)
            assert passes + accepted >= sum(len(w) for w in want)  # every emitted token came from a pass


def test_pipeline_loads_a_head_through_draft(tiny, trained):
    """`--draft <EAGLE-3 dir>` (Pipeline): the head drafts for its target, greedy text equals the target alone."""
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.propose import Eagle3Proposer

    spec = Pipeline(tiny, trained, dtype="fp32", measure_kernels=False, max_seq_len=128)
    assert isinstance(spec.decoder.drafter, Eagle3Proposer)
    alone = Pipeline(tiny, None, dtype="fp32", measure_kernels=False, max_seq_len=128)
    for prompt in ("the cat sat on", "one two three"):
        got = spec.generate(prompt, 24, tree="2,2,1")
        assert got.token_ids == alone.generate(prompt, 24, tree=None).token_ids
        assert got.stats.draft_passes > 0
    # a loaded pipeline is frozen out of the cycle collector, and a dropped one is still freed (no reference cycle)
    assert gc.get_freeze_count() > 0
    decoder, head = weakref.ref(spec.decoder), weakref.ref(spec.decoder.drafter.engine)
    del spec
    assert decoder() is None and head() is None


def test_tune_without_a_cost_profile_times_a_head_draft(tiny, trained, tmp_path):
    """`spectrt tune` with no profile file measures the curves itself: a head's passes read hidden rows too, so it is
    timed as `spectrt profile` times it (called as a plain engine, it raised a TypeError)."""
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.tune import cost_curves

    pipe = Pipeline(tiny, trained, dtype="fp32", measure_kernels=False, max_seq_len=256, artifacts=tmp_path)
    verify, draft, source = cost_curves(pipe.decoder, tmp_path, tiny.name, "fp32")
    assert source == "measured by spectrt tune (no cost profile file)"
    assert draft is not None and 0 < draft(1) <= draft(16) and 0 < verify(1) <= verify(64)


def test_tune_prices_a_draft_with_a_profile_only_of_its_shape(tiny, trained, tmp_path):
    """A cost profile records the shape of the draft it timed: `spectrt tune` with another draft (a head after a
    profile of the sliced draft) keeps the profile's target costs and times the draft itself, and leaves the
    profile's batched draft table out; with the same shape it reads both from the profile."""
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.profile import cost_profile_path, draft_shape
    from spectrt.runtime.decoding.tune import batched_tables, cost_curves

    pipe = Pipeline(tiny, trained, dtype="fp32", measure_kernels=False, max_seq_len=256, artifacts=tmp_path)
    table = {"1": {"1": 1.0, "2": 1.5}, "2": {"2": 2.0, "4": 2.5}}
    profile = {"target": {"128": {"1": 10.0, "8": 20.0, "64": 90.0}}, "draft": {"128": {"1": 77.0, "16": 99.0}},
               "target_batched": {"128": table}, "draft_batched": {"128": table}}
    path = cost_profile_path(tiny, "fp32", tmp_path)
    for shape, profiled in (({**draft_shape(trained), "hidden_size": 1}, False), (draft_shape(trained), True)):
        path.write_text(json.dumps({**profile, "draft_shape": shape}))
        verify, draft, source = cost_curves(pipe.decoder, tmp_path, tiny.name, "fp32", trained)
        assert verify(8) == 20.0 and (draft(1) == 77.0) == profiled and str(path) in source
        tables = batched_tables(tmp_path, tiny.name, "fp32", True, trained)
        assert "verify_batched" in tables and ("draft_batched" in tables) == profiled


def test_tune_measures_a_further_drafted_requests_host_work_at_batch(tiny, trained, tmp_path):
    """`further_host_ms` decodes batches with every request drafting (the gate told the draft is sure and free) and
    the same batches plainly, then restores the decoder's policy; below a batch of 2 it measures nothing."""
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.tune import further_host_ms

    pipe = Pipeline(tiny, trained, dtype="fp32", measure_kernels=False, max_seq_len=256, artifacts=tmp_path,
                    max_active=2, prefix_cache=False)
    decoder, policy = pipe.decoder, pipe.decoder.controller.policy
    ids = [pipe.encode(p) for p in ("Name a color.", "Count to five.", "Say hi.")]
    drafted, own = [], decoder.drafter.propose
    decoder.drafter.propose = lambda cands, *rest: (drafted.append(len(cands)), own(cands, *rest))[1]
    more = further_host_ms(decoder, ids, policy, 8, first_ms=0.0)
    assert more is not None and more >= 0.0
    assert max(drafted) == 2  # one batch of 2, both requests drafting in a step
    assert decoder.controller.policy is policy
    alone = Pipeline(tiny, trained, dtype="fp32", measure_kernels=False, max_seq_len=256, artifacts=tmp_path)
    assert further_host_ms(alone.decoder, ids, policy, 8, first_ms=0.0) is None


def test_sampled_trees_with_the_head_draw_from_full_vocabulary_rows(tiny, trained, monkeypatch):
    """Sampling with a head: children are drawn from the draft's q as full-vocabulary rows (zero outside the head's
    vocabulary), the verify rule gets q of the target's width, and seeded requests decode alike run twice."""
    from spectrt.runtime.decoding import propose
    from spectrt.runtime.decoding.pipeline import Pipeline
    from spectrt.runtime.decoding.sampling import SamplingParams

    pipe = Pipeline(tiny, trained, dtype="fp32", measure_kernels=False, max_seq_len=128)
    widths, real = [], propose.draw_children
    monkeypatch.setattr(propose, "draw_children", lambda q, k, gen: (widths.append(tuple(q.shape)), real(q, k, gen))[1])
    params = SamplingParams(temperature=1.0, seed=7)
    runs = [pipe.generate("the cat sat on", 16, tree="2,2", params=params) for _ in range(2)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].stats.draft_passes > 0
    assert widths and all(w[-1] == 384 for w in widths)


# ------------------------------------------------------------------------------------------- training


def test_eagle3_training_improves_heldout_agreement(trained):
    report = json.loads((trained / D.REPORT_NAME).read_text())
    assert report["kind"] == "eagle3"
    before, after = report["heldout"]["untrained"], report["heldout"]["distilled"]
    # the tiny random target is hard to predict (a sharp 4-layer net): 60 steps halve the KL
    assert after["top1"] > before["top1"] + 0.015 and after["kl"] < 0.7 * before["kl"], (before, after)
    assert len(after["top1_by_step"]) == 3 and after["top1_by_step"][0] == after["top1"]
    assert report["train"]["steps"] == 60 and report["train"]["stopped_by"] == "max_steps"
    assert report["data"]["teacher_forcing"]["feature_layers"] == [2, 2, 1]
    assert is_eagle3(trained) and set(load_file(trained / "model.safetensors")) == SPECFORGE_WEIGHTS


def test_eagle3_resume_continues(tiny, corpora, tmp_path):
    cfg = DistillConfig(**{**TINY, "max_new_tokens": 16, "checkpoint_every_s": 1e9, "head_batch_tokens": 512})
    answers, _ = C.generate_distill_data(tiny, C.read_prompts(corpora[0])[:20], tmp_path / "data", cfg,
                                         progress=False)
    records, _ = C.teacher_force(tiny, answers, "float32", cfg.top_k, (2, 2, 1), progress=False)
    target = Transformer.load(tiny)
    ids = D.frequent_ids(records, 192, 384)
    args = (records, target.config, target.embed, target.head, target.norm, ids)
    straight, _ = B.train_head(*args, tmp_path / "a.pt", cfg, max_steps=6, progress=False)

    def interrupt(step, _metrics):
        if step == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        B.train_head(*args, tmp_path / "b.pt", cfg, max_steps=6, progress=False, on_step=interrupt)
    resumed, stats = B.train_head(*args, tmp_path / "b.pt", cfg, max_steps=6, progress=False)
    assert stats["resumed_from_step"] == 2 and stats["steps"] == 6
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_a_state_for_another_draft_vocabulary_or_starting_head_is_not_resumed(tiny, corpora, tmp_path):
    """A training state is continued only by a run with the same draft ids (not merely as many: a trained LM head's
    rows belong to their ids) and the same starting head; else the run starts fresh from its own."""
    cfg = DistillConfig(**{**TINY, "max_new_tokens": 8, "head_batch_tokens": 512, "head_train_lm_head": True})
    answers, _ = C.generate_distill_data(tiny, C.read_prompts(corpora[0])[:6], tmp_path / "data", cfg,
                                         progress=False)
    records, _ = C.teacher_force(tiny, answers, "float32", cfg.top_k, (2, 2, 1), progress=False)
    target = Transformer.load(tiny)
    ids = D.frequent_ids(records, 192, 384)
    other = torch.cat([ids[1:], torch.tensor([int(ids[-1]) + 1])])  # as many ids, not the same
    args = (records, target.config, target.embed, target.head, target.norm)
    state = tmp_path / "s.pt"
    first, _ = B.train_head(*args, ids, state, cfg, max_steps=2, progress=False)
    assert B.train_head(*args, ids, state, cfg, max_steps=3, progress=False)[1]["resumed_from_step"] == 2
    assert B.train_head(*args, other, state, cfg, max_steps=3, progress=False)[1]["resumed_from_step"] == 0
    init = {**first.state_dict(), "d2t": first.d2t}
    _, stats = B.train_head(*args, ids, tmp_path / "t.pt", cfg, max_steps=2, progress=False, init=init)
    assert B.train_head(*args, ids, tmp_path / "t.pt", cfg, max_steps=3, progress=False)[1]["resumed_from_step"] == 0
    # continued without --train-lm-head, a head whose LM head was trained keeps those rows (frozen, not reset)
    frozen = replace(cfg, head_train_lm_head=False)
    kept, _ = B.train_head(*args, ids, tmp_path / "u.pt", frozen, max_steps=0, progress=False, init=init)
    assert torch.equal(kept.lm_head.weight, first.lm_head.weight)
    assert not torch.equal(first.lm_head.weight, target.head[ids].float())  # it was trained: the check means it


def test_a_run_can_continue_a_finished_head(tiny, corpora, trained, tmp_path):
    """--init-from: a run continues another head's weights and draft vocabulary (zero steps give it back, held-out
    agreement included); a head for other feature layers, or a slice, is refused with the reason."""
    out = tmp_path / "continued"
    D.make_draft(tiny, out, kind="eagle3", budget_minutes=3, prompts=corpora[0], heldout=corpora[1], max_steps=0,
                 progress=False, init_from=trained, **{**TINY, "head_batch_tokens": 1024})
    before, after = load_file(trained / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    report = json.loads((out / D.REPORT_NAME).read_text())
    first = json.loads((trained / D.REPORT_NAME).read_text())
    assert report["init_from"] == str(trained) and report["train"]["steps"] == 0
    assert report["heldout"]["distilled"]["top1"] == first["heldout"]["distilled"]["top1"]
    with pytest.raises(ValueError, match="reads target layers"):
        B.load_head_init(trained, ModelConfig.from_dir(tiny), (1, 2, 3))
    with pytest.raises(ValueError, match="--kind eagle3"):
        D.make_draft(tiny, tmp_path / "slice", kind="slice", init_from=trained, progress=False)


# ------------------------------------------------------------------------------------------- shipped answers


def test_shipped_answers_regenerate_for_the_embedded_target(target_dir, tmp_path):
    """The shipped answers are the decode loop's output for the embedded target: a few regenerated alone match token
    for token (sampled training answers to a written and a synthesized prompt, a greedy held-out answer), every
    training conversation and round has its shipped answer, and their checksum holds."""
    cfg = DistillConfig()
    fingerprint = C.target_fingerprint(target_dir)
    written = C.read_prompts(C.DISTILL_PROMPTS)
    synth = [c for path in C.SYNTH_PROMPTS for c in C.read_prompts(path)]
    train = written + synth
    held = C.read_prompts(C.HELDOUT_PROMPTS)
    for eval_set, convs in ((False, train), (True, held)):
        shipped = C.load_shipped(fingerprint, cfg.generation_key(eval_set))
        rounds = 1 if eval_set else cfg.samples_per_prompt
        wanted = {C.conv_key(c) + (f"#{r}" if r else "") for c in convs for r in range(rounds)}
        assert set(shipped) == wanted  # every conversation, every round
        if eval_set:
            picks = [(held[5], 0)]
        else:  # the first shipped answer to a written prompt, and a last-round one to a synthesized prompt
            last = cfg.samples_per_prompt - 1
            picks = [next((c, 0) for c in written if C.conv_key(c) in shipped),
                     next((c, last) for c in synth[::-1] if C.conv_key(c) + f"#{last}" in shipped)]
        for conv_index, (conv, sample) in enumerate(picks):
            key = C.conv_key(conv) + (f"#{sample}" if sample else "")
            one = DistillConfig(samples_per_prompt=sample + 1)
            fresh, _ = C.generate_distill_data(target_dir, [conv], tmp_path / f"regen-{eval_set}-{conv_index}",
                                               one, eval_set=eval_set, progress=False, shipped=False)
            assert torch.equal(fresh[sample]["input_ids"], shipped[key]["input_ids"]), key
            assert fresh[sample]["prompt_len"] == shipped[key]["prompt_len"]
    records, stats = C.generate_distill_data(target_dir, C.read_prompts(C.HELDOUT_PROMPTS), tmp_path / "w", cfg,
                                             eval_set=True, progress=False)
    assert stats["generated_tokens"] == 0 and stats["shipped_answers"] == len(records)


def test_shipped_greedy_answers_regenerate_for_the_embedded_target(target_dir, tmp_path):
    """The greedy answers shipped for `spectrt draft --greedy-answers` (`ship answers --greedy`, the shipped draft's
    recipe) cover every prompt of its files, and one written and one steered Magpie answer regenerated alone match."""
    cfg = DistillConfig(**GREEDY_ANSWERS)  # the settings both commands share, so the key the shipped file carries
    shipped = C.load_shipped(C.target_fingerprint(target_dir), cfg.generation_key(False))
    written = C.read_prompts(C.DISTILL_PROMPTS)
    steered = [c for seed in C.STEERED_SEEDS for c in C.read_prompts(C.synth_prompts_path(seed))]
    assert set(shipped) == {C.conv_key(c) for c in written + steered}
    for i, conv in enumerate((written[3], steered[-1])):
        fresh, _ = C.generate_distill_data(target_dir, [conv], tmp_path / f"regen-{i}", cfg, progress=False,
                                           shipped=False)
        assert torch.equal(fresh[0]["input_ids"], shipped[C.conv_key(conv)]["input_ids"])
        assert fresh[0]["prompt_len"] == shipped[C.conv_key(conv)]["prompt_len"]


def test_shipped_answers_are_never_used_by_another_target(tiny, corpora, tmp_path):
    cfg = DistillConfig(max_new_tokens=6, samples_per_prompt=1)
    convs = C.read_prompts(corpora[0])[:4]
    answers, _ = C.generate_distill_data(tiny, convs, tmp_path / "gen", cfg, progress=False)
    answers_dir = tmp_path / "answers"
    C.write_shipped(answers_dir / "tiny", tiny, {"distill": (cfg.generation_key(False),
                                                             dict(zip([C.conv_key(c) for c in convs], answers,
                                                                      strict=True)))})
    fp = C.target_fingerprint(tiny)
    assert len(C.load_shipped(fp, cfg.generation_key(False), answers_dir)) == 4
    assert C.load_shipped(fp, DistillConfig(max_new_tokens=7).generation_key(False), answers_dir) == {}  # settings
    other = make_tiny_target(tmp_path / "other", layers=4)  # same shape and tokenizer, other weights
    state = load_file(other / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] * 1.01
    save_file(state, other / "model.safetensors", metadata={"format": "pt"})
    assert C.load_shipped(C.target_fingerprint(other), cfg.generation_key(False), answers_dir) == {}
    # the real shipped file belongs to the embedded target only
    _, stats = C.generate_distill_data(tiny, convs, tmp_path / "gen2", cfg, progress=False)
    assert stats["shipped_answers"] == 0 and stats["generated_tokens"] > 0
    raw = (answers_dir / "tiny.tokens.xz").read_bytes()
    import lzma

    data = bytearray(lzma.decompress(raw))
    data[10] ^= 1
    (answers_dir / "tiny.tokens.xz").write_bytes(lzma.compress(bytes(data)))
    with pytest.raises(ValueError, match="fail their sha256"):
        C.load_shipped(fp, cfg.generation_key(False), answers_dir)


def test_the_target_fingerprint_is_the_model_not_the_transformers_release_that_wrote_it(tiny, tmp_path):
    """A newer transformers converts the same GGUF to the same weights but stamps its version in config.json: the
    shipped answers and draft must still be found. Any other config field or any weight changes the fingerprint."""
    import shutil

    fp = C.target_fingerprint(tiny)
    copy = Path(shutil.copytree(tiny, tmp_path / "copy"))
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "transformers_version": "99.0.0"}, indent=4))
    assert C.target_fingerprint(copy) == fp
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5 + config["rms_norm_eps"]}))
    assert C.target_fingerprint(copy) != fp
    (copy / "config.json").write_text(json.dumps(config))
    state = load_file(copy / "model.safetensors")
    state["model.norm.weight"][0] += 1
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    assert C.target_fingerprint(copy) != fp


def test_profile_measures_a_head_draft_and_the_loop(tiny, trained, tmp_path):
    """`spectrt profile` with an EAGLE-3 head as the draft (the shipped draft is one): its cost curves come from the
    head's own forwards, and the loop section splits a step into forwards and host work that add up."""
    from spectrt.runtime.decoding import profile as P
    from spectrt.runtime.engines.eagle3 import Eagle3Head
    from spectrt.runtime.engines.model import Transformer

    head = P.HeadRows(Eagle3Head.load(trained, Transformer.load(tiny), torch.float32))
    curve = P.cost_curve(head, contexts=(16,), t_values=(1, 4), repeats=2)
    batched = P.batched_curve(head, contexts=(16,), segments=(2,), repeats=2)
    assert set(curve["16"]) == {"1", "4"} and all(ms > 0 for ms in curve["16"].values())
    assert all(ms > 0 for ms in batched["16"]["2"].values())
    loop = P.loop_host(tiny, trained, "fp32", tmp_path, batches=(1, 2), tokens=6, prompts=2)
    assert list(loop) == ["1", "2", "2 plain"] and loop["2 plain"]["draft forwards"] == 0
    for parts in loop.values():
        assert parts["total"] > parts["target forward"] > 0 and parts["draft forwards"] >= 0
        assert parts["host"] == pytest.approx(parts["total"] - parts["target forward"] - parts["draft forwards"],
                                              abs=2e-3)
        assert parts["host"] == pytest.approx(parts["host: propose"] + parts["host: accept"] + parts["host: other"],
                                              abs=2e-3)


def test_gather_rows_stacks_the_named_rows():
    """A draft level's parent hiddens: a view of consecutive rows or one numpy gather over rows of one fp32 tensor, a
    stack otherwise (rows of two
    passes, or another dtype), the same rows in the given order either way."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=g), torch.randn(2, 5, generator=g)
    assert torch.equal(gather_rows([(a, 2), (a, 0), (a, 2)]), a[[2, 0, 2]])
    run = gather_rows([(a, 1), (a, 2)])  # consecutive rows: a view of them, no copy
    assert torch.equal(run, a[1:3]) and run.data_ptr() == a[1].data_ptr() and run.is_contiguous()
    assert torch.equal(gather_rows([(a, 1), (b, 0)]), torch.stack([a[1], b[0]]))
    half = a.bfloat16()
    assert torch.equal(gather_rows([(half, 1), (half, 0)]), half[[1, 0]])
