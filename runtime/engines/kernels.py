"""spectrt's native CPU forward (runtime/engines/cpu_kernels.cpp over runtime/engines/simd.h): build once per ISA, pack weights, run.

Why it exists (measured, 2 threads, SmolLM2-135M fp32): the torch reference forward spends ~31 ms per token,
of which the GEMMs are ~half (MKL's small-M paths read the weights once per few rows: an 8-row projection costs
~3x a 1-row one) and the rest is ~600 small op dispatches per forward. The native forward runs a whole forward in
one call, streams each weight panel once for all rows, and computes every row with the same operations whatever
the number of rows, so verification rows are bitwise equal to single-token steps in fp32 and bf16 alike.

One source, one build per instruction set: `avx512` (AVX-512F/BW, plus VNNI/AMX where the CPU has them), `avx2`
(AVX2+FMA, plus AVX-VNNI where present) and `portable` (GCC/Clang vector extensions: any CPU, aarch64 included).
simd.h gives every ISA the same per-lane results and one fixed reduction order, so all builds compute bitwise the
same logits. The best ISA this CPU executes is picked; `SPECTRT_ISA=avx512|avx2|portable` forces one (so one
machine can build and test every path it can run). Each build is compiled with the machine's compiler the first
time it is needed (`make setup` builds the default one; about a minute) and cached under ~/.cache/spectrt/. If
none can be built (no compiler), the torch reference path runs instead and `native_unavailable()` says why.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import platform
from collections.abc import Sequence
from functools import cache, lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from spectrt.runtime.resources import package_path

SOURCE = package_path("runtime/engines/cpu_kernels.cpp")
HEADERS = (package_path("runtime/engines/simd.h"),  # the SIMD layer the source includes
           package_path("runtime/engines/thread_pool.h"))  # the pool its parallel loops run on
PANEL = 64  # output columns per packed weight panel (NR in cpu_kernels.cpp)
AMX_K = 32  # k per AMX tile step (KB in cpu_kernels.cpp): AMX-packed weights pad K to a multiple of it
ISAS = ("avx512", "avx2", "portable")  # best first
CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_failures: dict[str, str] = {}
_build_dirs: dict[str, Path] = {}


@cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo; empty where there is none)."""
    return frozenset((_cpuinfo("flags") or _cpuinfo("Features")).split())


def _cpuinfo(key: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == key:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_class() -> str:
    """This CPU's class for benchmark records: vendor, product line (AMD: Zen generation) and widest vector ISA,
    e.g. 'Intel Xeon, AVX-512/AMX' or 'AMD EPYC Zen 3, AVX2'. Speeds are comparable only within a class."""
    words = [w for w in _cpuinfo("model name").replace("(R)", "").replace("(TM)", "").split()
             if w not in ("Processor", "CPU")]
    line = " ".join(words[:2]) or platform.processor() or platform.machine()
    flags = cpu_flags()
    if _cpuinfo("vendor_id") == "AuthenticAMD":
        family = int(_cpuinfo("cpu family") or 0)  # 25 holds Zen 3 and Zen 4; only Zen 4 has AVX-512
        zen = {23: "Zen 2", 25: "Zen 4" if "avx512f" in flags else "Zen 3", 26: "Zen 5"}.get(family)
        line = f"{line} {zen}" if zen else line
    isa = ("AVX-512/AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
           else platform.machine())
    return f"{line}, {isa}"


def isa_flags(isa: str) -> list[str] | str:
    """The compiler flags of `isa` on this machine, or why this CPU cannot run it."""
    x86 = platform.machine() in ("x86_64", "AMD64")
    flags = cpu_flags()
    if isa == "avx512":
        missing = sorted({"avx512f", "avx512bw"} - flags) if x86 else ["x86-64"]
        # -march=native: everything this CPU has (VNNI, BF16, AMX) beyond the AVX-512 the layer needs.
        # SPECTRT_NO_AVX512_BF16=1 leaves BF16 out on a CPU that has it: the build of an AVX-512 CPU without it
        # (Skylake to Ice Lake), bf16dot's pair sums emulated, so the tests can run that build here too; such a CPU
        # has no AMX either (and the AMX path's conversions are AVX512_BF16 instructions).
        no_bf16 = (["-mno-avx512bf16", "-mno-amx-bf16", "-mno-amx-tile"]
                   if os.environ.get("SPECTRT_NO_AVX512_BF16") == "1" else [])
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        return ["-march=native", *no_bf16, "-DSPECTRT_ISA_AVX512"]
    if isa == "avx2":
        missing = sorted({"avx2", "fma"} - flags) if x86 else ["x86-64"]
        if missing:
            return f"this CPU lacks {', '.join(missing)}"
        # explicit extensions, not -march=native: an AVX-512 machine must build exactly what an AVX2 one runs
        return ["-mavx2", "-mfma", "-mf16c", "-mtune=native", "-DSPECTRT_ISA_AVX2",
                *(["-mavxvnni"] if "avx_vnni" in flags else [])]
    if isa == "portable":
        arch = ["-march=native"] if x86 else ["-mcpu=native"] if platform.machine() in ("aarch64", "arm64") else []
        return [*arch, "-DSPECTRT_ISA_PORTABLE"]
    raise ValueError(f"unknown ISA {isa!r}: SPECTRT_ISA must be one of {', '.join(ISAS)}")


def stream_flags() -> list[str]:
    """How the GEMM prefetches its weight stream on this CPU (cpu_kernels.cpp `STREAM_LOCALITY`): non-temporal on
    AMD, where it measured faster (Zen 4), into L2 elsewhere (the non-temporal hint halved an Intel Xeon's stream)."""
    return ["-DSPECTRT_STREAM_NTA"] if _cpuinfo("vendor_id") == "AuthenticAMD" else []


def runnable_isas() -> list[str]:
    """The ISAs this CPU executes, best first."""
    return [isa for isa in ISAS if isinstance(isa_flags(isa), list)]


@cache
def _build(isa: str):
    """The compiled extension module of one ISA, or None (with the reason kept in `_failures`)."""
    flags = isa_flags(isa)
    if isinstance(flags, str):
        _failures[isa] = f"SPECTRT_ISA={isa}, but {flags}"
        return None
    missing = [p for p in (SOURCE, *HEADERS) if not p.is_file()]
    if missing:
        _failures[isa] = f"the kernel source {missing[0]} is missing from this install: reinstall spectrt"
        return None
    texts = {p.name: p.read_text() for p in (SOURCE, *HEADERS)}
    cflags = CFLAGS + flags + stream_flags()
    # torch's own location is in the key: the build reads its headers by path, so two environments sharing one cache
    # directory (a checkout's and a worktree's .venv) would otherwise rebuild it in turn, a minute each time; and
    # the ninja that builds it, for the same reason (two ninja versions read each other's build log as stale)
    key = hashlib.sha256("\0".join([*texts.values(), " ".join(cflags), torch.__version__,
                                     str(Path(torch.__file__).parent), _ninja_dir()]).encode()).hexdigest()[:16]
    build_dir = Path(os.environ.get("SPECTRT_CACHE", Path.home() / ".cache" / "spectrt")) / f"kernels-{isa}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    _build_dirs[isa] = build_dir
    # Compiled from a copy in the cache: the build depends on the sources' content only, not on where the package
    # lives (ninja rebuilds when a source path changes, so a checkout and a wheel install would rebuild in turn).
    for name, text in texts.items():
        copy = build_dir / name
        if not copy.is_file() or copy.read_text() != text:
            partial = build_dir / f".{name}.{os.getpid()}"
            partial.write_text(text)
            partial.replace(copy)
    path = os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load

        # One ninja for every process. torch runs the first `ninja` on PATH: a test or CLI process found the system's
        # (1.11) and a tritonserver stub the environment's (1.13, its bin/ first on PATH); each read the other's
        # build log as stale and recompiled, 1-2 minutes at every switch (most of the test suite's time).
        ninja = _ninja_dir()
        os.environ["PATH"] = os.pathsep.join([ninja, path]) if ninja else path
        return load(name=f"spectrt_cpu_{isa}_{key}", sources=[str(build_dir / SOURCE.name)], extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # a missing compiler or ninja: the reference path still works
        _failures[isa] = f"building the {isa} kernels failed ({type(exc).__name__}: {str(exc).strip()[-300:]})"
        return None
    finally:
        os.environ["PATH"] = path


def build_dir(isa: str) -> Path | None:
    """Where the cached build of `isa` lives (None before this process built or loaded it)."""
    return _build_dirs.get(isa)


def _ninja_dir() -> str:
    """The directory of the `ninja` Python package's binary (a dependency), '' where it is not installed."""
    try:
        import ninja
    except ImportError:
        return ""
    return str(ninja.BIN_DIR)


def load_kernels():
    """The extension module of the ISA in use (SPECTRT_ISA, else the best one that builds here), or None."""
    if os.environ.get("SPECTRT_NATIVE", "1") == "0":
        _failures["native"] = "disabled by SPECTRT_NATIVE=0"
        return None
    forced = os.environ.get("SPECTRT_ISA", "").strip().lower()
    if forced:
        isa_flags(forced)  # an unknown name is an error, not a silent fallback
        return _build(forced)
    for isa in runnable_isas():
        module = _build(isa)
        if module is not None:
            return module
    return None


def native_unavailable() -> str | None:
    """None when the native forward can run here, else the reason it cannot."""
    if load_kernels() is not None:
        return None
    if os.environ.get("SPECTRT_NATIVE", "1") == "0":
        return _failures["native"]
    forced = os.environ.get("SPECTRT_ISA", "").strip().lower()
    return _failures.get(forced) if forced else "; ".join(_failures[i] for i in ISAS if i in _failures)


def native_isa() -> str | None:
    """The ISA of the native forward in use ('avx512', 'avx2', 'portable'), None on the reference path."""
    module = load_kernels()
    return None if module is None else module.isa


@cache
def _amx_granted(module) -> bool:
    return module.amx_init()


def amx_supported() -> bool:
    """The CPU has AMX-BF16, the AVX-512 build is in use, and Linux granted this process its tile state."""
    module = load_kernels()
    return (module is not None and module.isa == "avx512" and {"amx_bf16", "amx_tile"} <= cpu_flags()
            and _amx_granted(module))


def amx_enabled(pairs: bool = False) -> bool:
    """Whether engines pack for the AMX GEMM (cpu_kernels.cpp `gemm_amx`) where the CPU supports it: bf16dot's
    (`pairs`) by default, SPECTRT_AMX=0 turns it off; bf16's opt-in with SPECTRT_AMX=1.

    Why bf16dot by default (Intel Xeon model 207, 2 cores, context 128, one process interleaved, best of 4 rounds'
    medians, `scripts/isa_tcurve.py --isas avx512 --dtypes bf16,bf16dot+fma,bf16dot`): its inputs are one bf16 part, so
    T=1 costs no more than on pair FMAs (9.8 vs 11.9 ms) and every verify is cheaper: T=8 18.7 -> 13.1 ms, T=16 32.3 ->
    15.6, T=64 124.9 -> 35.1 (bf16 on FMA 12.0 / 16.0 / 21.9 / 82.3). Why bf16's is opt-in (measured, whole bf16
    forward, AMX vs FMA interleaved in one process under the team lock, best of 4 rounds): its fp32 activations take
    three bf16 parts, which flattens the verify curve (context 128: T=16 34.3 -> 26.9 ms, T=32 63.3 -> 46.2; context
    1024: T=16 71.9 -> 61.8) but a step of 1-2 rows, AR decoding and the draft's levels, gets 5-11% slower (T=1 16.2 ->
    17.0 ms at context 128, 19.0 -> 21.1 at 1024), and at T=8 they are even. Every path is row invariant, so tree == AR
    holds in each; the AMX paths sum in the tile unit's order and rounding, so their logits differ from the other
    builds' in the last bits.
    """
    setting = os.environ.get("SPECTRT_AMX", "")
    return (setting == "1" or (pairs and setting != "0")) and amx_supported()


def pack(weight: torch.Tensor, dtype: torch.dtype, amx: bool | None = None, pairs: bool = False) -> torch.Tensor:
    """[N, K] weight -> [ceil(N/PANEL), K, PANEL] panels (zero-padded columns), as the FMA GEMM streams them; bf16
    with AMX (`amx`: None = `amx_enabled(pairs)`) -> [P, 4, Kp/32, 16, 16, 2]: per panel, each group of 16 columns a
    stream of tiles of 16 k-pairs x 16 columns x 2 consecutive k (the layout TDPBF16PS reads), K zero-padded.
    `pairs` (bf16dot: bf16 GEMM inputs) -> bf16 [P, ceil(K/2), PANEL, 2]: each column's weights of k = 2q, 2q + 1
    side by side (the layout VDPBF16PS reads), K zero-padded to even; with AMX the same tiles as bf16's, 5-D
    [P, 4, Kp/32, 16, 32] (the rank tells the kernel its inputs are one bf16 part, `gemm_amx`)."""
    n, k = weight.shape
    amx = amx_enabled(pairs) if amx is None else amx
    if amx and not amx_supported():
        raise ValueError("AMX packing needs a CPU with AMX-BF16 and the tile state granted: pack with amx=False")
    if (dtype == torch.bfloat16 or pairs) and amx:
        # [P*64, Kp]: column 16 j + c, k = 32 b + 2 q + e
        w = F.pad(weight.to(torch.bfloat16), (0, -k % AMX_K, 0, -n % PANEL))
        tiles = w.view(-1, 4, 16, w.shape[1] // AMX_K, 16, 2)  # [P, j, c, b, q, e]
        tiles = tiles.permute(0, 1, 3, 4, 2, 5).contiguous()  # [P, j, b, q, c, e]
        return tiles.flatten(4) if pairs else tiles
    if pairs:
        w = F.pad(weight.to(torch.bfloat16), (0, k % 2, 0, -n % PANEL))  # [P*64, 2 K2]
        return w.view(-1, PANEL, w.shape[1] // 2, 2).transpose(1, 2).contiguous()
    w = F.pad(weight.to(dtype), (0, 0, 0, -n % PANEL))
    return w.view(-1, PANEL, k).transpose(1, 2).contiguous()


HUGE_PAGE = 1 << 21  # x86-64 and aarch64's transparent huge page


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in fresh memory the kernel backs with 2 MB pages where it can (Linux THP, `madvise` mode),
    starting on a 2 MB boundary. The buffer is private anonymous memory (a shared mapping would be shmem, whose huge
    pages are off by default); its pages are allocated at their first write (a KV pool writes them all at load:
    `KVCache.pool`). Where the system has no THP advice it is torch.zeros. For the KV pool: a forward reads every
    committed K/V row (fp32: 46 KB a position for SmolLM2-135M, 92 MB at context 2000). Measured (Zen 4, bf16, one
    process, interleaved): context 2000 T=1 11.82 -> 11.49 ms, T=4 14.50 -> 13.94 (AVX-512), within noise at 128."""
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: the pages are huge from their first fault
    data = torch.frombuffer(buffer, dtype=torch.uint8)  # the tensor keeps the mapping alive
    offset = -data.data_ptr() % HUGE_PAGE
    return data[offset:offset + nbytes].view(dtype).view(shape)


def huge_page_arena(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one `huge_page_zeros` buffer, each on a 4 KB boundary (unchanged where the system has no
    THP advice). Why: a forward streams every weight once, and on 4 KB pages each page costs a TLB miss (and, in a
    VM, a nested page walk) the prefetchers stop at. Measured (Zen 4 VM, bf16 SmolLM2-135M, 2 threads, context 128,
    one process, the same weights on 4 KB and on 2 MB pages, interleaved): T=1 8.3-9.4 -> 6.4 ms on AVX-512,
    7.6-9.1 -> 6.4-6.7 ms on the AVX2 build; T=8 16.2-16.4 -> 15.9-16.1."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not tensors:
        return tensors
    sizes = [-(-t.numel() * t.element_size() // 4096) * 4096 for t in tensors]
    data, offset, out = huge_page_zeros((sum(sizes),), torch.uint8), 0, []
    for t, size in zip(tensors, sizes, strict=True):
        view = data[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        out.append(view.copy_(t))
        offset += size
    return out


def logit_counts(rows: list[int], logit_rows: Sequence[int | None] | None) -> list[int]:
    """Per segment, how many of its last rows get logits: `logit_rows[i]` (None: every row), at most its rows. The
    engines' `logit_rows` argument: a prefill chunk's logits are never read (0), a draft catch-up's only its last
    row's (1); the native forward skips the LM head for the others (`head_rows`)."""
    if logit_rows is None:
        return list(rows)
    if len(logit_rows) != len(rows):
        raise ValueError(f"logit_rows names {len(logit_rows)} segments for {len(rows)}")
    return [t if n is None else max(0, min(int(n), t)) for t, n in zip(rows, logit_rows, strict=True)]


EMPTY = torch.empty(0)  # an optional output the native call skips
EVERY_ROW = torch.empty(0, dtype=torch.long)  # `head_rows` naming none: the logits tensor's rows say all or none


def head_rows(rows: list[int], counts: list[int]) -> torch.Tensor:
    """The forward's row indices whose logits are computed (each segment's last `counts[i]`), ascending; `EVERY_ROW`
    when that is every row or none (the C++ forward's `head_rows`), made once: the decode step passes it every time."""
    if counts == rows or not any(counts):
        return EVERY_ROW
    return _head_rows(tuple(rows), tuple(counts))


@lru_cache(maxsize=1024)
def _head_rows(rows: tuple[int, ...], counts: tuple[int, ...]) -> torch.Tensor:
    """`head_rows` of one layout, made once (read only by the native call): a draft step's catch-up pass has the same
    few layouts step after step, and a tensor made each time was a torch op on cold caches."""
    index, start = [], 0
    for t, n in zip(rows, counts, strict=True):
        index.extend(range(start + t - n, start + t))
        start += t
    return torch.tensor(index, dtype=torch.long)


def last_rows(logits: list[torch.Tensor], logit_rows: Sequence[int | None] | None) -> list[torch.Tensor]:
    """Every row's logits per segment cut to the last `logit_rows[i]` rows (`logit_counts`): how the engines that
    compute every row (the torch reference, ONNX Runtime, TensorRT) answer `logit_rows`."""
    counts = logit_counts([len(lg) for lg in logits], logit_rows)
    return [lg if n == len(lg) else lg[len(lg) - n:] for lg, n in zip(logits, counts, strict=True)]


def fp32_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as the contiguous fp32 tensor a native call reads: itself where it is one already. Why: `.contiguous()` and
    `.float()` dispatch a torch op even when they return `t`, and each op in the loop runs on the caches a forward
    has just flushed (~10-20 us each at batch 1)."""
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t`, contiguous, without a torch op where it is already (`fp32_rows`)."""
    return t if t.is_contiguous() else t.contiguous()


def split_rows(t: torch.Tensor, rows: list[int]) -> list[torch.Tensor]:
    """`t` split into per-segment row blocks; one segment (the batch-1 step) is `t` itself: no torch op on the caches
    a forward has just flushed."""
    return [t] if len(rows) == 1 else list(t.split(rows))


def pack_int8(proj) -> list[torch.Tensor]:
    """A W8A8 projection (runtime/engines/int8.py Int8Linear) as the int8 GEMM reads it: weights [P, K/4, PANEL, 4] (4
    consecutive k of one column per 32-bit lane, for VNNI), pre_quant_scale (or empty), the static input scale
    (empty: per-token scales), per (group, column) output scales and 128 * sum_k w over the group (the
    unsigned-activation correction), both [groups, P * PANEL], and the group size."""
    w = proj.weight
    n, k = w.shape
    padded = F.pad(w, (0, -k % 4, 0, -n % PANEL))
    packed = padded.view(-1, PANEL, padded.shape[1] // 4, 4).permute(0, 2, 1, 3).contiguous()
    pre = proj.pre_quant_scale if proj.pre_quant_scale is not None else torch.empty(0)
    colsum = torch.stack([128 * w[:, a:b].to(torch.int32).sum(1) for a, b in proj.bounds]).to(torch.int32)
    in_scale = torch.empty(0) if proj.per_token else proj.input_scale.float().reshape(1)
    group = torch.tensor([proj.group if len(proj.bounds) > 1 else packed.shape[1] * 4], dtype=torch.int64)
    return [packed, pre.float().contiguous(), in_scale, F.pad(proj.output_scale.float(), (0, -n % PANEL)).contiguous(),
            F.pad(colsum, (0, -n % PANEL)).contiguous(), group]


def pack_projection(w, dtype: torch.dtype, pairs: bool = False) -> list[torch.Tensor]:
    """[packed] for an fp weight (k pairs for bf16dot: `pack`), the six W8A8 tensors for an INT8 projection."""
    return [pack(w, dtype, pairs=pairs)] if isinstance(w, torch.Tensor) else pack_int8(w)


def linear(x: torch.Tensor, proj: list[torch.Tensor] | torch.Tensor, n_out: int) -> torch.Tensor:
    """x [M, K] fp32 @ W^T with a packed projection: each output row computed identically whatever M."""
    return load_kernels().linear(x.contiguous(), [proj] if isinstance(proj, torch.Tensor) else proj, n_out)


def bound_arguments(owner):
    """`owner`'s forward arguments that stay the same from call to call (`owner.bound_fields()`) as its kernels
    module's `Bound` (cpu_kernels.cpp), converted once: passed at every call, pybind converted each tensor (84 us a
    target forward on the caches a forward had flushed). Made again after `reserve` grows the scratch (it sets
    `owner._bound` to None) or for another module (scripts/isa_tcurve.py swaps them)."""
    if owner._bound is None or owner._bound[0] is not owner.kernels:
        b = owner.kernels.Bound()
        for name, value in owner.bound_fields().items():
            setattr(b, name, value)
        owner._bound = (owner.kernels, b)
    return owner._bound[1]


class NativeModel:
    """Packed weights and static scratch for `cpu_kernels.forward`; one per engine, built at load.

    Weights keep the engine's dtype (fp32, or bf16 for half the memory traffic); activations, accumulation and the
    KV cache are fp32, except that with `pairs` (bf16dot) every GEMM rounds its input rows to bf16 and sums k pairs
    (cpu_kernels.cpp `dot_block`: half the multiply instructions per verified row). Scratch buffers grow only when a
    call needs more rows or positions than any before it
    (`reserve`, done by `new_cache`), so decoding allocates nothing but each forward's logits.
    The native calls release the GIL, so nothing serializes Python callers any more: run one forward at a time
    per engine (the scratch is shared), as the decoder's one loop thread does.
    """

    def __init__(self, config, embed: torch.Tensor, norm: torch.Tensor, head: torch.Tensor, layers: list[dict],
                 inv_freq: torch.Tensor, rope_scale: float, dtype: torch.dtype,
                 head_ids: torch.Tensor | None = None, pairs: bool = False):
        """`head_ids`: a vocabulary-subset draft head's target ids (its K rows score those, other ids -inf).
        `pairs`: bf16dot (bf16 weights in k pairs, bf16 GEMM inputs)."""
        if pairs and dtype != torch.bfloat16:
            raise ValueError(f"bf16dot packs bf16 weights, not {dtype}")
        self.pairs = pairs
        c = config
        self.config, self.inv_freq, self.rope_scale = c, inv_freq, rope_scale
        self.kernels = load_kernels()
        self.isa = self.kernels.isa  # the build this engine runs (kernels.py: SPECTRT_ISA or the best one here)
        fp32 = torch.float32
        self.embed = embed.to(fp32).contiguous()
        self.final_norm = norm.to(fp32).contiguous()
        self.head, self.head_ids = pack(head, dtype, pairs=pairs), head_ids
        self.norms = [n.to(fp32).contiguous() for layer in layers for n in (layer["attn_norm"], layer["mlp_norm"])]
        # per layer q/k/v, o, gate/up, down; fp weights keep `dtype`, W8A8 ones their int8 form
        self.projections = [pack_projection(layer[name], dtype, pairs) for layer in layers
                            for name in ("wqkv", "wo", "w13", "w2")]
        # every streamed weight on huge pages (huge_page_arena: ~25% off a bf16 decode step)
        streamed = huge_page_arena([self.head] + [p[0] for p in self.projections])
        self.head = streamed[0]
        for proj, packed in zip(self.projections, streamed[1:], strict=True):
            proj[0] = packed
        self.bqkv = [layer["bqkv"].to(fp32).contiguous() for layer in layers] if "bqkv" in layers[0] else []
        self.bo = [layer["bo"].to(fp32).contiguous() for layer in layers] if "bo" in layers[0] else []
        self.qk_norms = ([n.to(fp32).contiguous() for layer in layers for n in (layer["q_norm"], layer["k_norm"])]
                         if "q_norm" in layers[0] else [])
        self.dims = [c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim,
                     c.vocab_size]
        self.rows = self.positions = 0
        self.reserve(64, 2048 + 64)
        self.last_logits: torch.Tensor | None = None  # the last forward's logits, whose argmax is in `self.argmax`

    def bound_fields(self) -> dict:
        """This model's fields of `cpu_kernels.cpp` Bound (`bound_arguments`)."""
        return {"dims": self.dims, "eps": float(self.config.rms_norm_eps), "embed": self.embed, "norms": self.norms,
                "projs": self.projections, "bqkv": self.bqkv, "qk_norms": self.qk_norms, "bo": self.bo,
                "final_norm": self.final_norm, "head": self.head, "rope_cos": self.rope_cos,
                "rope_sin": self.rope_sin, "scratch": self.scratch}

    bound = property(bound_arguments)  # the forward's per-call-invariant arguments, converted once

    def reserve(self, rows: int, positions: int) -> None:
        """Make the scratch, logits and RoPE tables hold `rows` rows per call and positions < `positions`."""
        if rows <= self.rows and positions <= self.positions:
            return
        self._bound = None  # new scratch and tables: bound again at the next forward
        c = self.config
        self.rows, self.positions = max(rows, self.rows), max(positions, self.positions)
        r, q_dim = self.rows, c.num_heads * c.head_dim
        qkv_dim = q_dim + 2 * c.num_kv_heads * c.head_dim
        widths = [c.hidden_size, max(c.hidden_size, q_dim), qkv_dim, q_dim, 2 * c.intermediate_size,
                  c.intermediate_size]
        self.scratch = [torch.zeros(r, w) for w in widths] + [torch.zeros(r * c.num_heads, self.positions)]
        self.scratch.append(torch.zeros(r, max(widths) + 4, dtype=torch.uint8))  # quantized activations (W8A8)
        k_max = -(-max(c.hidden_size, q_dim, c.intermediate_size) // AMX_K) * AMX_K
        self.scratch.append(torch.zeros(-(-r // 16) * 16, 3 * k_max, dtype=torch.bfloat16))  # activation parts (AMX)
        self.argmax = torch.zeros(r, dtype=torch.long)  # each logits row's argmax, filled by the forward's LM head
        self.argmax_ids = self.argmax.numpy()  # its numpy view: reading it after a forward is no torch op (argmax_of)
        freqs = torch.arange(self.positions, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        self.rope_cos = (freqs.cos() * self.rope_scale).contiguous()
        self.rope_sin = (freqs.sin() * self.rope_scale).contiguous()

    def forward_many(self, segments, logit_rows: Sequence[int | None] | None = None) -> list[torch.Tensor]:
        """Logits per segment (tokens, positions, tree_mask, cache); rows of all segments share each GEMM; with
        `logit_rows` only each segment's last `logit_rows[i]` rows' (`logit_counts`).

        The logits are the one tensor a forward allocates (it is its result, and callers keep it across forwards);
        every intermediate lives in the static scratch.
        """
        return self.forward_features(segments, (), logit_rows)[0]

    def forward_features(self, segments, feature_layers, logit_rows: Sequence[int | None] | None = None
                         ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(logits per segment, features per segment or None): with `feature_layers`, also the residual stream
        entering each of those layers (EAGLE-3's target features), [rows, len(feature_layers) * hidden] fp32, for
        every row. Copying them costs one memcpy per row and layer; rows stay invariant."""
        rows = [s[0].shape[0] for s in segments]
        counts = logit_counts(rows, logit_rows)
        total = sum(rows)
        tokens = torch.cat([s[0] for s in segments]) if len(segments) > 1 else segments[0][0]
        positions = torch.cat([s[1] for s in segments]) if len(segments) > 1 else segments[0][1]
        caches = [s[3] for s in segments]
        masks = [contiguous(s[2]) for s in segments]
        for tok, _, mask, kv in segments:
            kv.new_slots(tok, mask)
        self.reserve(total, max(c.capacity for c in caches))  # a no-op after the first call of a given size
        logits = torch.empty(sum(counts), self.config.vocab_size if self.head_ids is None else len(self.head_ids))
        feature_layers = [int(j) for j in feature_layers]
        features = torch.empty(total, len(feature_layers) * self.config.hidden_size) if feature_layers else None
        # the per-segment views are made before the forward fills them: the same split after it was the first torch
        # op on the caches the forward had flushed, ~0.1 ms a forward (batch 1 and 8, bf16)
        split_logits = split_rows(logits, counts) if self.head_ids is None else None
        split_features = None if features is None else split_rows(features, rows)
        self.last_logits = None  # the call rewrites `self.argmax`: no earlier logits' argmax survives it
        self.kernels.forward(
            self.bound, contiguous(tokens), contiguous(positions), rows, [c.length for c in caches], masks,
            [c.k for c in caches], [c.v for c in caches], logits, head_rows(rows, counts), feature_layers,
            features if features is not None else EMPTY, self.argmax if self.head_ids is None else EMPTY,
        )
        if self.head_ids is not None:  # every id outside the subset: -inf, probability 0 (the draft never proposes it)
            logits = torch.full((len(logits), self.config.vocab_size), -torch.inf).index_copy_(1, self.head_ids, logits)
            split_logits = split_rows(logits, counts)
        else:
            self.last_logits = logits
        return split_logits, split_features

    def argmax_of(self, blocks: list[torch.Tensor]) -> list[list[int]] | None:
        """Each block's rows' argmax (`sampling.argmax_rows`), as the last forward's LM head computed them, where the
        blocks are rows of that forward's logits; else None. Of the values the forward computed: the decode loop asks
        before it masks any row in place and checks the answer against its masks (`Decoder._masks_any`). Why: the
        rows are not read again (see `gemm`'s argmax)."""
        logits = self.last_logits
        if logits is None or not blocks:
            return None
        width, best = logits.shape[1], None
        out = []
        for b in blocks:
            if b is logits:
                start = 0
            elif b._base is logits and b.is_contiguous():
                start = b.storage_offset() // width
            else:
                return None
            if best is None:  # through the numpy view: `.numpy()` here was the first torch op after the forward
                best = self.argmax_ids[:logits.shape[0]].tolist()
            out.append(best[start:start + b.shape[0]])
        return out
