"""One cache root, the user's own (src/specscope/cachedir.py): nothing is read from a place the user did not name
or does not own. A kernel library planted in the old shared fallback ($TMPDIR/specscope-cache-<uid>), in a root
another user owns or can write, or as a file another user owns, is never loaded -- seen in the child process's
own /proc/self/maps; prices are never read from the temp dir; the root is made 0700.

"Another user" is uid 12345 (os.chown): those cases skip where chown is not permitted (not root)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from specscope import cachedir
from specscope.models import rowgemm
from test_cache_healing import child, needs_kernels, warnings_of

OTHER = 12345
# loads the kernels (or says why not), then lists the libraries of ours mapped into this very process
MAPPED = ("from specscope.models import rowgemm; print(rowgemm.isa() if rowgemm.library() else 'stock'); "
          "print(*sorted({l.split(None, 5)[-1] for l in open('/proc/self/maps') if 'rows_gemm' in l}), sep='\\n')")


def foreign(path: Path, mode: int | None = None) -> None:
    """Make `path` another user's (and `mode`), or skip: only root may give a file away."""
    try:
        os.chown(path, OTHER, OTHER)
    except PermissionError:
        pytest.skip("os.chown is not permitted here (not root): cannot make a file another user's")
    if mode is not None:
        os.chmod(path, mode)


def old_fallback(tmp: Path) -> Path:
    """The shared place earlier versions read from and built into."""
    return tmp / f"specscope-cache-{os.getuid()}"


@pytest.fixture(scope="module")
def genuine(tmp_path_factory) -> Path:
    """A library as this code builds it (sealed, loadable): what a neighbour would copy and plant."""
    root = tmp_path_factory.mktemp("genuine")
    r = child("from specscope.models import rowgemm; rowgemm.library()", root / "cache", root)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    (lib,) = (root / "cache" / "kernels").glob("rows_gemm-*.so")
    return lib


def plant(genuine: Path, where: Path) -> Path:
    """A copy of the genuine library at `where`/kernels, the kernels directory and the file another user's, the
    directory world-writable (as a shared temp dir is)."""
    (where / "kernels").mkdir(parents=True, exist_ok=True)
    lib = where / "kernels" / genuine.name
    shutil.copyfile(genuine, lib)
    foreign(lib, 0o755)
    foreign(where / "kernels", 0o777)
    return lib


@needs_kernels
@pytest.mark.parametrize("place", ["old temp fallback", "foreign cache root", "foreign library in own root"])
def test_a_planted_library_is_never_loaded(genuine, tmp_path, place):
    temp, cache = tmp_path / "temp", tmp_path / "cache"
    temp.mkdir()
    if place == "old temp fallback":            # the named cache is empty: the old code went on to the temp dir
        planted = plant(genuine, old_fallback(temp))
        foreign(old_fallback(temp), 0o777)
    elif place == "foreign cache root":
        planted = plant(genuine, cache)
        foreign(cache, 0o777)
    else:                                        # our root, a library file in it another user's
        cache.mkdir(mode=0o700)
        planted = plant(genuine, cache)
        os.chown(cache / "kernels", os.getuid(), os.getgid())
        os.chmod(cache / "kernels", 0o700)
    r = child(MAPPED, cache, temp)
    assert r.returncode == 0, r.stderr
    isa, *mapped = r.stdout.split()
    assert isa == rowgemm.isa(), r.stderr                  # the kernels ran: built afresh, from our own place
    assert str(planted) not in mapped and len(mapped) == 1, mapped
    assert planted.read_bytes() == genuine.read_bytes()    # left as it was: not ours to touch
    if place == "old temp fallback":
        assert r.stderr == "" and mapped == [str(cache / "kernels" / genuine.name)]
        return
    (w,) = warnings_of(r)
    assert f"uid {OTHER}, not by you" in w, w
    # no cache to keep it in: built into this run's private directory (new, 0700), gone when the run ended
    assert Path(mapped[0]).parent.parent.name.startswith("specscope-run-") and not Path(mapped[0]).exists()
    assert not list(temp.glob("specscope-run-*"))


def test_deleted_prices_are_measured_into_the_named_cache_not_read_from_the_temp_dir(tmp_path, monkeypatch):
    """Issue 52: with the prices file in SPECSCOPE_CACHE deleted, another process's file in the temp dir was read."""
    from spec_helpers import tiny_target
    from specscope.economics import prices

    temp, cache = tmp_path / "temp", tmp_path / "cache"
    temp.mkdir()
    monkeypatch.setenv("SPECSCOPE_CACHE", str(cache))
    monkeypatch.setenv("TMPDIR", str(temp))
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(cachedir, "_warned", set())
    target = tiny_target(tmp_path / "model", layers=1, max_position_embeddings=40)
    key = prices._key(target)
    theirs = old_fallback(temp) / prices._rel(key)        # another process's prices, for this very model and host
    theirs.parent.mkdir(parents=True)
    theirs.write_text(json.dumps({"verify_ratio": {"1": 1.0, "2": 9.0}, "decode_ms": 12345.0, "key": key}))
    p = prices.host_prices(target)
    assert p.decode_ms != 12345.0 and p.verify_ratio != {1: 1.0, 2: 9.0}   # measured, not read from the temp dir
    mine = prices.prices_path(target)
    if p.loaded:                                # measured while the machine was busy: for this run only (prices.py)
        assert not mine.exists()
    else:
        assert json.loads(mine.read_text())["decode_ms"] == p.decode_ms   # stored in the cache it was given
    assert json.loads(theirs.read_text())["decode_ms"] == 12345.0 and len(list(temp.rglob("*.json"))) == 1


@pytest.mark.parametrize("named", [True, False])
def test_the_cache_root_is_created_0700(tmp_path, monkeypatch, named):
    root = tmp_path / "named" / "cache" if named else tmp_path / "xdg" / "specscope"
    if named:
        monkeypatch.setenv("SPECSCOPE_CACHE", str(root))
    else:
        monkeypatch.delenv("SPECSCOPE_CACHE", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    old = os.umask(0o022)                       # the usual umask, under which a plain mkdir gives 0755
    try:
        path = cachedir.store_json("prices/a.json", {"n": 1}, "thing")
    finally:
        os.umask(old)
    assert path == root / "prices" / "a.json"
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("case", ["world-writable root", "group-writable directory", "world-writable file",
                                  "foreign root", "foreign file"])
def test_a_cache_others_can_write_is_not_read_one_warning(tmp_path, monkeypatch, capsys, case):
    """Any artifact (a price file, a tuning plan: every JSON goes through load_json) under a root, directory or
    file that is another user's or that others can write is not read: one warning, measured and not stored there."""
    root = tmp_path / "cache"
    (root / "prices").mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    art = root / "prices" / "a.json"
    art.write_text('{"n": 1}')
    os.chmod(art, 0o600)
    {"world-writable root": lambda: os.chmod(root, 0o777),
     "group-writable directory": lambda: os.chmod(root / "prices", 0o770),
     "world-writable file": lambda: os.chmod(art, 0o666),
     "foreign root": lambda: foreign(root, 0o755),
     "foreign file": lambda: foreign(art, 0o644)}[case]()
    monkeypatch.setenv("SPECSCOPE_CACHE", str(root))
    monkeypatch.setattr(cachedir, "_warned", set())
    assert cachedir.load_json("prices/a.json", lambda d: d, "verify prices", "measuring them again") is None
    assert cachedir.store_json("prices/a.json", {"n": 2}, "verify prices") is None
    assert cachedir.load_json("prices/a.json", lambda d: d, "verify prices", "measuring them again") is None
    (w,) = capsys.readouterr().err.splitlines()
    assert w.startswith("warning: not using the cache") and ("others can write" in w or "not by you" in w), w
    assert "root" not in case or "SPECSCOPE_CACHE" in w
    assert json.loads(art.read_text()) == {"n": 1}          # left as it was


def test_a_spec_policy_table_in_a_root_others_can_write_is_refused(tmp_path, monkeypatch, capsys):
    """`serve --spec-policy auto` reads its table from the cache root: not from one others can write."""
    from specscope.economics.policy import policy_path, save_table, spec_policy
    from specscope.errors import SpecscopeError
    from specscope.speculative.decode import SpecConfig
    from test_economics_batch import _table

    root = tmp_path / "cache"
    monkeypatch.setenv("SPECSCOPE_CACHE", str(root))
    monkeypatch.setattr(cachedir, "_warned", set())
    save_table(_table(), policy_path("m", "d"))
    os.chmod(root, 0o777)
    with pytest.raises(SpecscopeError, match="not reading a table from the cache dir .*pass the table's path"):
        spec_policy("auto", SpecConfig(3, 1, 4), model="m", draft="d")
    (w,) = capsys.readouterr().err.splitlines()
    assert w.startswith(f"warning: not using the cache dir {root}: others can write to it (mode 777)"), w
