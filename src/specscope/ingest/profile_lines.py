"""specscope's own profile report (`CycleProfiler.lines()`), e.g. from a saved terminal log:

    Draft: 1.12 ms/cyc (  4.1%)
    Target verify: 26.07 ms/cyc ( 95.6%)
    Cycles: 40, tokens: 118, 27.19 ms/cyc (median 27.00, p90 28.10)
    τ (accept length): 2.95  histogram 1:10 2:5 3:25
    Per-position acceptance (unconditional): 0.750, 0.500
    Decode: 108.50 tok/s (9.22 ms/token)

Several reports in one file are pooled, weighted by their cycle counts when they print them.
"""

from __future__ import annotations

import re

from specscope.ingest.base import OK, FormatParser, Malformed
from specscope.ingest.lines import number

PHASE = re.compile(r"^\s*([^:]+?):\s+(\S+)\s+ms/cyc\s*\(\s*(\S+?)\s*%\)\s*$")
PHASE_ANCHOR = re.compile(r"^\s*[^:]+:\s+[\d.]+\s*ms/c")  # claims to be a phase line, even if cut short
CYCLES = re.compile(r"^\s*Cycles:\s*(\d+),\s*tokens:\s*(\d+),\s*(\S+)\s+ms/cyc")
TAU = re.compile(r"^\s*τ \(accept length\):\s*(\S+)")
PER_POS = re.compile(r"^\s*Per-position acceptance \(unconditional\):\s*(.*)$")
DECODE = re.compile(r"^\s*Decode:\s*(\S+)\s+tok/s\s*\(\s*(\S+)\s+ms/token\)")


def _labels() -> dict[str, str]:
    try:
        from specscope.profile.cycle import PHASE_LABELS
    except ImportError:
        PHASE_LABELS = {}
    out = {v.lower(): k for k, v in PHASE_LABELS.items()}
    out.update({"draft": "draft", "target verify": "verify", "verify": "verify", "accept": "accept",
                "commit": "commit", "other": "other", "target decode": "decode", "decode": "decode"})
    return out


class ProfileParser(FormatParser):
    name = "specscope"
    description = "specscope profile lines ('Name: X ms/cyc ( Y%)')"

    def __init__(self):
        super().__init__()
        self.labels = _labels()
        self.blocks: list[dict] = []
        self.cur: dict | None = None

    def _block(self, key: str | None = None, new: bool = False) -> dict:
        """The current report; a phase seen twice (or a second Cycles line) starts the next one."""
        if new or self.cur is None or (key is not None and key in self.cur["phases"]):
            self.cur = {"phases": {}, "shares": {}}
            self.blocks.append(self.cur)
        return self.cur

    def feed(self, piece: str, lineno: int) -> str | None:
        line = piece.rstrip("\n")
        if "ms/c" not in line and not line.lstrip().startswith(("Cycles:", "τ (", "Per-position", "Decode:")):
            return None  # cheap rejection: this runs on every line of the file
        try:
            m = CYCLES.match(line)
            if m:
                b = self._block()
                if "cycles" in b:
                    b = self._block(new=True)
                b["cycles"], b["tokens"], b["cycle_ms"] = int(m.group(1)), int(m.group(2)), number(m.group(3))
                return self._ok()
            m = TAU.match(line)
            if m:
                self._block()["tau"] = number(m.group(1))
                return self._ok()
            m = PER_POS.match(line)
            if m:
                self._block()["per_pos"] = [number(x) for x in m.group(1).split(",") if x.strip()]
                return self._ok()
            m = DECODE.match(line)
            if m:
                b = self._block()
                b["tok_s"], b["ms_tok"] = number(m.group(1)), number(m.group(2))
                return self._ok()
            if PHASE_ANCHOR.search(line):
                m = PHASE.match(line)
                if not m:
                    raise ValueError("phase line does not parse (truncated?)")
                label = m.group(1).strip()
                key = self.labels.get(label.lower(), label if "." in label else label.lower().replace(" ", "_"))
                b = self._block(key)
                b["phases"][key] = number(m.group(2))
                b["shares"][key] = number(m.group(3)) / 100.0
                return self._ok()
        except ValueError as e:
            self.malformed("profile lines")
            raise Malformed(f"profile line: {e}") from None
        return None

    def _ok(self) -> str:
        self.data_lines += 1
        self.saw("profile lines")
        return OK

    def result(self) -> dict:
        blocks = [b for b in self.blocks if b["phases"] or "cycles" in b or "tau" in b]
        w = [b.get("cycles") or 1 for b in blocks]
        res: dict = {"reports": len(blocks)}
        names = []
        for b in blocks:
            names += [k for k in b["phases"] if k not in names]
        phases = {}
        for k in names:
            pairs = [(b["phases"][k], b["shares"][k], wi) for b, wi in zip(blocks, w) if k in b["phases"]]
            tw = sum(p[2] for p in pairs)
            phases[k] = {"mean_ms": sum(p[0] * p[2] for p in pairs) / tw,
                         "share": sum(p[1] * p[2] for p in pairs) / tw}
        if phases:
            res["phases"] = phases
            cyc = sum(v["mean_ms"] for k, v in phases.items() if "." not in k)
            res["cycle_ms"] = {"mean_ms": cyc}
        counted = [b for b in blocks if "cycles" in b and b["cycles"]]
        if counted:
            cycles, tokens = sum(b["cycles"] for b in counted), sum(b["tokens"] for b in counted)
            res["cycles"], res["tokens"] = cycles, tokens
            res["accept_length"] = tokens / cycles  # τ from its parts, not the printed mean
            total_ms = sum(b["cycles"] * b["cycle_ms"] for b in counted)
            if total_ms > 0:
                res["tok_per_s"] = tokens / (total_ms / 1e3)
                res["decode_ms_per_token"] = total_ms / tokens
        else:
            taus = [b["tau"] for b in blocks if "tau" in b]
            if taus:
                res["accept_length"] = sum(taus) / len(taus)
            rates = [b["tok_s"] for b in blocks if "tok_s" in b]
            if rates:
                res["tok_per_s"] = sum(rates) / len(rates)
                res["decode_ms_per_token"] = 1e3 / res["tok_per_s"]
        pp = [(b["per_pos"], wi) for b, wi in zip(blocks, w) if b.get("per_pos")]
        if pp:
            depth = max(len(p) for p, _ in pp)
            res["per_position_acceptance"] = [
                sum(p[i] * wi for p, wi in pp if len(p) > i) / sum(wi for p, wi in pp if len(p) > i)
                for i in range(depth)]
        samples = {"reports": [{"phases": b["phases"], "cycles": b.get("cycles"), "tokens": b.get("tokens"),
                                "accept_length": b.get("tau")} for b in blocks]}
        config = {"engine": "specscope"}
        if res.get("per_position_acceptance"):
            config["steps"] = len(res["per_position_acceptance"])  # one acceptance per draft depth
        return {"config": config, "results": res, "samples": samples, "warnings": [],
                "env": {"engine": "specscope"}}

    def has_data(self) -> bool:
        return any(b["phases"] or "cycles" in b or "tau" in b for b in self.blocks)
