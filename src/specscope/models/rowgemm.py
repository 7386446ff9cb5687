"""The row-invariant CPU kernels of models/csrc/rows_gemm.cpp: build once per instruction set, load with ctypes,
tune, call.

Why kernels of our own (bench/results/cycle_cost*.json has the evidence): stock CPU kernels re-read the weights
per row block, so verifying 8 draft tokens cost 1.4x a 1-token decode step; these stream each weight panel once
for all rows (T(8)/T(1) near 1) and give every row count the same bits (one FMA chain per output, in k order), so
a 1-row decode and an n-row verify agree exactly and greedy speculation stays lossless by construction.

One design, several instruction sets: rows_gemm.cpp is written over the vector operations of csrc/simd.h and
built for the best ISA this CPU has -- AVX-512 with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later),
AVX-512 (Skylake-SP, Ice Lake), AVX2+FMA (Haswell, Zen 1-3, Alder Lake, and VMs that hide AVX-512) or NEON (every
aarch64 CPU). `SPECSCOPE_KERNELS=avx512_bf16|avx512|avx2|neon` forces one (for side-by-side runs), `off` (or `0`)
uses the stock oneDNN + SDPA path.

bf16 (`--dtype bf16` on CPU, FORMATS "bf16a"): weights and each linear's input rounded to bf16, fp32 accumulation,
row-invariant like fp32 -- vdpbf16ps on AVX512_BF16 builds, bf16 widened to fp32 FMAs elsewhere. AMX tiles are not
used: no AMX machine was at hand to test them on, and AMX CPUs have AVX512_BF16 too.

Build: at first use, with $CXX or the first of c++ / g++ / clang++ (`-O3 -pthread`, no torch headers, ~2 s), into
the specscope cache root, keyed by the ISA, the sources and the compiler, and loaded only from there once checked
as the user's own (without a usable root, from a private directory of this run: cachedir.py). An unusable build
(no compiler, an unsupported CPU) leaves `library()` None with one warning line, and models/linear.py falls back to
the stock oneDNN path.

Tuning (models/tuning.py): the panel width (per weight shape) and the register tile (per row count) only change
speed, never the result.

Threads: `torch.get_num_threads()` (in a decode step `step_threads`) in csrc/pool.h's pool: chunks are claimed by
whichever thread runs, a forward's layers (`rows_layers`) are one program any of its threads carries forward (a
preempted thread's chunk is recomputed), so beside busy processes the step moves while either thread runs."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import torch

from specscope import cachedir
from specscope.errors import SpecscopeError

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCE = CSRC / "rows_gemm.cpp"
SOURCES = (SOURCE, CSRC / "simd.h", CSRC / "pool.h")
ABI = 12
# -ffp-contract=off: the compiler may fuse a*b-c into an FMA in one copy of a loop (vectorised) and not in another
# (scalar), which broke verify == decode for the rotary embedding under -O3 on aarch64; every FMA we want is explicit
COMMON_FLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared"]
# per instruction set: the CPU flags (/proc/cpuinfo names) it needs and the compiler flags that enable it
ISAS = {
    # AVX-512 plus vdpbf16ps (Zen 4/5, Cooper Lake, Sapphire Rapids+): the fp32 kernels of avx512, bit for bit, and
    # bf16-input linears and bf16-cache attention two products per lane per instruction (its value interleaves need
    # AVX512BW, which every such CPU has)
    "avx512_bf16": ({"avx512f", "avx512dq", "avx512vl", "avx512bw", "fma", "avx512_bf16"},
                    ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mavx512bf16"]),
    "avx512": ({"avx512f", "avx512dq", "avx512vl", "fma"}, ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mfma"]),
    "avx2": ({"avx2", "fma"}, ["-mavx2", "-mfma"]),
    "neon": (set(), []),   # baseline on aarch64
}
X86_ORDER = ("avx512_bf16", "avx512", "avx2")
TUNE_ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 64)
_lock = threading.Lock()
_lib = None
_lib_state = "unloaded"                   # unloaded | loaded | unavailable
_isa: str | None = None
VARIANTS: dict[int, tuple[int, ...]] = {}  # panel width -> register tiles (rows) the loaded library implements
_warned = False


def kernels_dir() -> Path:
    return cachedir.cache_dir() / "kernels"


def _warn(msg: str):
    global _warned
    if not _warned:
        _warned = True
        print(f"warning: {msg}; using the stock oneDNN linears (slower verify)", file=sys.stderr)


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):   # x86 / aarch64 spelling
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _machine() -> str:
    m = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def best_isa() -> tuple[str | None, str]:
    """(the instruction set to build for, or None, and why not)."""
    arch = _machine()
    if arch == "aarch64":
        return "neon", ""
    if arch != "x86_64":
        return None, f"no row-invariant kernels for {arch} CPUs"
    flags = cpu_flags()
    for isa in X86_ORDER:
        if ISAS[isa][0] <= flags:
            return isa, ""
    return None, "this CPU has neither AVX-512 nor AVX2+FMA, so the row-invariant kernels are not used"


KERNEL_CHOICES = ("auto", "avx512_bf16", "avx512", "avx2", "neon", "off")


def _kernels_env() -> str:
    return os.environ.get("SPECSCOPE_KERNELS", "auto").strip().lower()


def _auto_isa() -> bool:
    """SPECSCOPE_KERNELS leaves the choice to us (unset, auto or on)."""
    return _kernels_env() in ("", "1", "auto", "on", "true")


def requested_isa() -> tuple[str | None, str]:
    """The ISA SPECSCOPE_KERNELS asks for (auto: the best this CPU has, or None and why not); (None, "") when
    switched off. A value that is not a choice, or an ISA this CPU cannot run, is the user's error."""
    want = _kernels_env()
    if want in ("0", "off", "none", "false"):
        return None, ""
    if _auto_isa():
        return best_isa()
    if want not in ISAS:
        raise SpecscopeError(f"SPECSCOPE_KERNELS={want!r} is not one of {', '.join(KERNEL_CHOICES)}; "
                             f"fix or unset it")
    arch = _machine()
    if (want == "neon") != (arch == "aarch64") or (want != "neon" and not ISAS[want][0] <= cpu_flags()):
        raise SpecscopeError(f"SPECSCOPE_KERNELS={want} but this {arch} CPU cannot run {want} code; use auto "
                             f"(the best this CPU has) or off")
    return want, ""


def _compiler() -> str | None:
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    return next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)


def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    except (OSError, subprocess.SubprocessError):
        return cxx


def build_flags(isa: str) -> list[str]:
    return [*COMMON_FLAGS, *ISAS[isa][1], f"-DSPECSCOPE_ISA_{isa.upper()}", "-pthread"]


def _compile(cxx: str, isa: str, out: Path):
    """Compile for `isa` into `out`."""
    r = subprocess.run([cxx, *build_flags(isa), "-o", str(out), str(SOURCE)], capture_output=True, text=True,
                       timeout=300)
    if r.returncode != 0:
        said = (r.stderr or r.stdout).strip().splitlines()
        raise RuntimeError(f"{cxx} exited with {r.returncode}: " + (said[-1][:160] if said else "no output"))


# A built library carries a seal: what it was built as (ABI, ISA, build key) and a checksum over it and the code, in
# a trailer the dynamic loader never reads (it maps segments by their offsets). So a cached file is checked before
# dlopen: a truncated copy would SIGBUS the process, a foreign one fail on a missing symbol, garbage never load, and
# one from another ISA or an older ABI would run the wrong code. One file, so the atomic rename covers both.
SEAL = b"specscope-rows-gemm-seal-v1\0"
META_BYTES = 160


def _meta(isa: str, key: str) -> bytes:
    return json.dumps({"abi": ABI, "isa": isa, "key": key}, sort_keys=True).encode().ljust(META_BYTES)


def _seal(path: Path, meta: bytes):
    data = path.read_bytes()
    path.write_bytes(data + SEAL + meta + hashlib.sha256(data + meta).digest())


def _seal_problem(path: Path, meta: bytes) -> str | None:
    """None when `path` is the library this code builds for `meta`, sealed, else what is wrong with it."""
    if path.is_dir():
        return "a directory is in its place"
    try:
        data = path.read_bytes()
    except OSError as e:
        return e.strerror or str(e)
    tail = len(SEAL) + META_BYTES + 32
    if len(data) <= tail or data[-tail:-tail + len(SEAL)] != SEAL:
        return "truncated, or not a library specscope built"
    body, got = data[:-tail], data[-tail + len(SEAL):-32]
    if hashlib.sha256(body + got).digest() != data[-32:]:
        return "its checksum does not match: truncated or altered"
    if got != meta:
        return f"built as {got.decode(errors='replace').strip()}, not {meta.decode().strip()}"
    return None


def _build(cxx: str, isa: str, rel: str, meta: bytes) -> Path | None:
    """Build and seal into the cache root (atomically); where the root cannot take it or must not be used, into
    this process's private directory (cachedir.private_dir), for this run only. Never anywhere another user could
    write: the library is loaded into this process."""
    def write(tmp: Path):
        _compile(cxx, isa, tmp)
        _seal(tmp, meta)

    return cachedir.store(rel, write, "kernel library", ".so", private=True)


def _source_hash() -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES)).hexdigest()


def isa() -> str | None:
    """The instruction set of the loaded kernels (None: the stock path)."""
    library()
    return _isa


_step_threads: int | None = None     # the kernels' threads while a decode step holds them (step_threads)


def threads() -> int:
    """The kernels' thread count: torch's, or what it was when a decode step began (step_threads)."""
    return _step_threads or torch.get_num_threads()


@contextmanager
def step_threads():
    """One decode step on the row kernels: they keep torch's thread count, torch's own ops in the step (embedding,
    sampling, a drafter's small tensors) run on the calling thread. Else torch's libgomp threads spin between their
    short regions beside the kernels' pool unless OMP_WAIT_POLICY=PASSIVE was set before torch loaded: speculative
    decoding ran at 0.77x of the OpenMP kernels that way (bench/one_loop.py, torch imported first), 0.95x with this."""
    global _step_threads
    n = torch.get_num_threads()
    if n <= 1 or _step_threads is not None or library() is None:
        yield
        return
    _step_threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _step_threads = None


def library():
    """The loaded ctypes library, or None when this machine cannot build/run it (warned once)."""
    global _lib, _lib_state, _isa, VARIANTS
    if _lib_state != "unloaded":
        return _lib
    with _lock:
        if _lib_state != "unloaded":
            return _lib
        want, why = requested_isa()     # a bad SPECSCOPE_KERNELS raises here, and is asked again next call
        _lib_state = "unavailable"
        if want is None:
            if why:
                _warn(why)
            return None   # explicitly off: no warning
        # a compiler too old for -mavx512bf16 (GCC < 10) still builds plain AVX-512, unless the user forced the ISA
        lib = _load(want, fallback="avx512" if want == "avx512_bf16" and _auto_isa() else None)
        if lib is None:
            return None
        _declare(lib)
        nbs, rbs = (ctypes.c_int64 * 32)(), (ctypes.c_int64 * 32)()
        variants: dict[int, tuple[int, ...]] = {}
        for i in range(min(32, lib.rows_gemm_variants(nbs, rbs, 32))):
            variants[nbs[i]] = variants.get(nbs[i], ()) + (rbs[i],)
        VARIANTS = variants
        _lib, _lib_state, _isa = lib, "loaded", lib.rows_gemm_isa().decode()
        return lib


def _cached_library(rel: str, meta: bytes) -> Path | None:
    """The sealed library at `rel` in the checked cache root (cachedir.artifact: ours, writable by no one else);
    a damaged one is removed with one warning."""
    path = cachedir.artifact(rel, "kernel library")
    if path is None or not os.path.lexists(path):
        return None
    why = _seal_problem(path, meta)
    if why is None:
        return path
    cachedir.warn(f"the cached kernel library {path} is unusable ({why}); rebuilding it", key="kernels")
    cachedir.remove(path)
    return None


def _load(want: str, fallback: str | None = None):
    """The library built for `want` (built now unless cached), or None with the reason warned; where it does not
    build and `fallback` is given, that ISA's (one warning line saying so)."""
    cxx = _compiler()
    if cxx is None:
        _warn("no C++ compiler (c++, g++, clang++, or $CXX) found to build the row-invariant kernels"
              + (f" ($CXX={os.environ['CXX']} is not a program)" if os.environ.get("CXX") else ""))
        return None
    def built(isa: str) -> Path | None:
        key = hashlib.sha256((_source_hash() + " ".join(build_flags(isa)) + _compiler_id(cxx)).encode()).hexdigest()
        rel, meta = f"kernels/rows_gemm-{isa}-{key[:16]}.so", _meta(isa, key[:16])
        return _cached_library(rel, meta) or _build(cxx, isa, rel, meta)

    failed = (OSError, RuntimeError, subprocess.SubprocessError)
    try:
        path = built(want)
    except failed as e:
        fix = "; fix or unset $CXX" if os.environ.get("CXX") else ""
        path = None
        if fallback:
            try:
                path = built(fallback)
            except failed:
                pass
        if path is None:   # one warning line, about what was asked for
            _warn(f"could not build the row-invariant kernels for {want} ({e}{fix})")
            return None
        print(f"warning: could not build the row-invariant kernels for {want} ({e}{fix}); using {fallback} "
              f"(bf16 linears widen to fp32 FMAs)", file=sys.stderr)
    if path is None:
        _warn("the row-invariant kernels could not be stored anywhere")
        return None
    try:
        lib = ctypes.CDLL(str(path))
        if lib.rows_gemm_abi() != ABI:
            raise RuntimeError(f"library ABI {lib.rows_gemm_abi()} != {ABI}")
    except (OSError, RuntimeError, AttributeError) as e:
        # sealed as this build yet unusable: only a forged seal gets here; drop it so the next run builds afresh
        cachedir.remove(path)
        _warn(f"the kernel library {path} would not load ({e}); it is removed and rebuilt on the next run")
        return None
    return lib


_I64, _P, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
# each entry point's (return type, argument types), as rows_gemm.cpp declares them
SIGNATURES = {
    "rows_gemm_isa": (ctypes.c_char_p, None),
    "rows_pool_redone": (ctypes.c_uint64, []),
    "rows_gemm_variants": (_INT, [_P, _P, _INT]),
    "rows_gemm_f32": (_INT, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _INT, _INT]),
    "rows_gemm_pack": (None, [_P, _I64, _I64, _I64, _P]),
    "rows_gemm_pack_bf16": (None, [_P, _I64, _I64, _I64, _P]),
    "rows_gemm_bf16": (_INT, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _INT, _INT]),
    "rows_gemm_bf16a_pairs": (_INT, []),
    "rows_gemm_pack_bf16a": (None, [_P, _I64, _I64, _I64, _P]),
    "rows_gemm_bf16a": (_INT, [_P, _I64, _P, _I64, _I64, _I64, _P, _P, _INT, _INT]),
    "rows_rmsnorm": (None, [_P, _P, _I64, _I64, _P, _F32, _P, _P]),
    "rows_silu_mul": (None, [_P, _I64, _I64, _P]),
    "rows_attention": (_INT, [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _P, _I64, _P, _INT]),
    "rows_rope_attention": (_INT, [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _P,
                                   _I64, _P, _INT]),
    "rows_layers": (_INT, [_I64, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64, _F32, _P, _P, _P, _P, _P, _I64, _I64,
                           _I64, _I64, _I64, _P, _I64, _P, _INT]),
}


def _declare(lib) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        if argtypes is not None:
            fn.argtypes = argtypes


def available() -> bool:
    return library() is not None


def supports(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[1] > 0 and available())


def is_bf16_exact(weight: torch.Tensor) -> bool:
    """Every fp32 value is a bf16 value (a bf16 checkpoint upcast): such weights can be streamed as bf16 at half the
    bytes and widened exactly in registers, with the bits of the fp32 path."""
    w = weight.detach().contiguous()
    return w.dtype == torch.float32 and not bool((w.view(torch.int32) & 0xFFFF).any())


# Packed weight formats: "f32" (fp32 panels, fp32 inputs), "bf16" (bf16 panels of weights that are exactly bf16,
# fp32 inputs: the bits of "f32", half the bytes) and "bf16a" (bf16 serving precision: weights rounded to bf16 and
# each input row rounded to bf16 at the linear, fp32 accumulation; k-pair panels where the CPU has vdpbf16ps)
FORMATS = ("f32", "bf16", "bf16a")


def pairs() -> bool:
    """The loaded library's bf16a linears use vdpbf16ps (k-pair panels); else they widen bf16 panels."""
    return bool(library().rows_gemm_bf16a_pairs())


def bf16_method() -> str:
    """How bf16 serving-precision linears multiply on this build, in words (for the demo and the benches)."""
    if library() is None:
        return "stock oneDNN"
    return "AVX512_BF16 dot products" if pairs() else f"bf16 widened to fp32 FMAs ({_isa})"


def pack(weight: torch.Tensor, nb: int, bf16: bool = False, fmt: str | None = None) -> torch.Tensor:
    """[out, in] fp32 -> panels [ceil(out/nb), in, nb] (zero-padded), flat: fp32 ("f32"), or their bf16 bits as int16
    ("bf16", also bf16=True: for weights that are exactly bf16; "bf16a": rounded to bf16, in k-pair panels
    [ceil(out/nb), ceil(in/2), nb, 2] where `pairs()`)."""
    fmt = fmt or ("bf16" if bf16 else "f32")
    out, k = weight.shape
    w = weight.detach().float().contiguous()
    kk = 2 * ((k + 1) // 2) if fmt == "bf16a" and pairs() else k
    n = ((out + nb - 1) // nb) * nb * kk
    p = torch.empty(n, dtype=torch.float32 if fmt == "f32" else torch.int16)
    fn = {"f32": library().rows_gemm_pack, "bf16": library().rows_gemm_pack_bf16,
          "bf16a": library().rows_gemm_pack_bf16a}[fmt]
    fn(w.data_ptr(), out, k, nb, p.data_ptr())
    return p


def unpack(p: torch.Tensor, nb: int, out: int, k: int, fmt: str | None = None) -> torch.Tensor:
    if p.dtype == torch.int16:   # bf16 bits -> the fp32 values they are
        p = (p.to(torch.int32) << 16).view(torch.float32)
    if fmt == "bf16a" and pairs():
        kp = (k + 1) // 2
        return p.view(-1, kp, nb, 2).permute(0, 2, 1, 3).reshape(-1, 2 * kp)[:out, :k]
    return p.view(-1, k, nb).transpose(1, 2).reshape(-1, k)[:out]


def gemm(x2d: torch.Tensor, p: torch.Tensor, nb: int, out: int, bias: torch.Tensor | None, rb: int,
         y: torch.Tensor | None = None, fmt: str | None = None) -> torch.Tensor:
    """y[n, out] = x2d[n, in] @ W^T + bias; x2d contiguous fp32; fmt: how `p` was packed (default: "bf16" for
    int16 panels, else "f32"); "bf16a" rounds each input to bf16 first."""
    n, k = x2d.shape
    if y is None:
        y = torch.empty(n, out, dtype=torch.float32)
    lib = _lib or library()
    if fmt == "bf16a":
        fn = lib.rows_gemm_bf16a
    else:
        fn = lib.rows_gemm_bf16 if p.dtype == torch.int16 else lib.rows_gemm_f32
    rc = fn(x2d.data_ptr(), n, p.data_ptr(), nb, out, k,
                            bias.data_ptr() if bias is not None else None, y.data_ptr(),
                            threads(), rb)
    if rc != 0:
        raise RuntimeError(f"rows_gemm: no kernel for panel {nb} / tile {rb}")
    return y


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None):
    """x / rms(x) * weight over the last dim (fp32, contiguous). With delta: (h, norm(h)) for h = x + delta, the
    residual add and the next layer norm in one pass."""
    d = x.shape[-1]
    n = x.numel() // d
    y = torch.empty_like(x)
    h = torch.empty_like(x) if delta is not None else None
    (_lib or library()).rows_rmsnorm(x.data_ptr(), None if delta is None else delta.data_ptr(), n, d,
                                     weight.data_ptr(), eps, None if h is None else h.data_ptr(), y.data_ptr())
    return y if delta is None else (h, y)


def silu_mul(gu: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(gate) * up from the fused [..., 2 * inter] gate/up output (fp32, contiguous) -> [..., inter]."""
    out = torch.empty(*gu.shape[:-1], inter, dtype=torch.float32)
    (_lib or library()).rows_silu_mul(gu.data_ptr(), gu.numel() // (2 * inter), inter, out.data_ptr())
    return out


def kv_format(cache: torch.Tensor) -> int:
    """The kernels' code for a KV cache's element type: 0 fp32, 1 bf16 (the bf16 precision's cache)."""
    if cache.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the row kernels take an fp32 or bf16 KV cache, not {cache.dtype}")
    return int(cache.dtype == torch.bfloat16)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: int, mask: torch.Tensor | None) -> torch.Tensor:
    """q: [T, Hq, D] (rows may be strided; each row's heads contiguous); k, v: [Hkv, max_len, D] cache of one
    sequence (slots and head_dim contiguous; fp32 or bf16); slots 0..S-1 visible where mask [T, S] (bool) allows
    (None: all). Returns [T, Hq*D]."""
    T, Hq, D = q.shape
    Hkv = k.shape[0]
    if q.stride(2) != 1 or q.stride(1) != D:
        q = q.contiguous()
    for t in (k, v):
        if t.stride(2) != 1 or t.stride(1) != D or t.stride(0) != k.stride(0):
            raise ValueError(f"attention: k and v must be [heads, slots, {D}] with contiguous slots; got strides "
                             f"{tuple(t.stride())}")
    if v.dtype != k.dtype:
        raise ValueError(f"attention: k and v must share a dtype; got {k.dtype} and {v.dtype}")
    out = torch.empty(T, Hq * D, dtype=torch.float32)
    if mask is not None:
        mask = mask.contiguous()
    rc = (_lib or library()).rows_attention(q.data_ptr(), q.stride(0), T, Hq, Hkv, D, k.data_ptr(), v.data_ptr(),
                                            kv_format(k), k.stride(0), S, None if mask is None else mask.data_ptr(),
                                            0 if mask is None else mask.stride(0), out.data_ptr(),
                                            threads())
    if rc != 0:
        raise RuntimeError(f"rows_attention: unsupported shape (heads {Hq}/{Hkv}, head_dim {D})")
    return out


def rope_attention(qkv: torch.Tensor, n_heads: int, n_kv: int, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, S: int,
                   mask: torch.Tensor | None) -> torch.Tensor:
    """One layer's rotary embedding, cache write and attention from the fused qkv output [T, (Hq+2Hkv)*D] of one
    sequence: cos, sin [T, D] fp32; slots [T] int64; k_cache, v_cache [Hkv, max_len, D] (fp32, or bf16: the
    new keys and values rounded as they are written). Returns [T, Hq*D]."""
    T = qkv.shape[0]
    D, max_len = k_cache.shape[-1], k_cache.shape[1]
    out = torch.empty(T, n_heads * D, dtype=torch.float32)
    if mask is not None:
        mask = mask.contiguous()
    slots, cos, sin = slots.contiguous(), cos.contiguous(), sin.contiguous()
    rc = (_lib or library()).rows_rope_attention(qkv.data_ptr(), T, n_heads, n_kv, D, cos.data_ptr(), sin.data_ptr(),
                                  slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kv_format(k_cache),
                                  k_cache.stride(0), max_len, S, None if mask is None else mask.data_ptr(),
                                  0 if mask is None else mask.stride(0), out.data_ptr(), threads())
    if rc == -3:   # the message index_copy_ gives, so callers see one error whichever path ran
        bad = int(slots[(slots < 0) | (slots >= max_len)][0])
        raise IndexError(f"index_copy_(): index {bad} is out of bounds for dimension 1 with size {max_len}")
    if rc != 0:
        raise RuntimeError(f"rows_rope_attention: unsupported shape (heads {n_heads}/{n_kv}, head_dim {D})")
    return out


# ---- a stack of decoder layers in one call ----------------------------------------------------------------------
class _Linear(ctypes.Structure):
    _fields_ = [("p", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("nb", ctypes.c_int64), ("rb", ctypes.c_int64),
                ("out", ctypes.c_int64), ("in_", ctypes.c_int64), ("fmt", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear)]


class LayerStack:
    """A packed Llama-family model's decoder layers run by one `rows_layers` call per forward (one sequence, fp32):
    the same kernels in the same order as the per-layer path, so the same bits, without ~8 Python-level kernel
    calls per layer. Built by models/kernels.py `layer_stack` when every layer qualifies (our kernel on all four
    linears, no q/k norm); the packed weights never move, so their addresses are taken once (per register-tile
    choice, i.e. row count)."""

    def __init__(self, model):
        cfg = model.config
        self.n, self.H, self.eps = cfg.num_hidden_layers, cfg.hidden_size, float(cfg.rms_norm_eps)
        self.Hq, self.Hkv, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.inter = cfg.intermediate_size
        self.layers = list(model.layers)   # keeps the packed weights alive
        self._arrays: dict[int, ctypes.Array] = {}

    def _array(self, T: int):
        key = min(T, TUNE_ROWS[-1])
        arr = self._arrays.get(key)
        if arr is None:
            def lin(pl):
                b = pl.rg_bias
                return _Linear(pl.rg.data_ptr(), 0 if b is None else b.data_ptr(), pl.nb, pl.rbs[key],
                               pl.out_features, pl.in_features, FORMATS.index(pl.fmt))

            arr = (_Layer * self.n)(*[_Layer(ly.input_layernorm.weight.data_ptr(),
                                             ly.post_attention_layernorm.weight.data_ptr(),
                                             lin(ly.self_attn.qkv_proj), lin(ly.self_attn.o_proj),
                                             lin(ly.mlp.gate_up_proj), lin(ly.mlp.down_proj))
                                      for ly in self.layers])
            self._arrays[key] = arr
        return arr

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, cache,
                 kv_len: int, mask: torch.Tensor | None, aux_layers=()) -> tuple[torch.Tensor, dict]:
        """h [T, H] (updated copy returned), cos/sin [T, D], slots [T], mask [T, S] or None; cache: a KVCache
        (sequence 0). Returns (h after the last layer, {layer: h entering it} for aux_layers)."""
        T = h.shape[0]
        h = h.contiguous().clone()
        aux = {i: torch.empty(T, self.H) for i in aux_layers if 0 <= i <= self.n}
        aux_ptrs = (ctypes.c_void_p * (self.n + 1))(*[aux[i].data_ptr() if i in aux else None
                                                        for i in range(self.n + 1)]) if aux else None
        slots, cos, sin = slots.contiguous(), cos.contiguous(), sin.contiguous()
        if mask is not None:
            mask = mask.contiguous()
        k, v = cache.k, cache.v
        rc = (_lib or library()).rows_layers(
            self.n, self._array(T), h.data_ptr(), T, self.H, self.Hq, self.Hkv, self.D, self.inter, self.eps,
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), k.data_ptr(), v.data_ptr(), kv_format(k), k.stride(0),
            k.stride(2), k.shape[3], kv_len, None if mask is None else mask.data_ptr(),
            0 if mask is None else mask.stride(0), aux_ptrs, threads())
        if rc == -3:   # the message index_copy_ gives, so callers see one error whichever path ran
            bad = int(slots[(slots < 0) | (slots >= k.shape[3])][0])
            raise IndexError(f"index_copy_(): index {bad} is out of bounds for dimension 1 with size {k.shape[3]}")
        if rc != 0:
            raise RuntimeError(f"rows_layers: unsupported shape (heads {self.Hq}/{self.Hkv}, head_dim {self.D})")
        return h, aux
