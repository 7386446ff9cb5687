"""One exception type for everything a user can get wrong.

The CLI prints `error: <message>` on one line and exits non-zero; messages name the problem and the fix.
"""


class SpecscopeError(Exception):
    """A user-facing error: bad input, missing files, mismatched checkpoints."""

    exit_code = 2
