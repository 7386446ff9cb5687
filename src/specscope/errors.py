"""One exception type for everything a user can get wrong.

The CLI prints `error: <message>` on one line and exits non-zero; messages name the problem and the fix.
"""

import os
import stat
from pathlib import Path


class SpecscopeError(Exception):
    """A user-facing error: bad input, missing files, mismatched checkpoints."""

    exit_code = 2


def require_file(path, what: str = "file") -> None:
    """A readable regular file, or one line saying which of missing / directory / device it is instead."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise SpecscopeError(f"{what} {str(p)!r} does not exist") from None
    except OSError as e:
        raise SpecscopeError(f"cannot read {what} {str(p)!r} ({e.strerror or e})") from None
    if stat.S_ISDIR(st.st_mode):
        raise SpecscopeError(f"{what} {str(p)!r} is a directory; pass a file")
    if not stat.S_ISREG(st.st_mode):
        raise SpecscopeError(f"{what} {str(p)!r} exists but is not a regular file (a device, pipe or socket); "
                             f"pass a file, or '-' to read standard input where supported")
    if not os.access(p, os.R_OK):
        raise SpecscopeError(f"{what} {str(p)!r} is not readable (permission denied)")
