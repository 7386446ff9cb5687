"""The interface every format parser implements, and the line bookkeeping they share."""

from __future__ import annotations

OK = "ok"
MAX_EXAMPLES = 5
MALFORMED_REASON = "malformed (corrupt, truncated or interleaved; see malformed_examples)"


class Malformed(ValueError):
    """A line that claims this format (its anchor matched) but does not parse."""


class FormatParser:
    """feed(piece, lineno) -> None (not this format), OK, or raises Malformed; result() -> record parts.

    Every recognised line is counted under a kind ("decode", "SpecDecoding v1", ...): read, and — decided when the
    figures are computed — skipped (no figure uses it) or partly used, each with a reason. `line_report()` turns
    that into {kind: {"read", "used", "skipped": {reason: n}, "partial": {reason: n}}}.
    """

    name = ""
    description = ""

    def __init__(self):
        self.data_lines = 0      # lines that carried numbers
        self.info_lines = 0      # recognised lines without numbers (config, startup)
        self.kinds: dict[str, dict] = {}

    def _kind(self, kind: str) -> dict:
        k = self.kinds.get(kind)
        if k is None:
            k = self.kinds[kind] = {"read": 0, "skipped": {}, "partial": {}}
        return k

    def saw(self, kind: str) -> None:
        self._kind(kind)["read"] += 1

    def skip(self, kind: str, reason: str, n: int = 1) -> None:
        """n lines of `kind` enter no figure, because `reason`."""
        if n:
            d = self._kind(kind)["skipped"]
            d[reason] = d.get(reason, 0) + n

    def partial(self, kind: str, reason: str, n: int = 1) -> None:
        """n lines of `kind` enter some figures but not all (reason names which and why)."""
        if n:
            d = self._kind(kind)["partial"]
            d[reason] = d.get(reason, 0) + n

    def malformed(self, kind: str) -> None:
        self.saw(kind)
        self.skip(kind, MALFORMED_REASON)

    def line_report(self) -> dict:
        out = {}
        for kind, k in self.kinds.items():
            used = k["read"] - sum(k["skipped"].values())
            out[kind] = {"read": k["read"], "used": used, "skipped": dict(k["skipped"]), "partial": dict(k["partial"])}
        return out

    def feed(self, piece: str, lineno: int) -> str | None:
        raise NotImplementedError

    def has_data(self) -> bool:
        return self.data_lines > 0

    def result(self) -> dict:
        """{"config": {...}, "results": {...}, "samples": {...}, "warnings": [...]}"""
        raise NotImplementedError
