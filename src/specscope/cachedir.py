"""specscope's cache root and the rules for what it keeps between runs: compiled kernels, tuning plans, prices,
converted models.

One root, and nothing read from anywhere else: $SPECSCOPE_CACHE when set, else $XDG_CACHE_HOME/specscope (default
~/.cache/specscope). A shared place such as the system temp dir is where another user could plant a kernel library
this process would load, or a price file it would trust. The root is created 0700; it, and every artifact and
directory in it, is checked before use: owned by this user and writable by no one else (`root`, `artifact`).

- A root that fails the check (another user's, group- or world-writable, not a directory, or not creatable) is not
  used at all, with one warning: the run works without a cache. Prices and plans are measured and not stored;
  what must be a file (a kernel library, a converted model) is made in `private_dir`, a fresh directory of this
  process's own (mkdtemp: new, 0700) removed at exit.
- An artifact in a good root that fails the check (or sits under a directory that does) is not used, with one
  warning, and made privately for this run.
- A cache is specscope's to repair, never the user's to find and delete. So every artifact is validated before use
  (a JSON by its schema, a library by its recorded checksum); a bad one is rebuilt or re-measured once, with one
  warning line, and replaced atomically (a temp file beside it, renamed over it; no temp file is ever left).
- A root that cannot be written (read-only, something in the way that cannot be removed) is one warning: the
  artifact is made for this run only, privately.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import stat
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

# everything a damaged artifact can raise while being read or checked; the checks raise ValueError with the reason
DAMAGE = (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError)
_warned: set[str] = set()
_roots: dict[str, str | None] = {}          # cache root -> why it is not used (None: checked, usable); per process
_private: tuple[int, Path] | None = None    # (the pid that made it, this process's private directory)


def cache_dir() -> Path:
    """The cache root as configured (the path only; `root()` is the checked one)."""
    root = os.environ.get("SPECSCOPE_CACHE")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "specscope"


def not_ours(st: os.stat_result) -> str | None:
    """None when a file or directory with this stat is this user's and writable by no one else, else why not."""
    if not hasattr(os, "getuid"):       # no owners to check (Windows): the user's profile is private already
        return None
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by you (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others can write to it (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _check_root(path: Path) -> str | None:
    """Make the root (0700) if missing; None when it is usable, else why not."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.stat(path)
    except OSError as e:
        return f"it cannot be made ({reason(e)})"
    return "it is not a directory" if not stat.S_ISDIR(st.st_mode) else not_ours(st)


def root() -> Path | None:
    """The cache root, created 0700 and checked (once per process); None when it must not be used, warned once:
    the run goes on without a cache."""
    path = cache_dir()
    key = str(path)
    if key not in _roots:
        _roots[key] = why = _check_root(path)
        if why:
            fix = ("point SPECSCOPE_CACHE at a directory of your own" if os.environ.get("SPECSCOPE_CACHE")
                   else "fix it, or set SPECSCOPE_CACHE to a directory of your own")
            warn(f"not using the cache dir {path}: {why}; running without a cache (kernels built and prices "
                 f"measured for this run only; {fix})", key=f"root:{key}")
    return None if _roots[key] else path


def artifact(rel: str | Path, what: str) -> Path | None:
    """Where the artifact `rel` lives in the checked root, or None when it must not be used there: no usable root,
    or it (or a directory on its way) is another user's or writable by others (warned once: it is made privately)."""
    base = root()
    if base is None:
        return None
    part = base
    for name in Path(rel).parts:
        part = part / name
        try:
            st = os.stat(part)
        except OSError:                 # absent (or a file where a directory belongs): nothing there to trust
            break
        why = not_ours(st)
        if why:
            warn(f"not using the cached {what} {part}: {why}; making it for this run only (remove it, or set "
                 f"SPECSCOPE_CACHE to a directory of your own)", key=f"foreign:{what}")
            return None
    return base / rel


def private_dir(create: bool = True) -> Path | None:
    """This process's own directory for what it cannot cache (tempfile.mkdtemp: new, 0700, ours), removed when it
    exits; None when `create` is False and none was made yet."""
    global _private
    if _private is None or _private[0] != os.getpid():     # a forked child makes its own
        if not create:
            return None
        pid, path = os.getpid(), Path(tempfile.mkdtemp(prefix="specscope-run-"))
        # only the process that made it removes it: a forked child exiting must not take its parent's files
        atexit.register(lambda: os.getpid() == pid and shutil.rmtree(path, ignore_errors=True))
        _private = (pid, path)
    return _private[1]


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
    """The cached artifact `rel` in the checked root as `check(json)` returns it, or None when there is none (or it
    must not be used: see `artifact`). A damaged one (unreadable, not JSON, or refused by `check` with ValueError
    naming why) is removed and warned about once -- "the cached {what} {path} is unusable ({why}); {redo}" -- and
    None is returned."""
    path = artifact(rel, what)
    if path is None:
        return None
    try:
        if _regular(path):
            return check(json.loads(path.read_text(encoding="utf-8")))
    except DAMAGE as e:
        warn(f"the cached {what} {path} is unusable ({reason(e)}); {redo}", key=f"{what}:{rel}")
        remove(path)
    return None


@contextmanager
def _temp_beside(path: Path, suffix: str):
    """A temp file in `path`'s directory (made 0700 if missing), removed unless renamed away."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
    finally:
        try:
            os.unlink(tmp)
        except OSError:      # renamed away (the usual case), or already gone
            pass


def _replace(path: Path, write: Callable[[Path], None], suffix: str) -> None:
    # a rename replaces a file or a link, never a directory: a directory in the way is ours to remove
    if path.is_dir() and not path.is_symlink() and not remove(path):
        raise IsADirectoryError(21, "a directory is in the way and cannot be removed")
    with _temp_beside(path, suffix) as tmp:
        write(tmp)
        os.replace(tmp, path)


def store(rel: str | Path, write: Callable[[Path], None], what: str, suffix: str = ".tmp",
          private: bool = False) -> Path | None:
    """Write an artifact: `write(tmp)` fills a temp file, which is renamed over the artifact's path in the checked
    root (a directory or other thing in the way is removed first). Where the root cannot take it (warned once) or
    must not be used, it is not stored: with `private` (the caller needs the file: a kernel library) it goes to
    this process's private directory instead. Returns where it went, or None."""
    path = artifact(rel, what)
    if path is not None:
        try:
            _replace(path, write, suffix)
            return path
        except OSError as e:
            warn(f"cannot write the cache dir ({path.parent}: {reason(e)}); the {what} is made for this run only "
                 f"(make {cache_dir()} writable, or set SPECSCOPE_CACHE)", key=f"store:{what}")
    if not private:
        return None
    path = private_dir() / rel
    try:
        _replace(path, write, suffix)
    except OSError as e:
        warn(f"cannot store the {what} even in {private_dir()} ({reason(e)})", key=f"private:{what}")
        return None
    return path


def store_json(rel: str | Path, data, what: str) -> Path | None:
    def write(tmp: Path):
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")

    return store(rel, write, what, ".json")
