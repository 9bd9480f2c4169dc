"""The native CPU forward (runtime/cpu_kernels.cpp): parity with the torch reference, bitwise row invariance in
fp32 and bf16 (a verified tree row == decoding that node alone), batched segments == separate forwards, exact
bf16 tree decoding, and no allocation while decoding."""

from __future__ import annotations

import pytest
import torch
from conftest import EOS, PROMPTS, chat_ids
from spectrt.runtime import kernels
from spectrt.runtime.decoder import Decoder
from spectrt.runtime.model import Transformer
from spectrt.runtime.tree import Tree


def test_native_kernels_build_here():
    # CI runs on AVX-512 machines: the fast path must really be the one under test, never silently the fallback
    assert kernels.native_unavailable() is None


@pytest.fixture(scope="module")
def reference(target_dir) -> Transformer:
    return Transformer.load(target_dir, native=False)


@pytest.fixture(scope="module")
def bf16(target_dir) -> Transformer:
    return Transformer.load(target_dir, torch.bfloat16)


def _prefilled(engine: Transformer, prefix: list[int], capacity: int = 512):
    cache = engine.new_cache(capacity, 64)
    causal = torch.ones(len(prefix), len(prefix), dtype=torch.bool).tril()
    engine.forward(torch.tensor(prefix), torch.arange(len(prefix)), causal, cache)
    cache.commit(len(prefix))
    return cache


def _heap_tree(n: int) -> Tree:
    """n nodes, node i's parent (i - 1) // 2: a binary tree in breadth-first order."""
    return Tree(tuple([-1] + [(i - 1) // 2 for i in range(1, n)]))


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_gemm_rows_are_invariant_and_correct(rows, dtype):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=gen)  # 200 outputs: a partial last panel
    x = torch.randn(rows, 96, generator=gen)
    packed = kernels.pack(w, dtype)
    y = kernels.linear(x, packed, 200)
    torch.testing.assert_close(y, x @ w.to(dtype).float().T, rtol=1e-5, atol=1e-4)
    for i in range(rows):  # each row alone, and inside a block of other rows at another position
        assert torch.equal(kernels.linear(x[i:i + 1], packed, 200)[0], y[i])
        assert torch.equal(kernels.linear(torch.cat([x.flip(0), x[i:i + 1]]), packed, 200)[-1], y[i])


@pytest.mark.parametrize("smooth", [False, True])
def test_int8_projection_matches_torch_int_mm_and_is_row_invariant(smooth):
    from spectrt.runtime.int8 import Int8Linear

    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(130, 70, generator=gen), 3 * torch.randn(9, 70, generator=gen)  # K and N not multiples
    proj = Int8Linear(w, w.abs().amax(1), x.abs().amax(), torch.rand(70, generator=gen) + 0.5 if smooth else None)
    packed = kernels.pack_int8(proj)
    y = kernels.linear(x, packed, 130)
    # the same int8 operands and an exact int32 sum: equal to torch's _int_mm path up to the final fp32 multiply
    torch.testing.assert_close(y, proj(x), rtol=1e-6, atol=1e-5)
    for i in range(9):
        assert torch.equal(kernels.linear(x[i:i + 1], packed, 130)[0], y[i])


def test_native_matches_reference_forward(reference, target):
    gen = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, 49152, (100,), generator=gen).tolist()
    tree = Tree.parse("3,2,2,1")
    tokens = torch.randint(0, 49152, (len(tree),), generator=gen)
    out = []
    for engine in (reference, target):
        cache = engine.new_cache(256, 64)
        causal = torch.ones(64, 64, dtype=torch.bool).tril()
        first = engine.forward(torch.tensor(prefix[:64]), torch.arange(64), causal, cache).clone()
        cache.commit(64)
        engine.forward(torch.tensor(prefix[64:]), torch.arange(64, 100), causal[:36, :36], cache)
        cache.commit(36)
        out.append((first, engine.forward(tokens, tree.positions(100), tree.mask, cache).clone(), cache.k[:, :, :110]))
    for ref, nat in zip(*out, strict=True):
        assert (ref - nat).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("engine_name", ["target", "bf16"])
@pytest.mark.parametrize("nodes", [8, 64])
def test_tree_rows_are_bitwise_single_token_steps(request, engine_name, nodes):
    """Each row of a T-node tree forward == the forward of that node alone over the same prefix + ancestors."""
    engine = request.getfixturevalue(engine_name)
    gen = torch.Generator().manual_seed(nodes)
    prefix = torch.randint(0, 49152, (40,), generator=gen).tolist()
    tree = _heap_tree(nodes)
    tokens = torch.randint(0, 49152, (nodes,), generator=gen)
    cache = _prefilled(engine, prefix)
    batched = engine.forward(tokens, tree.positions(40), tree.mask, cache).clone()
    k_batched = cache.k[:, :, 40:40 + nodes].clone()
    for i in range(nodes):  # window slots 0..i-1 hold the ancestors' K/V written by the tree forward
        single = engine.forward(tokens[i:i + 1], tree.positions(40)[i:i + 1], tree.mask[i:i + 1, :i + 1], cache)
        assert torch.equal(single[0], batched[i]), f"row {i} of a {nodes}-node tree differs from its single step"
        assert torch.equal(cache.k[:, :, 40 + i], k_batched[:, :, i])


def test_forward_many_equals_separate_forwards(target):
    gen = torch.Generator().manual_seed(3)
    prefixes = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 30, 60)]
    trees = [Tree.parse("2,1"), Tree((-1,)), Tree.parse("3,2")]
    tokens = [torch.randint(0, 49152, (len(t),), generator=gen) for t in trees]
    separate = []
    for prefix, tree, tok in zip(prefixes, trees, tokens, strict=True):
        separate.append(target.forward(tok, tree.positions(len(prefix)), tree.mask, _prefilled(target, prefix)).clone())
    caches = [_prefilled(target, p) for p in prefixes]
    batched = target.forward_many([(tok, tree.positions(len(p)), tree.mask, c)
                                   for p, tree, tok, c in zip(prefixes, trees, tokens, caches, strict=True)])
    for a, b in zip(separate, batched, strict=True):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def bf16_prompts(tokenizer):
    return [chat_ids(tokenizer, p) for p in PROMPTS]


@pytest.mark.parametrize("spec", ["2,2,1", "1,1,1,1"])
def test_bf16_greedy_tree_equals_bf16_autoregressive(bf16, target_dir, draft_dir, bf16_prompts, spec):
    """bf16 is an exact mode: its tree decoding gives its own AR tokens (it did on 4/12 prompts before)."""
    draft = Transformer.load(draft_dir, torch.bfloat16) if spec == "2,2,1" else bf16
    ar = Decoder(bf16, None, EOS, max_seq_len=512)
    spec_decoder = Decoder(bf16, draft, EOS, max_seq_len=512)
    accepted = 0
    for ids in bf16_prompts:
        expected = ar.generate(ids, 96).token_ids
        result = spec_decoder.generate(ids, 96, Tree.parse(spec))
        assert result.token_ids == expected
        accepted += sum(result.stats.accepted)
    assert accepted > 0


def test_native_decoding_allocates_no_buffers(target, bf16_prompts):
    decoder = Decoder(target, target, EOS, max_seq_len=512)
    native = target.native
    before = [t.data_ptr() for t in native.scratch + [native.rope_cos, decoder.target_caches[0].k]]
    decoder.generate(bf16_prompts[0], 24, Tree.parse("2,2,1"))
    assert [t.data_ptr() for t in native.scratch + [native.rope_cos, decoder.target_caches[0].k]] == before


def test_native_refuses_bad_token_ids(target):
    cache = target.new_cache(64, 8)
    with pytest.raises(ValueError, match="token ids must lie in"):
        target.forward(torch.tensor([49152]), torch.arange(1), torch.ones(1, 1, dtype=torch.bool), cache)
