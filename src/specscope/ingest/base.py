"""The interface every format parser implements, and the malformed-line bookkeeping they share."""

from __future__ import annotations

OK, MALFORMED = "ok", "malformed"
MAX_EXAMPLES = 5


class Malformed(ValueError):
    """A line that claims this format (its anchor matched) but does not parse."""


class FormatParser:
    """feed(piece, lineno) -> None (not this format), OK, or raises Malformed; result() -> record parts."""

    name = ""
    description = ""

    def __init__(self):
        self.data_lines = 0      # lines that carried numbers
        self.info_lines = 0      # recognised lines without numbers (config, startup)

    def feed(self, piece: str, lineno: int) -> str | None:
        raise NotImplementedError

    def has_data(self) -> bool:
        return self.data_lines > 0

    def result(self) -> dict:
        """{"config": {...}, "results": {...}, "samples": {...}, "warnings": [...]}"""
        raise NotImplementedError
