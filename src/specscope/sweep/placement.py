"""Where a sweep's processes run: the engine's compute threads on cores of their own, and its API server, its
scheduler and the sweep's own client on the cores left over, so one launch is not slowed by whichever of them the
kernel happened to put on a compute core.

Why: vLLM's CPU build binds its worker's OpenMP threads (auto: core 0 of a 2-core host, core 1 "reserved") but
leaves its API server, its engine-core process and our client free to land on the compute core, and which of them
preempts the forward, how often, differs from launch to launch. Pinning the rest off the compute cores takes that
lottery out of the measurement.

`plan` decides per cell (its command says how many ranks; its environment may bind the threads itself: the user's
binding is kept, and only the rest is pinned around it); `pinned` applies the plan to this process (the client) and,
by inheritance, to the engine started inside it, whose compute threads the engine then binds to their own cores.
A host without enough cores, a GPU engine or an engine whose binding specscope does not know is not pinned, and
the plan says so in one line.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

from specscope.engines import named_in
from specscope.sweep.spec import flag_value


@dataclass(frozen=True)
class Placement:
    compute: tuple[tuple[int, ...], ...] = ()   # per rank: the cores its compute threads are bound to
    rest: tuple[int, ...] = ()                  # API server, scheduler, client; () when not pinned
    env: dict = field(default_factory=dict)     # set in the engine's environment (its own binding variable)
    words: str = ""

    @property
    def pinned(self) -> bool:
        return bool(self.rest)

    def to_dict(self) -> dict:
        return {"pinned": self.pinned, "compute": [list(c) for c in self.compute], "rest": list(self.rest),
                "env": dict(self.env), "words": self.words}


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _ranks(argv: list[str]) -> int:
    """Worker ranks on this host: tensor × pipeline parallel (vLLM's and SGLang's spellings)."""
    n = 1
    for flags in (("--tensor-parallel-size", "-tp", "--tp-size", "--tp"), ("--pipeline-parallel-size", "-pp",
                                                                             "--pp-size")):
        for f in flags:
            v = flag_value(argv, f)
            if v is not None and v.isdigit() and int(v) > 0:
                n *= int(v)
                break
    return n


def _parse_bind(text: str) -> tuple[tuple[int, ...], ...] | None:
    """'0-3|4,5' -> ((0, 1, 2, 3), (4, 5)); None for vLLM's words (auto, nobind) or anything else."""
    groups = []
    try:
        for part in text.split("|"):
            cores: list[int] = []
            for item in part.split(","):
                lo, _, hi = item.strip().partition("-")
                cores += range(int(lo), int(hi or lo) + 1)
            groups.append(tuple(cores))
    except ValueError:
        return None
    return tuple(groups)


def _gpu_host() -> bool:
    return any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd"))


def plan(argv: list[str], cell_env: dict, mode: str = "auto", cores: list[int] | None = None) -> Placement:
    """The placement of one cell's launch (`cell_env`: the environment the sweep sets for it, axes included)."""
    if mode == "off":
        return Placement(words="not pinned (--pin off)")
    engine = named_in(" ".join(argv))
    var = getattr(engine, "CPU_BIND_ENV", None)
    if engine is None or var is None:
        who = engine.TITLE if engine else "this engine"
        return Placement(words=f"not pinned: specscope does not know how {who} binds its compute threads")
    if _gpu_host():
        return Placement(words="not pinned: the engine computes on the GPU")
    cores = _cores() if cores is None else sorted(cores)
    ranks = _ranks(argv)
    given = cell_env.get(var, os.environ.get(var))
    bound = _parse_bind(given) if given else None
    if given and bound is None:     # vLLM's own words (auto, nobind): the user leaves placement to the engine
        return Placement(words=f"not pinned: {var}={given} leaves the threads' placement to the engine")
    if bound is not None:       # the user's (or the axis's) binding: kept, the rest pinned around it
        taken = {c for g in bound for c in g}
        rest = tuple(c for c in cores if c not in taken)
        if not rest:
            return Placement(compute=bound, words=f"not pinned: {var}={given} binds every core; the engine's "
                                                  f"server and the client share them")
        return Placement(bound, rest, {}, _words(bound, rest, f" ({var}={given})"))
    if len(cores) < ranks + 1:
        return Placement(words=f"not pinned: {len(cores)} core(s) for {ranks} rank(s) plus the engine's server "
                               f"and the client; they share cores")
    spare = max(1, len(cores) // 8)          # the server, scheduler and client: a core, more on large hosts
    per = (len(cores) - spare) // ranks
    compute = tuple(tuple(cores[r * per:(r + 1) * per]) for r in range(ranks))
    rest = tuple(cores[ranks * per:])
    return Placement(compute, rest, {var: engine.cpu_bind(compute)}, _words(compute, rest, ""))


def _span(cores) -> str:
    cores = list(cores)
    if len(cores) == 1:
        return f"core {cores[0]}"
    run = cores == list(range(cores[0], cores[-1] + 1))
    return f"cores {cores[0]}-{cores[-1]}" if run else f"cores {','.join(map(str, cores))}"


def _words(compute, rest, how: str) -> str:
    ranks = "; ".join(f"rank {i} on {_span(c)}" for i, c in enumerate(compute)) if len(compute) > 1 \
        else f"on {_span(compute[0])}"
    return f"pinned: the engine's compute threads {ranks}{how}; its API server, scheduler and the client on " \
           f"{_span(rest)}"


def _set_all(mask) -> None:
    """The affinity of every thread of this process (os.sched_setaffinity(0) moves the calling thread alone)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), mask)


@contextlib.contextmanager
def pinned(p: Placement):
    """This process (the client) on `p.rest` while the block runs, so the engine it starts inherits that mask
    (its compute threads then bind themselves to theirs); the old mask comes back after."""
    if not p.pinned or not hasattr(os, "sched_setaffinity"):
        yield
        return
    old = os.sched_getaffinity(0)
    _set_all(p.rest)
    try:
        yield
    finally:
        _set_all(old)
