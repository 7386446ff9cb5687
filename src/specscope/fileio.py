"""Files a user names: outputs written atomically, and to regular files only; text inputs read as strict UTF-8.

Outputs go to a temp file in the target's own directory, which is then renamed over the target: a reader never
sees half a file, and any failure (disk full, permission, an interrupt) leaves the old file as it was and no temp
file behind. A rename replaces whatever sits at the target, so only a regular file (or nothing) may sit there: a
directory, a device (/dev/full), a FIFO, a socket or a symlink is refused, never replaced.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

from specscope.errors import SpecscopeError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


# what an OSError on a user's path means, in words they can act on (the CLI's handler uses the same table)
PATH_HINTS = {errno.ENAMETOOLONG: "a path component is longer than the file system allows (usually 255 bytes); "
                                  "use a shorter name",
              errno.ENOTDIR: "a part of the path is a file, not a directory; fix the path",
              errno.EACCES: "permission denied; pick a path you can use",
              errno.EROFS: "the file system is read-only; pick a writable path",
              errno.ENOSPC: "no space left on the device; free some or pick another path"}


def why(e: OSError) -> str:
    return PATH_HINTS.get(e.errno) or e.strerror or str(e)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_output_file(path, what: str = "--output") -> Path:
    """`path` can take a regular file written atomically: nothing is there yet, or a regular file (not a symlink to
    one: the rename would replace the link). Cheap, so commands call it before their work as well."""
    p = Path(path).expanduser()
    if not p.name or p.name in (".", ".."):
        raise SpecscopeError(f"{what} {str(path)!r} names a directory; pass a file name")
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise SpecscopeError(f"cannot use {what} {str(path)!r} ({why(e)}); pick another path") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        fix = "pass a file name inside it" if stat.S_ISDIR(st.st_mode) else "pass the path of a regular file"
        raise SpecscopeError(f"{what} {str(path)!r} is {_kind(st.st_mode)}; outputs are written to regular files "
                             f"only: {fix}")
    return p


def check_writable(path, what: str = "--output", is_dir: bool = False) -> None:
    """Fail before the work, not after it: the file (or directory, if is_dir) `path` could be written where it is
    asked for. Nothing is left behind; a probe file in the nearest existing directory proves it (permission bits
    alone say yes for root in /proc, or on a read-only mount)."""
    p = Path(path).expanduser()
    if not is_dir:
        check_output_file(p, what)
    if p.exists():
        if is_dir and not p.is_dir():
            raise SpecscopeError(f"{what} {str(p)!r} exists and is not a directory")
        probe = p if is_dir else p.parent
    else:
        probe = p.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise SpecscopeError(f"{what} {str(p)!r} cannot be created: {str(probe)!r} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".specscope-probe-"):
            pass
    except OSError as e:
        raise SpecscopeError(f"{what} {str(p)!r} cannot be written in {str(probe)!r} ({why(e)}); "
                             f"pick a writable location") from None


def _real(path) -> Path:
    return Path(os.path.abspath(Path(path).expanduser())).resolve()


def refuse_overlap(output, inputs: dict, what: str = "--output", fix: str = "-o", writes: tuple = ()) -> None:
    """Outputs never overwrite an input: refuse, before any work, an output that is or lies inside one of `inputs`
    ({flag or name: path or None}), or a directory output that contains one under a name it `writes`; symlinks
    resolved. Inputs that are not local paths (a hub id, a shipped name, nothing there yet) are skipped: nothing of
    theirs can be overwritten."""
    if output is None or not str(output).strip():
        return
    out = _real(output)
    for name, inp in inputs.items():
        if inp is None or not str(inp).strip() or not os.path.lexists(Path(inp).expanduser()):
            continue
        src = _real(inp)
        if out == src or (out.exists() and os.path.samefile(out, src)):
            relation = "is"
        elif src in out.parents:
            relation = "lies inside"
        elif any(src == w or src in w.parents for w in (out / n for n in writes)):
            relation = "contains"
        else:
            continue
        raise SpecscopeError(f"{what} {str(output)!r} {relation} the {name} {str(inp)!r}: writing there would "
                             f"overwrite what this command reads; choose another {fix}")


def _new_file_mode(existing: os.stat_result | None) -> int:
    """A replaced file keeps its permissions; a new one gets what open() would give it (0666 less the umask)."""
    if existing is not None:
        return stat.S_IMODE(existing.st_mode)
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


@contextmanager
def atomic_output(path, what: str = "--output", make_parents: bool = False):
    """Yields a temp path beside `path` to write; on success it is renamed over `path`, on any failure removed.
    For writers that want a file name (torch.save, safetensors, savefig); `write_atomic` takes bytes or text.
    `make_parents`: create missing parent directories (else a missing one is the error)."""
    p = check_output_file(path, what)
    tmp = None
    try:
        if make_parents:
            p.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        yield tmp
        try:
            existing = os.lstat(p)
        except FileNotFoundError:
            existing = None
        if existing is not None and not stat.S_ISREG(existing.st_mode):   # appeared while we were writing
            check_output_file(p, what)
        os.chmod(tmp, _new_file_mode(existing))
        with open(tmp, "rb") as f:       # on disk before the rename: a crash never leaves an empty target
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        fix = "" if e.errno in PATH_HINTS else "; free some space or pick a writable path"
        raise SpecscopeError(f"cannot write {what} {str(path)!r} ({why(e)}); nothing was written there{fix}") from None
    finally:
        if tmp is not None:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass


def write_atomic(path, data: str | bytes, what: str = "--output", make_parents: bool = False) -> Path:
    """Write `data` (text is UTF-8) as the whole new content of the regular file `path`; returns the path."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    with atomic_output(path, what, make_parents) as tmp:
        with open(tmp, "wb") as f:
            f.write(raw)
    return Path(path).expanduser()


# ------------------------------------------------------------------------------------------------ text inputs

def decode_utf8(data: bytes, where: str) -> str:
    """Bytes a user handed us as text; invalid UTF-8 is one error naming `where` and the byte offset, never U+FFFD
    silently standing in for the bytes (a training set, a benchmark's prompts)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecscopeError(f"{where} is not valid UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                             f"convert it, e.g. with iconv -t UTF-8") from None


def read_text(path, what: str = "file") -> str:
    """The whole of a user's text file (a prompt file, a dataset) as strict UTF-8."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise SpecscopeError(f"cannot read {what} {str(p)!r} ({why(e)})") from None
    return decode_utf8(data, f"{what} {str(p)!r}")


def iter_lines(path, what: str = "file"):
    """(line number, text) of a user's line-oriented file (JSONL), streamed, as strict UTF-8: a training set can
    be larger than memory wants twice over. A bad byte is one error naming the file, the line and the offset."""
    p = Path(path)
    offset = 0
    try:
        with open(p, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    at = offset + e.start
                    raise SpecscopeError(f"{what} {str(p)!r} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
                                         f"offset {at}, line {lineno}); convert it, e.g. with iconv -t UTF-8") from None
                offset += len(raw)
                yield lineno, text
    except OSError as e:
        raise SpecscopeError(f"cannot read {what} {str(p)!r} ({why(e)})") from None
