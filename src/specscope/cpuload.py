"""How much of the machine other processes took while we timed something.

Timings that feed a decision (serve's verify prices, a verify curve, tune's tables) are only worth keeping when
they measure the code, not a neighbour: on a 2-core host one busy process makes a 16-row verify look 3.6x a
decode step instead of 2x. The 1-minute load average answers too late and too vaguely for a measurement of a few
seconds, so this reads the kernel's CPU accounting over exactly the measured interval: every CPU's busy time
(steal included: a hypervisor's other guests are neighbours too) minus this process's own (all its threads).
Linux only; elsewhere nothing is known and nothing is claimed.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

# other processes keeping this many cores busy on average make a timing "loaded": a third of a core already
# preempts our threads often enough to move a step's time by tens of percent on a 2-core host.
# $SPECSCOPE_LOADED_CORES moves it (a host where neighbours are the normal state; the test suite, whose timings
# decide nothing, sets it to inf)
LOADED_CORES = 0.33


def loaded_cores() -> float:
    try:
        v = float(os.environ.get("SPECSCOPE_LOADED_CORES", LOADED_CORES))
    except ValueError:
        return LOADED_CORES
    return v if v > 0 else LOADED_CORES


@dataclass(frozen=True)
class Contention:
    """Over `seconds`: the average number of cores other processes (and steal) kept busy, of `cores`."""

    others_cores: float
    cores: int
    seconds: float
    limit: float = field(default_factory=loaded_cores)    # the rule when measured: a stored verdict stays as made

    @property
    def loaded(self) -> bool:
        return self.others_cores >= self.limit

    def words(self) -> str:
        return (f"other processes kept {self.others_cores:.1f} of {self.cores} core{'s' if self.cores > 1 else ''} "
                f"busy over the {self.seconds:.1f} s measured")

    def to_dict(self) -> dict:
        return {"others_cores": round(self.others_cores, 3), "cores": self.cores, "seconds": round(self.seconds, 3),
                "loaded": self.loaded}

    @classmethod
    def from_dict(cls, d) -> "Contention | None":
        """A stored reading with the verdict it was stored with, or None for anything that is not one (records
        from before the meter have none)."""
        try:
            return cls(float(d["others_cores"]), int(d["cores"]), float(d["seconds"]),
                       0.0 if d["loaded"] is True else math.inf)
        except (KeyError, TypeError, ValueError):
            return None


def _snapshot() -> tuple[int, int, int, int, float] | None:
    """(busy ticks of every CPU, all ticks of every CPU, this process's ticks, CPUs, monotonic time) or None."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    vals = [int(x) for x in lines[0].split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already counted in user/nice]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])
    cpus = sum(1 for ln in lines if ln.startswith("cpu") and ln[3:4].isdigit())
    # fields 14 and 15 of /proc/PID/stat (utime, stime), counted after the ")" that ends the command name
    mine = int(own[11]) + int(own[12])
    return total - idle, total, mine, max(cpus, 1), time.monotonic()


class ContentionMeter:
    """`with ContentionMeter() as m: ...` then `m.result`: a Contention over the block, or None (not Linux)."""

    def __init__(self):
        self.result: Contention | None = None
        self._start = None

    def __enter__(self) -> "ContentionMeter":
        self._start = _snapshot()
        return self

    def __exit__(self, *exc) -> None:
        end = _snapshot()
        if self._start is None or end is None:
            return
        busy, total, mine = (end[i] - self._start[i] for i in range(3))
        if total <= 0:
            return
        others = max(0, busy - mine) / total * end[3]
        self.result = Contention(others, end[3], end[4] - self._start[4])


def sample(seconds: float = 1.0) -> Contention | None:
    """The contention right now, over a short idle window of ours."""
    with ContentionMeter() as m:
        time.sleep(seconds)
    return m.result


def wait_quiet(timeout_s: float, window_s: float = 1.0) -> bool:
    """Wait up to `timeout_s` for a window in which others keep fewer cores busy than loaded_cores(); True when one came
    (or nothing can be known: the caller then measures as it would have)."""
    deadline = time.monotonic() + timeout_s
    while True:
        c = sample(window_s)
        if c is None or not c.loaded:
            return True
        if time.monotonic() + window_s > deadline:
            return False


# ---- the default thread count ------------------------------------------------------------------------------------
# A decode thread that shares its core with a busy process runs half the time; the row kernels no longer wait for
# it (models/csrc/pool.h), but it still adds nothing. So a decode command's default is the cores nobody else is
# keeping busy right now, sampled briefly at start; --threads still wins.
FREE_CORES_SAMPLE_S = 0.1


@dataclass(frozen=True)
class ThreadChoice:
    """The CPU thread count a run uses and why (its fingerprint and `generate --json` say it)."""

    threads: int
    source: str                      # "--threads", "free cores" or "default" (torch's own: no reading)
    usable: int | None = None        # cores this process may run on
    others_cores: float | None = None   # cores other processes kept busy over the sample

    def words(self) -> str:
        if self.source == "--threads":
            return f"{self.threads} (--threads)"
        if self.source == "default":
            return f"{self.threads} (torch's default: no CPU accounting to read here)"
        return (f"{self.threads} of {self.usable} usable cores: other processes kept {self.others_cores:.1f} busy "
                f"over {FREE_CORES_SAMPLE_S * 1e3:.0f} ms at start (--threads overrides)")

    def to_dict(self) -> dict:
        return {"threads": self.threads, "source": self.source, "usable": self.usable,
                "others_cores": None if self.others_cores is None else round(self.others_cores, 2),
                "why": self.words()}


_choice: ThreadChoice | None = None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def choose_threads(requested: int | None, default: int) -> ThreadChoice:
    """`requested` (--threads) when given; else `default` (torch's count) less the cores other processes keep busy
    now (their share of ours when the host has more CPUs than we may use), at least 1. Remembered for
    thread_choice()."""
    global _choice
    usable = usable_cores()
    if requested is not None:
        _choice = ThreadChoice(requested, "--threads", usable)
        return _choice
    c = sample(FREE_CORES_SAMPLE_S)
    if c is None:
        _choice = ThreadChoice(default, "default", usable)
        return _choice
    busy = c.others_cores * min(usable, c.cores) / c.cores
    _choice = ThreadChoice(max(1, min(default, usable - int(busy + 0.5))), "free cores", usable, c.others_cores)
    return _choice


def thread_choice() -> ThreadChoice | None:
    """The choice this process's command made (None: no decode command chose one)."""
    return _choice
