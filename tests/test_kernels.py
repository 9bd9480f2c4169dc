"""The native CPU forward (runtime/engines/cpu_kernels.cpp over simd.h), once per ISA build this CPU executes
(avx512, avx2, portable; SPECTRT_ISA forces one): parity with the torch reference, bitwise row invariance in fp32,
bf16 and INT8 (a verified tree row == decoding that node alone), batched segments == separate forwards, exact bf16
tree decoding, every ISA computing bitwise the same logits, and no allocation while decoding."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import EOS, PROMPTS, chat_ids
from spectrt.runtime.decoding.decoder import Decoder
from spectrt.runtime.decoding.profile import prefilled_cache
from spectrt.runtime.decoding.tree import Tree
from spectrt.runtime.engines import kernels
from spectrt.runtime.engines.model import Transformer

ISAS = kernels.runnable_isas()  # every build this CPU can execute, best first: the tests below run on each


def test_processes_with_different_paths_share_one_build():
    """A tritonserver stub finds the environment's ninja first on PATH, a test or CLI process may find the system's:
    each used to read the other's build log as stale and recompile (1-2 minutes a switch). Now a load from either
    PATH compiles nothing once the build exists: the build log gains no line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    kernels.load_kernels()  # the build exists
    log = kernels.build_dir(kernels.native_isa()) / ".ninja_log"
    before = log.read_text()
    load = "from spectrt.runtime.engines.kernels import load_kernels; assert load_kernels() is not None"
    for path in ("/usr/bin:/bin", f"{Path(sys.executable).parent}:/usr/bin:/bin"):
        subprocess.run([sys.executable, "-c", load], check=True, env={**os.environ, "PATH": path}, timeout=600)
    assert log.read_text() == before, "a process with another PATH rebuilt the kernels"


def test_native_kernels_build_here():
    """The fast path is really the one under test, never silently the fallback: on any x86-64 with AVX2+FMA a
    SIMD build (avx512 or avx2) is picked, the best this CPU has; elsewhere the portable one."""
    assert kernels.native_unavailable() is None
    picked = kernels.native_isa()
    print(f"native ISA picked here: {picked} (runnable: {ISAS})")
    assert picked == ISAS[0]
    if {"avx2", "fma"} <= kernels.cpu_flags():
        assert picked in ("avx512", "avx2")
        assert "avx2" in ISAS


def test_isa_flags_follow_the_cpu(monkeypatch):
    """Which builds a CPU gets is decided by its flags alone, and a forced ISA it cannot run is refused by name."""
    monkeypatch.setattr(kernels.platform, "machine", lambda: "x86_64")
    zen3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})
    monkeypatch.setattr(kernels, "cpu_flags", lambda: zen3)
    assert kernels.runnable_isas() == ["avx2", "portable"]
    assert "avx512f" in kernels.isa_flags("avx512") and "-mavxvnni" not in kernels.isa_flags("avx2")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: zen3 | {"avx_vnni"})
    assert "-mavxvnni" in kernels.isa_flags("avx2")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"sse2"}))
    assert kernels.runnable_isas() == ["portable"]
    with pytest.raises(ValueError, match="avx512, avx2, portable"):
        kernels.isa_flags("neon")


def test_the_weight_stream_prefetch_follows_the_cpu_vendor(monkeypatch):
    """Non-temporal weight prefetch only on AMD (it halved an Intel Xeon's stream); part of the build key."""
    for vendor, flags in (("AuthenticAMD", ["-DSPECTRT_STREAM_NTA"]), ("GenuineIntel", []), ("", [])):
        monkeypatch.setattr(kernels, "_cpuinfo", lambda key, v=vendor: v if key == "vendor_id" else "")
        assert kernels.stream_flags() == flags


@pytest.mark.parametrize("isa", ISAS)
def test_a_forced_isa_is_the_one_that_runs(isa, target_dir, monkeypatch):
    monkeypatch.setenv("SPECTRT_ISA", isa)
    assert kernels.native_isa() == isa
    assert Transformer.load(target_dir, torch.bfloat16).native.isa == isa


@pytest.fixture(scope="module")
def reference(target_dir) -> Transformer:
    return Transformer.load(target_dir, native=False)


@pytest.fixture(scope="module")
def bf16(target_dir) -> Transformer:
    return Transformer.load(target_dir, torch.bfloat16)


@pytest.fixture(scope="module")
def bf16_amx(target_dir) -> Transformer:
    """The bf16 engine on the AMX GEMM (opt-in: SPECTRT_AMX=1), where the CPU has it."""
    if not kernels.amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECTRT_AMX", "1")
        engine = Transformer.load(target_dir, torch.bfloat16)
    assert all(p[0].dim() == 6 for p in engine.native.projections)  # really the AMX path
    return engine


@pytest.fixture(scope="module")
def bf16dot_amx(target_dir) -> Transformer:
    """The bf16dot engine on the AMX GEMM (its default where the CPU has it)."""
    if not kernels.amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("SPECTRT_AMX", raising=False)
        engine = Transformer.load(target_dir, torch.bfloat16, pair_dots=True)
    assert engine.native.head.dim() == 5 and all(p[0].dim() == 5 for p in engine.native.projections)
    return engine


def _prefilled(engine: Transformer, prefix: list[int], capacity: int = 512):
    cache = engine.new_cache(capacity, 64)
    causal = torch.ones(len(prefix), len(prefix), dtype=torch.bool).tril()
    engine.forward(torch.tensor(prefix), torch.arange(len(prefix)), causal, cache)
    cache.commit(len(prefix))
    return cache


def _heap_tree(n: int) -> Tree:
    """n nodes, node i's parent (i - 1) // 2: a binary tree in breadth-first order."""
    return Tree(tuple([-1] + [(i - 1) // 2 for i in range(1, n)]))


def test_amx_is_detected_opt_in_for_bf16_and_default_for_bf16dot(bf16, monkeypatch):
    # an AMX machine must run (and so test) the AMX GEMMs, not silently skip them; bf16's default stays FMA
    on_avx512 = kernels.native_isa() == "avx512"
    assert kernels.amx_supported() == (on_avx512 and {"amx_bf16", "amx_tile"} <= kernels.cpu_flags())
    assert all(p[0].dim() == 3 for p in bf16.native.projections)
    monkeypatch.delenv("SPECTRT_AMX", raising=False)
    assert not kernels.amx_enabled() and kernels.amx_enabled(pairs=True) == kernels.amx_supported()
    monkeypatch.setenv("SPECTRT_AMX", "0")
    assert not kernels.amx_enabled(pairs=True)
    monkeypatch.setenv("SPECTRT_AMX", "1")
    assert kernels.amx_enabled() == kernels.amx_enabled(pairs=True) == kernels.amx_supported()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 13, 16, 17, 64])
@pytest.mark.parametrize(("isa", "dtype", "amx"), [  # AMX only in the avx512 build
    (isa, dtype, amx) for isa in ISAS for dtype, amx in ((torch.float32, False), (torch.bfloat16, False),
                                                          (torch.bfloat16, True)) if not amx or isa == "avx512"])
def test_packed_gemm_rows_are_invariant_and_correct(rows, dtype, amx, isa, monkeypatch):
    monkeypatch.setenv("SPECTRT_ISA", isa)
    if amx and not kernels.amx_supported():
        pytest.skip("AMX-BF16 needs the avx512 build on a CPU with AMX")
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 70, generator=gen)  # 200 outputs: a partial last panel; K=70: padded k (AMX)
    x = torch.randn(rows, 70, generator=gen)
    packed = kernels.pack(w, dtype, amx=amx)
    y = kernels.linear(x, packed, 200)
    torch.testing.assert_close(y, x @ w.to(dtype).float().T, rtol=1e-5, atol=1e-4)
    for i in range(rows):  # each row alone, and inside a block of other rows at another position
        assert torch.equal(kernels.linear(x[i:i + 1], packed, 200)[0], y[i])
        assert torch.equal(kernels.linear(torch.cat([x.flip(0), x[i:i + 1]]), packed, 200)[-1], y[i])


def _pair_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """VDPBF16PS's arithmetic in torch, for normal numbers: inputs rounded to bf16 (to nearest even), then per k pair
    in ascending order acc + odd product, + even product. A bf16 times a bf16 is exact in fp32, so each fp32 add is
    the one rounding of an FMA."""
    xb, wb = x.bfloat16().float(), w.bfloat16().float()
    if x.shape[1] % 2:
        xb, wb = F.pad(xb, (0, 1)), F.pad(wb, (0, 1))
    acc = torch.zeros(x.shape[0], w.shape[0])
    for q in range(xb.shape[1] // 2):
        for k in (2 * q + 1, 2 * q):
            acc = acc + xb[:, k:k + 1] * wb[:, k][None]
    return acc


@pytest.mark.parametrize("isa", ISAS)
def test_bf16dot_gemm_is_pair_dot_arithmetic_on_every_isa(isa, monkeypatch):
    """bf16dot's GEMM computes VDPBF16PS's sums bitwise (the instruction on AVX512_BF16 CPUs, two FMAs under DAZ|FTZ
    elsewhere): every row alone, inside blocks of others, K odd (a zero-padded pair), a partial last panel."""
    monkeypatch.setenv("SPECTRT_ISA", isa)
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(200, 71, generator=gen)
    packed = kernels.pack(w, torch.bfloat16, amx=False, pairs=True)
    assert packed.shape == (4, 36, kernels.PANEL, 2)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13):
        x = torch.randn(rows, 71, generator=gen)
        y = kernels.linear(x, packed, 200)
        assert torch.equal(y, _pair_sums(x, w))
        for i in range(rows):
            assert torch.equal(kernels.linear(x[i:i + 1], packed, 200)[0], y[i])
            assert torch.equal(kernels.linear(torch.cat([x.flip(0), x[i:i + 1]]), packed, 200)[-1], y[i])


def test_bf16dot_amx_gemm_rows_are_invariant_and_near_the_pair_sums():
    """bf16dot on AMX tiles: the same bf16 inputs and weights, summed in the tile unit's order and rounding (a pair
    rounded, then added), so close to the pair-FMA sums but not theirs; each row computed alike whatever the others,
    K padded to 32 and a partial last panel."""
    if not kernels.amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    gen = torch.Generator().manual_seed(12)
    w = torch.randn(200, 71, generator=gen)
    packed = kernels.pack(w, torch.bfloat16, amx=True, pairs=True)
    assert packed.shape == (4, 4, 3, 16, 32)
    for rows in (1, 2, 3, 5, 13, 16, 17, 40):
        x = torch.randn(rows, 71, generator=gen)
        y = kernels.linear(x, packed, 200)
        torch.testing.assert_close(y, _pair_sums(x, w), rtol=1e-5, atol=1e-5)
        for i in range(rows):
            assert torch.equal(kernels.linear(x[i:i + 1], packed, 200)[0], y[i])
            assert torch.equal(kernels.linear(torch.cat([x.flip(0), x[i:i + 1]]), packed, 200)[-1], y[i])


@pytest.mark.parametrize("isa", ISAS)
def test_bf16dot_reads_and_writes_denormals_as_zero(isa, monkeypatch):
    """As VDPBF16PS: a denormal input rounds to zero, a product or sum below 2^-126 is flushed (every ISA alike)."""
    monkeypatch.setenv("SPECTRT_ISA", isa)
    w = torch.zeros(64, 4)
    w[0, 0] = 2.0 ** -60  # column 0: 2^-70 * 2^-60 = 2^-130, a denormal product
    w[1, 1] = 1.0  # column 1: the denormal activation itself
    w[2, 0], w[2, 2] = 2.0 ** -60, 1.0  # column 2: 2^-130 + 2^-100: the denormal product is dropped, not added
    x = torch.tensor([[2.0 ** -70, 2.0 ** -140, 2.0 ** -100, 0.0]])
    y = kernels.linear(x, kernels.pack(w, torch.bfloat16, amx=False, pairs=True), 64)
    assert y[0, 0].item() == 0.0 and y[0, 1].item() == 0.0
    assert y[0, 2].item() == 2.0 ** -100


def test_amx_bf16_sums_exact_products_of_fp32_activations():
    """The AMX path splits fp32 activations into three bf16: as exact as the FMA path (bf16 weights times fp32
    activations, fp32 sums), not bf16-rounded activations."""
    if not kernels.amx_supported():
        pytest.skip("this CPU has no AMX-BF16")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 1536, generator=gen).bfloat16()
    x = torch.randn(4, 1536, generator=gen)
    exact = (x.double() @ w.double().T).float()
    amx = kernels.linear(x, kernels.pack(w, torch.bfloat16, amx=True), 64)
    fma = kernels.linear(x, kernels.pack(w, torch.bfloat16, amx=False), 64)
    rounded = x.bfloat16().float() @ w.float().T  # what bf16-rounded activations would give
    err = lambda y: (y - exact).abs().max().item()  # noqa: E731
    assert err(amx) <= 2 * err(fma) + 1e-6 and err(amx) * 20 < err(rounded)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("isa", ISAS)
def test_int8_projection_matches_torch_int_mm_and_is_row_invariant(smooth, isa, monkeypatch):
    """W8A8 on every ISA: VNNI's dpbusd where present, else int16 widening + pmaddwd, both exact int32 sums."""
    from spectrt.runtime.engines.int8 import Int8Linear

    monkeypatch.setenv("SPECTRT_ISA", isa)
    gen = torch.Generator().manual_seed(7)
    w, x = torch.randn(130, 70, generator=gen), 3 * torch.randn(9, 70, generator=gen)  # K and N not multiples
    proj = Int8Linear(w, w.abs().amax(1), x.abs().amax(), torch.rand(70, generator=gen) + 0.5 if smooth else None)
    packed = kernels.pack_int8(proj)
    y = kernels.linear(x, packed, 130)
    # the same int8 operands and an exact int32 sum: equal to torch's _int_mm path up to the final fp32 multiply
    torch.testing.assert_close(y, proj(x), rtol=1e-6, atol=1e-5)
    for i in range(9):
        assert torch.equal(kernels.linear(x[i:i + 1], packed, 130)[0], y[i])


@pytest.mark.parametrize("isa", ISAS)
def test_native_matches_reference_forward(reference, isa_engines, isa):
    target = isa_engines(isa)
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


# the portable build (a correctness fallback ~10x slower) checks an 8-node tree: 64 single steps there cost 16 s
@pytest.mark.parametrize(("engine_name", "nodes"), [
    (name, nodes) for name in [*[f"{isa}-{dt}" for isa in ISAS for dt in ("fp32", "bf16", "bf16dot")], "bf16_amx",
                               "bf16dot_amx"]
    for nodes in (8, 64) if not (name.startswith("portable") and nodes == 64)])
def test_tree_rows_are_bitwise_single_token_steps(request, isa_engines, engine_name, nodes):
    """Each row of a T-node tree forward == the forward of that node alone over the same prefix + ancestors."""
    if engine_name.endswith("_amx"):
        engine = request.getfixturevalue(engine_name)
    else:
        isa, dt = engine_name.split("-")
        engine = isa_engines(isa, {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dt, dt))
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


@pytest.mark.parametrize("isa", ISAS)
def test_forward_many_equals_separate_forwards(isa_engines, isa):
    target = isa_engines(isa)
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


@pytest.mark.parametrize("isa", ISAS)
def test_logit_rows_skip_the_head_for_the_others_only(isa_engines, isa):
    """`logit_rows`: a prefill chunk's logits (0) and all but a row's (1) are not computed; the rows kept are bitwise
    those of the full forward, and every row's K/V is written as before (the LM head is the forward's last step)."""
    target = isa_engines(isa, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    prefixes = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (7, 20, 33)]
    trees = [Tree.parse("1,1,1"), Tree.parse("2,1"), Tree.parse("2,2")]
    tokens = [torch.randint(0, 49152, (len(t),), generator=gen) for t in trees]

    def run(logit_rows):
        caches = [_prefilled(target, p) for p in prefixes]
        segments = [(tok, tree.positions(len(p)), tree.mask, c)
                    for p, tree, tok, c in zip(prefixes, trees, tokens, caches, strict=True)]
        return target.forward_many(segments, logit_rows), [c.k.clone() for c in caches]

    (full, k_full), (cut, k_cut) = run(None), run([0, 1, None])
    assert [len(lg) for lg in cut] == [0, 1, len(trees[2])]
    assert torch.equal(cut[1], full[1][-1:]) and torch.equal(cut[2], full[2])
    assert all(torch.equal(a, b) for a, b in zip(k_full, k_cut, strict=True))
    with pytest.raises(ValueError, match="3 segments"):
        target.forward_many([], [0, 1, 2])


@pytest.fixture(scope="module")
def bf16_prompts(tokenizer):
    return [chat_ids(tokenizer, p) for p in PROMPTS]


@pytest.mark.parametrize("spec", ["2,2,1", "1,1,1,1"])
@pytest.mark.parametrize("isa", ISAS)
def test_bf16_greedy_tree_equals_bf16_autoregressive(isa_engines, isa, draft_dir, bf16_prompts, spec, monkeypatch):
    """bf16 is an exact mode on every ISA: its tree decoding gives its own AR tokens (it did on 4/12 prompts before).
    The best build decodes 4 prompts x 64 tokens (test_decoder runs every loop test in bf16 on it besides); the other
    builds compute bitwise its logits (`test_every_isa_computes_the_same_logits`), so 2 x 32 check their loop (the
    portable build, a correctness fallback ~10x slower, 1 x 24)."""
    bf16 = isa_engines(isa, torch.bfloat16)
    monkeypatch.setenv("SPECTRT_ISA", isa)
    draft = Transformer.load(draft_dir, torch.bfloat16) if spec == "2,2,1" else bf16
    ar = Decoder(bf16, None, EOS, max_seq_len=512)
    spec_decoder = Decoder(bf16, draft, EOS, max_seq_len=512)
    accepted = 0
    scale = {ISAS[0]: (4, 64), "portable": (1, 24)}.get(isa, (2, 32))  # (prompts, tokens)
    prompts, tokens = bf16_prompts[:scale[0]], scale[1]
    for ids in prompts:
        expected = ar.generate(ids, tokens).token_ids
        result = spec_decoder.generate(ids, tokens, Tree.parse(spec))
        assert result.token_ids == expected
        accepted += sum(result.stats.accepted)
    assert accepted > 0


@pytest.fixture
def avx512_without_bf16(monkeypatch, isa_engines):
    """The AVX-512 build as a CPU without AVX512_BF16 compiles it (bf16dot's pair sums emulated under DAZ|FTZ), on a
    CPU that has it: Skylake to Ice Lake run that build, so it is tested wherever it can be built. Yields the bf16dot
    engine of the build with BF16 (loaded first)."""
    if "avx512" not in ISAS or "avx512_bf16" not in kernels.cpu_flags():
        pytest.skip("no AVX512_BF16 here: the avx512 build already is the emulating one (tested with every ISA)")
    native = isa_engines("avx512", "bf16dot")
    monkeypatch.setenv("SPECTRT_ISA", "avx512")
    monkeypatch.setenv("SPECTRT_NO_AVX512_BF16", "1")
    kernels._build.cache_clear()
    yield native
    monkeypatch.delenv("SPECTRT_NO_AVX512_BF16")
    kernels._build.cache_clear()


def test_bf16dot_emulated_avx512_build_computes_the_same(avx512_without_bf16, target_dir):
    """Pair sums bitwise VDPBF16PS's, and a tree forward's logits and K/V bitwise those of the build with BF16."""
    native = avx512_without_bf16
    assert kernels.load_kernels().bf16_dot == "emulated" and native.native.kernels.bf16_dot == "vdpbf16ps"
    gen = torch.Generator().manual_seed(13)
    w, x = torch.randn(200, 71, generator=gen), torch.randn(7, 71, generator=gen)
    assert torch.equal(kernels.linear(x, kernels.pack(w, torch.bfloat16, amx=False, pairs=True), 200), _pair_sums(x, w))
    emulated = Transformer.load(target_dir, torch.bfloat16, pair_dots=True)
    prefix = torch.randint(0, 49152, (30,), generator=gen).tolist()
    tree = Tree.parse("3,2,1")
    tokens = torch.randint(0, 49152, (len(tree),), generator=gen)
    out = []
    for engine in (emulated, native):
        cache = _prefilled(engine, prefix)
        out.append((engine.forward(tokens, tree.positions(30), tree.mask, cache).clone(), cache.k[:, :, :40].clone()))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])


@pytest.mark.parametrize("gemm", ["pair FMAs", "AMX"])
def test_bf16dot_greedy_tree_equals_its_autoregressive(request, isa_engines, draft_dir, bf16_prompts, gemm):
    """bf16dot is an exact mode of its own: tree decoding (a bf16 draft's 2,2,1 trees) gives bf16dot AR's tokens.
    Its rows are invariant on every build (`test_tree_rows_are_bitwise_single_token_steps`) and every build computes
    the best one's logits (`test_every_isa_computes_the_same_logits`), so the best build decodes here; and so does
    the AMX engine, whose logits are its own."""
    target = isa_engines(ISAS[0], "bf16dot") if gemm == "pair FMAs" else request.getfixturevalue("bf16dot_amx")
    ar = Decoder(target, None, EOS, max_seq_len=512)
    spec_decoder = Decoder(target, Transformer.load(draft_dir, torch.bfloat16), EOS, max_seq_len=512)
    accepted = 0
    for ids in bf16_prompts[:3]:
        expected = ar.generate(ids, 48).token_ids
        result = spec_decoder.generate(ids, 48, Tree.parse("2,2,1"))
        assert result.token_ids == expected
        accepted += sum(result.stats.accepted)
    assert accepted > 0


def test_bf16dot_needs_the_native_forward(target_dir):
    with pytest.raises(ValueError, match="bf16dot runs on the native CPU forward only"):
        Transformer.load(target_dir, torch.bfloat16, native=False, pair_dots=True)


@pytest.mark.parametrize("isa", ISAS[1:])
def test_every_isa_computes_the_same_logits(isa_engines, isa, monkeypatch):
    """simd.h gives every ISA the same per-lane operations and one reduction order: logits, KV rows and INT8
    projections are bitwise those of the best build here, so answers made on one CPU regenerate on another."""
    from spectrt.runtime.engines.int8 import Int8Linear

    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 49152, (80,), generator=gen)  # 80 rows: full and partial row blocks of every kernel
    tree = Tree.parse("3,2,2,1")
    tokens = torch.randint(0, 49152, (len(tree),), generator=gen)
    w, x = torch.randn(130, 70, generator=gen), 3 * torch.randn(9, 70, generator=gen)
    proj = Int8Linear(w, w.abs().amax(1), x.abs().amax(), torch.rand(70, generator=gen) + 0.5)

    def outputs(name: str) -> list[torch.Tensor]:
        out = []
        for dtype in (torch.float32, torch.bfloat16, "bf16dot"):
            engine = isa_engines(name, dtype)
            cache = engine.new_cache(128, 96)
            causal = torch.ones(80, 80, dtype=torch.bool).tril()
            out.append(engine.forward(prefix, torch.arange(80), causal, cache)[-3:].clone())
            cache.commit(80)
            out.append(engine.forward(tokens, tree.positions(80), tree.mask, cache).clone())
            out.append(cache.k[:, :, :90].clone())
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SPECTRT_ISA", name)
            out.append(kernels.linear(x, kernels.pack_int8(proj), 130))
        return out

    for mine, best in zip(outputs(isa), outputs(ISAS[0]), strict=True):
        assert torch.equal(mine, best)


def test_native_decoding_allocates_no_buffers(target, bf16_prompts):
    decoder = Decoder(target, target, EOS, max_seq_len=512)
    native = target.native
    before = [t.data_ptr() for t in native.scratch + [native.rope_cos, decoder.target_caches[0].k]]
    decoder.generate(bf16_prompts[0], 24, Tree.parse("2,2,1"))
    assert [t.data_ptr() for t in native.scratch + [native.rope_cos, decoder.target_caches[0].k]] == before


def test_streamed_weights_share_one_huge_page_aligned_buffer(target):
    """Every weight a forward streams is copied, unchanged, into one buffer starting on a 2 MB boundary, so the
    kernel can back it with huge pages (kernels.huge_page_arena)."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=gen), torch.randn(300, generator=gen).bfloat16(), torch.arange(9)]
    copies = kernels.huge_page_arena(tensors)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(tensors, copies, strict=True))
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(tensors, copies, strict=True))
    native = target.native
    streamed = [native.head] + [p[0] for p in native.projections]
    starts = sorted(w.data_ptr() for w in streamed)
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert starts[0] % kernels.HUGE_PAGE == 0
        span = max(w.data_ptr() + w.numel() * w.element_size() for w in streamed) - starts[0]
        assert span <= sum(-(-w.numel() * w.element_size() // 4096) * 4096 for w in streamed)


def test_native_kv_pools_are_zeroed_and_huge_page_aligned(target):
    """The native forward's KV pool comes from kernels.huge_page_zeros: zeros of the pool's shape, fp32, on a 2 MB
    boundary where the platform has THP advice, its slots views of it."""
    caches = target.new_caches(2, 96, 8)
    pool = caches[0].pool_k
    c = target.config
    assert pool.shape == (2, c.num_layers, c.num_kv_heads, 96, c.head_dim) and pool.dtype == torch.float32
    assert not pool.any() and not caches[1].pool_v.any()
    if hasattr(__import__("mmap"), "MADV_HUGEPAGE"):
        assert pool.data_ptr() % kernels.HUGE_PAGE == 0
    assert caches[1].k.data_ptr() == pool[1].data_ptr()
    assert all(cache.kernels is target.native.kernels for cache in caches)  # they compact natively


def test_native_refuses_bad_token_ids(target):
    cache = target.new_cache(64, 8)
    with pytest.raises(ValueError, match="token ids must lie in"):
        target.forward(torch.tensor([49152]), torch.arange(1), torch.ones(1, 1, dtype=torch.bool), cache)


def test_native_forward_releases_the_gil(target):
    """A server's other threads (a Triton stub sending responses) run while a forward computes: a counting thread
    advances inside every native call. Held GIL: it could only run at the interpreter's switch points, never inside
    the call (the window between reading the counter and entering the call is pure Python)."""
    import sys
    import threading

    counter, stop, inside = [0], threading.Event(), []

    def count():
        while not stop.is_set():
            counter[0] += 1

    class Probe:  # wraps the extension module: counts what the other thread did during the native call only
        def __init__(self, real):
            self.real = real

        def __getattr__(self, name: str):  # the module's other members (`Bound`, which the forward is called with)
            return getattr(self.real, name)

        def forward(self, *args):
            before = counter[0]
            self.real.forward(*args)
            inside.append(counter[0] - before)

    native, real = target.native, target.native.kernels
    cache = prefilled_cache(target, 300)  # 300 committed tokens: each 16-row forward takes a while
    tree = _heap_tree(16)
    thread = threading.Thread(target=count, daemon=True)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)  # preemption is rare: the counting thread gets the GIL when a call releases it
    native.kernels = Probe(real)
    thread.start()
    try:
        for _ in range(5):
            target.forward(torch.arange(16), tree.positions(300), tree.mask, cache)
    finally:
        native.kernels = real
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert len(inside) == 5 and all(n > 0 for n in inside), inside


@pytest.mark.parametrize("isa", ISAS)
def test_the_lm_heads_argmax_is_numpys(isa, monkeypatch):
    """The LM head's argmax rule (each 64-column panel's maximum, then the first index of the first panel holding
    the largest) is numpy's argmax: the first of tied values within a panel and across panels, a NaN wherever one
    is (its first), infinities, an all -inf row and a width that is not a whole number of panels."""
    monkeypatch.setenv("SPECTRT_ISA", isa)
    native = kernels.load_kernels()
    g = torch.Generator().manual_seed(7)
    for width in (1, 50, 64, 200, 49152):
        rows = torch.randint(-3, 3, (8, width), generator=g).float()  # few values: ties everywhere
        rows[1] = 0.0
        rows[2, width // 2] = torch.nan
        rows[3, -1] = torch.inf
        rows[4] = -torch.inf
        rows[5, 0] = -torch.inf
        rows[6, width // 3] = torch.nan
        rows[6, 0] = torch.inf
        rows[7] = torch.randn(width, generator=g)
        assert native.argmax_rows(rows).tolist() == rows.numpy().argmax(-1).tolist(), width


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_keeps_each_logits_rows_argmax(isa_engines, isa, dtype):
    """The forward's own argmax of its logits (`argmax_of`) is each row's numpy argmax, per segment of a batched
    forward; blocks that are not that forward's logits (an older forward's, a copy) get None."""
    target = isa_engines(isa, dtype)
    gen = torch.Generator().manual_seed(11)
    prefixes = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (6, 25)]
    trees = [Tree.parse("2,1"), Tree((-1,))]
    tokens = [torch.randint(0, 49152, (len(t),), generator=gen) for t in trees]
    caches = [_prefilled(target, p) for p in prefixes]
    logits = target.forward_many([(tok, tree.positions(len(p)), tree.mask, c)
                                  for p, tree, tok, c in zip(prefixes, trees, tokens, caches, strict=True)])
    assert target.argmax_of(logits) == [lg.numpy().argmax(-1).tolist() for lg in logits]
    assert target.argmax_of(logits[1:]) == [logits[1].numpy().argmax(-1).tolist()]
    assert target.argmax_of([logits[0].clone()]) is None
    alone = target.forward(tokens[1], trees[1].positions(len(prefixes[1]) + 1), trees[1].mask, caches[1])
    assert target.argmax_of([alone]) == [alone.numpy().argmax(-1).tolist()]
    assert target.argmax_of(logits) is None  # the older forward's
