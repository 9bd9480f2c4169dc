"""The batched tree-verify graph on small tensors: packed masks, padding segments into its inputs, the graph itself
(torch module and its ONNX export on ONNX Runtime) against the torch engine one segment at a time, and isolation
(a row never sees a node its mask hides, a request never sees another's slot or tokens).

Tiny random checkpoints (2 layers, hidden 64): seconds on a CPU. The embedded model's graphs are checked in
tests/test_engines.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from spectrt.build.export import TreeVerifyModel, example_inputs, export_graph, io_spec, sequence_inputs
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines.batch_inputs import batch_inputs, mask_words, pack_mask, unpack_mask
from spectrt.runtime.engines.model import KVCache, Transformer
from spectrt.runtime.engines.onnx_engine import OnnxEngine

VOCAB = 512


def _tiny(out: Path, qk_norm: bool = False) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2)
    model = (Qwen3ForCausalLM(Qwen3Config(**common, head_dim=24, attention_bias=True)) if qk_norm
             else LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory.mktemp(request.param) / "m", qk_norm=request.param == "qwen3")


# ---------------------------------------------------------------------------------------------- packed masks


def test_pack_mask_round_trips_tree_masks():
    for spec in ("1", "1,1,1,1", "3,2,2,1,1", "4,4,2", "2,2,2,2,2"):  # up to 63 nodes: two words
        mask = Tree.parse(spec).mask
        packed = pack_mask(mask)
        assert packed.dtype == torch.int32 and packed.shape == (len(mask), mask_words(len(mask)))
        bits = unpack_mask(packed)
        assert bits.shape[-1] == 32 * packed.shape[-1]
        assert torch.equal(bits[:, :len(mask)].bool(), mask) and not bits[:, len(mask):].any()


def test_pack_mask_is_tensorrt_llms_layout():
    """Chain row i = (1 << (i + 1)) - 1; bit 31 is the sign bit of an int32 word; bit 32 starts word 1."""
    chain = torch.ones(40, 40, dtype=torch.bool).tril()
    packed = pack_mask(chain)
    assert packed[:31, 0].tolist() == [(1 << (i + 1)) - 1 for i in range(31)]
    assert packed[31, 0] == -1 and packed[31, 1] == 0  # all 32 bits of word 0
    assert packed[32].tolist() == [-1, 1] and packed[39].tolist() == [-1, 255]
    only_31 = torch.zeros(1, 32, dtype=torch.bool)
    only_31[0, 31] = True
    assert pack_mask(only_31).item() == -(2**31)
    random = torch.rand(5, 7, 77, generator=torch.Generator().manual_seed(0)) < 0.5
    assert torch.equal(unpack_mask(pack_mask(random))[..., :77].bool(), random)
    with pytest.raises(ValueError, match="need 2 words"):
        pack_mask(torch.ones(2, 33, dtype=torch.bool), words=1)


# ---------------------------------------------------------------------------------------------- padding segments


def _pool(config, slots=3, capacity=64, window=16) -> list[KVCache]:
    return KVCache.pool(config, slots, capacity, window, torch.float32)


def test_batch_inputs_pad_mixed_segments(tiny):
    config = TreeVerifyModel.load(tiny).config
    caches = _pool(config)
    caches[0].length, caches[2].length = 9, 4
    tree = Tree.parse("2,1")
    level = Tree.parse("2,2")  # the draft's second level: nodes 3..6 after nodes 1, 2 (window slots 0, 1)
    segments = [
        (torch.tensor([5, 6, 7, 8, 9]), tree.positions(9), tree.mask, caches[0]),
        (torch.arange(10, 16), torch.arange(0, 6), torch.ones(6, 6, dtype=torch.bool).tril(), caches[1]),
        (torch.tensor([3, 4, 5, 6]), level.positions(4)[3:], level.mask[3:, 1:], caches[2]),
    ]
    x = batch_inputs(segments)
    assert x.input_ids.tolist() == [*range(5, 10), *range(10, 16), 3, 4, 5, 6]
    assert x.generation_lengths.tolist() == [5, 6, 4] and x.rows == [(0, 5), (5, 11), (11, 15)]
    assert x.position_offsets.tolist() == [[0, 1, 1, 2, 2, 0], [0, 1, 2, 3, 4, 5], [2, 2, 2, 2, 0, 0]]
    assert x.past_lengths.tolist() == [9, 0, 4] and x.window_offsets.tolist() == [0, 0, 2]
    assert x.slot_ids.tolist() == [0, 1, 2] and x.cache_columns.tolist() == list(range(14))  # past + W: 9 + 5
    assert x.packed_mask.shape == (3, 6, 1)
    assert x.packed_mask[1, :, 0].tolist() == [(1 << (i + 1)) - 1 for i in range(6)]  # the chunk: a chain
    assert torch.equal(unpack_mask(x.packed_mask[2, :4])[:, :6].bool(), level.mask[3:, 1:])
    assert torch.equal(unpack_mask(x.packed_mask[0, :5])[:, :5].bool(), tree.mask)
    assert not x.packed_mask[0, 5:].any() and not x.packed_mask[2, 4:].any()  # padding rows see nothing
    assert x.kv_writes == [(0, 9, 14), (1, 0, 6), (2, 6, 10)]
    assert batch_inputs(segments, columns=64).cache_columns.shape == (64,)
    with pytest.raises(ValueError, match="cannot hold"):
        batch_inputs(segments, columns=8)
    with pytest.raises(ValueError, match="appears twice"):
        batch_inputs(segments + [segments[0]])
    with pytest.raises(ValueError, match="one pool"):
        batch_inputs(segments[:1] + [(segments[1][0], segments[1][1], segments[1][2], _pool(config)[1])])
    with pytest.raises(ValueError, match="exceeds the static cache"):
        batch_inputs([(torch.arange(20), torch.arange(20), torch.ones(20, 20, dtype=torch.bool).tril(), caches[1])])


# ---------------------------------------------------------------------------------------------- the graph


class Scenario:
    """Three slots as the decode loop drives them: a prompt chunk after a 13-token prefix (slot 2), a 3,2,1 tree
    after 20 (slot 0), and a draft's second level of a 2,2 tree (nodes 3..6, W = 6 > T = 4) after its first level
    (nodes 1, 2: window slots 0, 1) on a 7-token prefix (slot 1). Same seed, same tokens."""

    prefixes = {0: 20, 1: 7, 2: 13}
    tree, level = Tree.parse("3,2,1"), Tree.parse("2,2")

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def ids(self, n: int) -> torch.Tensor:
        return torch.randint(0, VOCAB, (n,), generator=self.g)

    def prepare(self, engine, caches) -> None:
        """Commit each slot's prefix and write slot 1's first drafted level, through `engine.forward`."""
        for slot, n in self.prefixes.items():
            engine.forward(self.ids(n), torch.arange(n), torch.ones(n, n, dtype=torch.bool).tril(), caches[slot])
            caches[slot].commit(n)
        engine.forward(self.ids(2), self.level.positions(7)[1:3], self.level.mask[1:3, 1:3], caches[1])

    def segments(self, caches) -> list[tuple]:
        return [
            (self.ids(10), torch.arange(13, 23), torch.ones(10, 10, dtype=torch.bool).tril(), caches[2]),
            (self.ids(len(self.tree)), self.tree.positions(20), self.tree.mask, caches[0]),
            (self.ids(4), self.level.positions(7)[3:], self.level.mask[3:, 1:], caches[1]),
        ]


def test_graph_equals_the_torch_engine_per_segment(tiny):
    """One batched call over a chunk, a tree and a W > T draft level (3 slots) = the torch engine one segment at a
    time: logits and the new K/V it returns."""
    ref = Transformer.load(tiny, native=False)
    model = TreeVerifyModel.load(tiny).eval()
    scenario = Scenario(0)
    caches = ref.new_caches(3, 64, 24)
    scenario.prepare(ref, caches)
    pool_k, pool_v = caches[0].pool_k.clone(), caches[0].pool_v.clone()  # before the segments write their K/V
    segs = scenario.segments(caches)
    x = batch_inputs(segs)
    want = [ref.forward(*seg) for seg in segs]
    with torch.no_grad():
        logits, new_k, new_v = model(*x.tensors(), pool_k, pool_v)
    assert logits.shape == (sum(len(s[0]) for s in segs), VOCAB)
    for (r0, r1), (slot, first, end), expected in zip(x.rows, x.kv_writes, want, strict=True):
        assert float((logits[r0:r1] - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
        torch.testing.assert_close(new_k[:, :, r0:r1], caches[0].pool_k[slot, :, :, first:end], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(new_v[:, :, r0:r1], caches[0].pool_v[slot, :, :, first:end], rtol=1e-5, atol=1e-5)


def test_sequence_inputs_are_causal_logits(tiny):
    ref = Transformer.load(tiny, native=False)
    model = TreeVerifyModel.load(tiny).eval()
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    want = ref.forward(ids, torch.arange(12), torch.ones(12, 12, dtype=torch.bool).tril(), ref.new_cache(16, 16))
    with torch.no_grad():
        got = model(*sequence_inputs(model.config, torch.float32, ids))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.fixture(scope="module")
def graph(tiny, tmp_path_factory) -> Path:
    return export_graph(tiny, tmp_path_factory.mktemp("graph") / "model.fp32.onnx", "fp32", log=lambda _: None)


def test_exported_graph_io_and_example_parity(tiny, graph):
    from spectrt.build.export import graph_io

    model = TreeVerifyModel.load(tiny).eval()
    assert graph_io(graph) == io_spec(model.config, "fp32")
    inputs = example_inputs(model.config, torch.float32, t=6, past=5, capacity=16)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs, strict=True)})
    with torch.no_grad():
        want = [t.numpy() for t in model(*inputs)]
    for w, g in zip(want, got, strict=True):
        assert w.shape == g.shape and np.abs(w - g).max() <= 1e-5 * max(np.abs(w).max(), 1.0)


def test_onnx_engine_forward_many_equals_torch_engine(tiny, graph):
    """OnnxEngine.forward_many (one session run) = the torch engine per segment, logits and the K/V written into the
    pool; then a one-token decode step on every slot (past > 0 everywhere)."""
    ref = Transformer.load(tiny, native=False)
    eng = OnnxEngine(graph, ref.config, optimization="basic")
    ref_caches, caches = ref.new_caches(3, 64, 24), eng.new_caches(3, 64, 24)
    outputs = []
    for engine, cs in ((ref, ref_caches), (eng, caches)):
        scenario = Scenario(1)
        scenario.prepare(engine, cs)
        runs = eng.runs
        outputs.append(engine.forward_many(scenario.segments(cs)))
    assert eng.runs == runs + 1, "one session run for all segments"
    for want, got in zip(*outputs, strict=True):
        assert got.shape == want.shape and float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    used = 20 + 16
    for a, b in ((caches[0].pool_k, ref_caches[0].pool_k), (caches[0].pool_v, ref_caches[0].pool_v)):
        torch.testing.assert_close(a[..., :used, :], b[..., :used, :], rtol=1e-5, atol=1e-5)
    for cs in (ref_caches, caches):
        cs[2].commit(10)
        cs[0].compact([0, 2, 7])
        cs[1].compact([0, 3])
    single = lambda cs: [(torch.tensor([i + 1]), torch.tensor([c.length]), torch.ones(1, 1, dtype=torch.bool), c)  # noqa: E731
                         for i, c in enumerate(cs)]
    got, want = eng.forward_many(single(caches)), ref.forward_many(single(ref_caches))
    assert eng.runs == runs + 2
    for a, b in zip(got, want, strict=True):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    assert len({t.data_ptr() for t in got}) == 3, "every segment's logits are a tensor of its own"


def test_a_hidden_node_or_slot_changes_nothing(tiny, graph):
    """Perturbing the K/V of a window slot a row may not see, another request's slot or token, or a stale slot leaves
    the row's logits bitwise unchanged; perturbing what it does see changes them (so the test can fail)."""
    config = TreeVerifyModel.load(tiny).config
    eng = OnnxEngine(graph, config, optimization="basic")
    caches = eng.new_caches(3, 64, 24)
    scenario = Scenario(2)
    scenario.prepare(eng, caches)
    segs = scenario.segments(caches)
    pool_k, pool_v = caches[0].pool_k, caches[0].pool_v
    base = eng.forward_many(segs)

    def rerun(change):
        saved = (pool_k.clone(), pool_v.clone(), [s[0].clone() for s in segs])
        change()
        out = eng.forward_many(segs)
        pool_k.copy_(saved[0])
        pool_v.copy_(saved[1])
        for seg, tokens in zip(segs, saved[2], strict=True):
            seg[0].copy_(tokens)
        return out

    def bump(tokens, i):
        return lambda: tokens.__setitem__(i, (int(tokens[i]) + 1) % VOCAB)

    same = lambda out, seg, rows=slice(None): torch.equal(out[seg][rows], base[seg][rows])  # noqa: E731
    # the draft level (segment 2): nodes 3, 4 are children of node 1 (window slot 0), nodes 5, 6 of node 2 (slot 1)
    out = rerun(lambda: pool_k[1, :, :, caches[1].length + 1].add_(5.0))
    assert same(out, 2, slice(0, 2)) and not same(out, 2, slice(2, 3)) and not same(out, 2, slice(3, 4))
    # the tree (segment 1): node 2 is hidden from its siblings 1 and 3, seen by itself
    out = rerun(bump(segs[1][0], 2))
    assert same(out, 1, slice(1, 2)) and same(out, 1, slice(3, 4)) and not same(out, 1, slice(2, 3))
    # another request's slot and tokens are invisible to the others; its own rows see them
    out = rerun(lambda: pool_k[2].add_(3.0))
    assert same(out, 1) and same(out, 2) and not same(out, 0)
    out = rerun(bump(segs[0][0], 0))
    assert same(out, 1) and same(out, 2) and not same(out, 0)
    # stale slots inside the attention span (slot 2 past its prefix, slot 1 past its window) are masked
    out = rerun(lambda: pool_k[2, :, :, caches[2].length:].add_(7.0))
    assert same(out, 0)
    out = rerun(lambda: pool_k[1, :, :, caches[1].length + 2:].add_(7.0))
    assert same(out, 2)


def test_rows_are_batch_invariant_on_onnxruntime(tiny, graph):
    """A request's logits are bitwise the same alone or in a batch, and a verified chain's rows bitwise the same as
    its tokens decoded one at a time: a row's context is the same columns whatever the batch, and MLAS's GEMMs are
    row invariant (what makes batched == sequential decoding exact on this backend)."""
    config = TreeVerifyModel.load(tiny).config
    eng = OnnxEngine(graph, config)  # the default optimization level, as served
    caches = eng.new_caches(3, 64, 24)
    scenario = Scenario(4)
    scenario.prepare(eng, caches)
    segs = scenario.segments(caches)
    batched = eng.forward_many(segs)
    for seg, together in zip(segs, batched, strict=True):
        assert torch.equal(eng.forward(*seg), together)
    cache = caches[2]
    cache.commit(10)
    tokens = torch.tensor([11, 12, 13, 14])
    n = cache.length
    chain = eng.forward(tokens, torch.arange(n, n + 4), torch.ones(4, 4, dtype=torch.bool).tril(), cache)
    for i in range(4):
        one = eng.forward(tokens[i:i + 1], torch.tensor([n + i]), torch.ones(1, 1, dtype=torch.bool), cache)
        cache.commit(1)
        assert torch.equal(one[0], chain[i]), f"row {i}"
