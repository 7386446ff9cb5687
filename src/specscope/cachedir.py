"""specscope's cache directory ($SPECSCOPE_CACHE, else $XDG_CACHE_HOME/specscope) and the rules for what it keeps
between runs: compiled kernels, tuning plans, prices, converted models.

A cache is specscope's to repair, never the user's to find and delete. So every artifact is validated before use
(a JSON by its schema, a library by its recorded checksum); a bad one is rebuilt or re-measured once, with one
warning line, and replaced atomically (a temp file beside it, renamed over it; no temp file is ever left). A cache
that cannot be written (a read-only directory, something in the way that cannot be removed) is worked around with
one warning: the artifact goes to a per-user fallback directory under the system temp dir, where later runs find
it, so nothing is re-done every run.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

# everything a damaged artifact can raise while being read or checked; the checks raise ValueError with the reason
DAMAGE = (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError)
_warned: set[str] = set()


def cache_dir() -> Path:
    root = os.environ.get("SPECSCOPE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "specscope"


def fallback_dir() -> Path:
    """Where artifacts go when the cache dir cannot take them (per user: the temp dir is shared)."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return Path(tempfile.gettempdir()) / f"specscope-cache-{uid}"


def locations(rel: str | Path) -> list[Path]:
    """An artifact's home in the cache dir, then its fallback."""
    return [cache_dir() / rel, fallback_dir() / rel]


def warn(msg: str, key: str | None = None) -> None:
    """One warning line on stderr, once per process for each key (default: the message)."""
    key = key or msg
    if key not in _warned:
        _warned.add(key)
        print(f"warning: {msg}", file=sys.stderr)


def reason(e: BaseException) -> str:
    if isinstance(e, IsADirectoryError):
        return "a directory is in its place"
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, (KeyError, IndexError)):
        return f"missing entry {e}"
    text = str(e).strip().splitlines()
    return (text[0][:160] if text else type(e).__name__)


def remove(path: Path) -> bool:
    """Remove whatever sits at `path` (a damaged artifact of ours: file, link or directory); True when gone."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        return False
    return not os.path.lexists(path)


def _regular(path: Path) -> bool:
    """True for a regular file; False when nothing is there; raises (a damage) for anything else."""
    if not os.path.lexists(path):
        return False
    if path.is_dir():
        raise IsADirectoryError(21, "a directory is in its place")
    if not path.is_file():
        raise ValueError("not a regular file")
    return True


def load_json(rel: str | Path, check: Callable[[Any], Any], what: str, redo: str):
    """The cached artifact `rel` (under the cache dir, else its fallback) as `check(json)` returns it, or None when
    there is none. A damaged one (unreadable, not JSON, or refused by `check` with ValueError naming why) is removed
    and warned about once -- "the cached {what} {path} is unusable ({why}); {redo}" -- and None is returned."""
    for path in locations(rel):
        try:
            if not _regular(path):
                continue
            return check(json.loads(path.read_text(encoding="utf-8")))
        except DAMAGE as e:
            warn(f"the cached {what} {path} is unusable ({reason(e)}); {redo}", key=f"{what}:{rel}")
            remove(path)
    return None


@contextmanager
def _temp_beside(path: Path, suffix: str):
    """A temp file in `path`'s directory (made if missing), removed unless renamed away."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
    finally:
        try:
            os.unlink(tmp)
        except OSError:      # renamed away (the usual case), or already gone
            pass


def store(rel: str | Path, write: Callable[[Path], None], what: str, suffix: str = ".tmp") -> Path | None:
    """Write an artifact: `write(tmp)` fills a temp file, which is renamed over the artifact's path in the cache
    dir (a directory or other thing in the way is removed first); where the cache dir cannot take it, in the
    fallback dir with one warning. Returns where it went, or None (warned) when neither could take it."""
    errors = []
    for i, path in enumerate(locations(rel)):
        try:
            # a rename replaces a file or a link, never a directory: a directory in the way is ours to remove
            if path.is_dir() and not path.is_symlink() and not remove(path):
                raise IsADirectoryError(21, "a directory is in the way and cannot be removed")
            with _temp_beside(path, suffix) as tmp:
                write(tmp)
                os.replace(tmp, path)
            if i:
                warn(f"cannot write the cache dir ({errors[0]}); keeping the {what} in {path.parent} instead "
                     f"(make {cache_dir()} writable, or set SPECSCOPE_CACHE)", key=f"store:{what}")
            return path
        except OSError as e:
            errors.append(f"{path.parent}: {reason(e)}")
    warn(f"cannot store the {what} ({'; '.join(errors)}); it will be made again next run", key=f"store:{what}")
    return None


def store_json(rel: str | Path, data, what: str) -> Path | None:
    def write(tmp: Path):
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")

    return store(rel, write, what, ".json")
