"""Bisection over one ordered axis of a sweep: the first value at which a metric changes beyond launch noise.

    spec = SweepSpec(command, [parse_env_axis("BUILD=0,1,2,3,4,5,6,7")], repeats=2, workload=workload_spec())
    with SweepState.open(workdir, spec, name=None) as state:
        result = bisect(state, metric_key("verify"), Launches(state, Context(...)))

Each launch is one sweep cell (`cell.run_cell`: one engine launch stored as one registry run, recorded in the
sweep file, so a rerun launches only what is missing and `specscope sweep -w` shows the same runs), and the ends'
judgement is the sweep's (`axes.compare_cells` against `matrix.launch_noise`): a change is called when compare
calls it on the pooled runs, no repeat pair points the other way, and it is larger than the metric's
launch-to-launch noise, here measured on the two ends.

The search. Both ends are launched `repeats` times each, in ABBA order; their repeats give the noise. Ends that
do not differ beyond it leave nothing to find, and that is the answer. Otherwise the ends' change gives the bad
direction, and the open interval between the last value known good and the first known bad is halved: its middle
value is launched once (a probe) and goes to the end it lies nearer to: bad when its change from the good end is
at least half the ends' change, good otherwise (a single launch that merely leaves the noise band, which two
repeats measure loosely, is not yet a bad build). Launches: 2 × repeats at the ends, then at most ⌈log2(n − 1)⌉
probes. A probe whose engine fails, or whose requests fail, tells nothing: it is skipped (as `git bisect skip`),
the untried value nearest the middle goes next, and the answer names the skipped values between the boundary's two
sides. At the boundary comes compare's attribution between the last good value's runs and the first bad value's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from specscope.errors import SpecscopeError
from specscope.sweep.axes import CHANGED, axis_settings, compare_cells, headline
from specscope.sweep.cell import Context
from specscope.sweep.matrix import launch_noise, launch_spread
from specscope.sweep.pool import sample_counts
from specscope.sweep.run import cell_line, run_slot
from specscope.sweep.spec import SweepSpec, shown
from specscope.sweep.state import SweepState

# --metric's words -> compare's row key; a phase (verify, draft, ...) or a verify component (verify.forward) is
# `phase.NAME`, read from the plugin's per-step timings
ALIASES = {"tau": "accept_length", "τ": "accept_length", "accept_length": "accept_length",
           "tok/s": "tok_per_s", "tok_per_s": "tok_per_s", "ms/cycle": "cycle_ms", "cycle": "cycle_ms",
           "cycle_ms": "cycle_ms", "ms/token": "ms_per_token", "ms_per_token": "ms_per_token"}
TIMED_BY_PHASES = ("cycle_ms",)        # needs the engine's steps, as the phases do
METRIC_HELP = ("verify (ms/cycle), a verify component such as verify.forward, draft, accept, commit, other, "
               "tau, tok/s, ms/cycle or ms/token")


def metric_key(text: str, phases_from: str | None = None) -> str:
    """--metric as compare's row key ('verify' -> 'phase.verify', 'tau' -> 'accept_length'); refused in one line
    when it names no metric, or a phase of an engine whose phases the sweep does not read."""
    from specscope.profile.cycle import TOP_PHASES

    t = (text or "").strip()
    key = ALIASES.get(t.lower())
    if key is None:
        name = t[6:] if t.startswith("phase.") else t
        parts = name.split(".")
        if parts[0] not in TOP_PHASES or not all(p.replace("_", "").isalnum() for p in parts):
            raise SpecscopeError(f"--metric {text!r} is not a metric bisect can follow; use {METRIC_HELP}")
        key = "phase." + name
    if phases_from == "none" and (key.startswith("phase.") or key in TIMED_BY_PHASES):
        raise SpecscopeError(f"--metric {text}: this sweep reads no per-phase timings (--phases-from none, or "
                             f"auto on a command that names neither vLLM nor SGLang); use tau or tok/s, or "
                             f"--phases-from plugin / log")
    return key


def check_spec(spec: SweepSpec) -> None:
    """One ordered axis of at least two values, and repeats enough to know the launch noise."""
    if len(spec.axes) != 1:
        raise SpecscopeError(f"bisect searches one ordered axis; got {len(spec.axes)} "
                             f"({', '.join(a.name for a in spec.axes)}): give one --flag, --env or --engine-build")
    if len(spec.axes[0].values) < 2:
        raise SpecscopeError(f"bisect needs at least 2 values on its axis (the good end first, the bad end last); "
                             f"got {spec.axes[0].name}={','.join(map(shown, spec.axes[0].values))}")
    if spec.repeats < 2:
        raise SpecscopeError(f"--repeats {spec.repeats}: bisect launches each end at least twice to measure the "
                             f"launch-to-launch noise a change must leave; use --repeats 2 or more")
    if spec.baseline_without or spec.baseline_run:
        raise SpecscopeError("bisect takes no baseline (--baseline-without / --baseline-run): it compares the "
                             "axis's values with each other")


def probe_bound(n: int) -> int:
    """Probes the search launches at most between the ends of n values (none skipped): ⌈log2(n − 1)⌉."""
    return math.ceil(math.log2(n - 1)) if n > 2 else 0


# ---- the answer ---------------------------------------------------------------------------------------------------
@dataclass
class Judgement:
    """The metric's row of compare_cells between two sets of runs: the change, and the sweep's verdict on it."""
    change: float | None
    verdict: str
    label: str = ""
    note: str | None = None
    pooled: str | None = None

    def words(self) -> str:
        ch = "?" if self.change is None else f"{self.change * 100:+.1f}%"
        return f"{ch} ({self.verdict})"


@dataclass
class Probe:
    value: object
    index: int
    runs: list[str]
    side: str                   # good | bad | skipped
    judgement: Judgement | None = None
    reason: str | None = None   # why it was skipped
    share: float | None = None  # how far it lies from the good end towards the bad one (0 good, 1 bad)


@dataclass
class BisectResult:
    name: str
    axis: str
    axis_key: str
    values: list
    metric: str
    label: str | None = None
    status: str = "found"       # found | no change | ends failed
    repeats: int = 2
    noise: float | None = None          # the band the metric's change must leave (matrix.launch_noise)
    own_noise: float | None = None      # the metric's own repeats' largest spread
    ends: Judgement | None = None
    good_runs: list[str] = field(default_factory=list)
    bad_runs: list[str] = field(default_factory=list)
    probes: list[Probe] = field(default_factory=list)
    last_good: object = None
    first_bad: object = None
    skipped_between: list = field(default_factory=list)
    launches: int = 0           # the search's launches, this invocation's and earlier ones' (the cost of the answer)
    launched_now: int = 0
    most_launches: int = 0      # 2 × repeats + ⌈log2(n − 1)⌉ + the skipped probes
    attribution: dict | None = None
    reason: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


# ---- launching ------------------------------------------------------------------------------------------------
class Launches:
    """The axis's values as sweep slots: a slot already in the sweep file is read back, a missing one launched
    (`retry_failed`: a failed one too, once). `note(text)` gets a line per launch."""

    def __init__(self, state: SweepState, ctx: Context, *, retry_failed: bool = False, note=None, advance=None):
        self.state, self.ctx, self.retry = state, ctx, retry_failed
        self.cells = state.spec.cells()
        self.note, self.advance = note or (lambda _: None), advance or (lambda: None)
        self.used = self.now = 0
        self.retried: set = set()

    def run(self, index: int, repeat: int) -> tuple[dict | None, str | None]:
        """(the stored run, None) or (None, why it gave none)."""
        cell = self.cells[index]
        o = self.state.outcome(cell.key, repeat)
        rec = self._stored(o) if o and o["status"] == "ok" else None
        again = o is not None and o["status"] != "ok" and self.retry and (cell.key, repeat) not in self.retried
        if rec is None and (o is None or o["status"] == "ok" or again):
            self.retried.add((cell.key, repeat))
            o = run_slot(self.state, self.ctx, cell, repeat)
            self.now += 1
            self.note(cell_line(cell.key, repeat, o))
            self.advance()
            rec = self._stored(o) if o["status"] == "ok" else None
        self.used += 1
        if rec is None:
            return None, o.get("reason") or "no run"
        failed = sample_counts([rec])["failed_requests"]
        if failed:
            return None, f"{failed} request(s) failed in run {rec['id']}"
        return rec, None

    def _stored(self, outcome: dict) -> dict | None:
        from specscope.registry import open_registry

        try:
            with open_registry(self.ctx.db, create=False) as reg:
                return reg.get_run(outcome["run_id"])
        except SpecscopeError:
            return None         # deleted from the registry since: launched again

    def ends(self, n: int, repeats: int) -> tuple[list, list, list[str]]:
        """Both ends, `repeats` launches each in ABBA order: (good runs, bad runs, why a launch gave none)."""
        good, bad, why = [], [], []
        for r in range(repeats):
            for i in ((0, n - 1) if r % 2 == 0 else (n - 1, 0)):
                rec, reason = self.run(i, r)
                if rec is None:
                    why.append(f"{self.cells[i].key} #{r + 1}: {reason}")
                else:
                    (good if i == 0 else bad).append(rec)
        return good, bad, why


# ---- judging --------------------------------------------------------------------------------------------------
def judge(ref: list[dict], other: list[dict], metric: str, noise: dict, labels: tuple[str, str]) -> Judgement | None:
    """The metric's row between two sets of runs, by the sweep's rule; None when the runs have no such row."""
    s = compare_cells(ref, other, labels[0], labels[1], noise, keep=lambda m: m == metric)
    row = next(iter(s["rows"]), None)
    if row is None:
        return None
    return Judgement(row["change"], row["verdict"], row["label"], row.get("note"), row["pooled"])


def attribution(ref: list[dict], other: list[dict], metric: str, noise: dict, labels: tuple[str, str],
                axis) -> dict:
    """compare's attribution at the boundary: the headline rows and the metric's, judged as the sweep judges,
    compare's summary, its likely causes, whether the top one is the axis's own setting, and where the axis's
    setting ranks among them (`axis_rank`, 1 first; a machine's difference, such as its load average, can rank
    above a setting compare knows nothing of)."""
    s = compare_cells(ref, other, labels[0], labels[1], noise, keep=lambda m: m == metric or headline(m),
                      causes=None)
    causes = [c.get("key") for c in s["likely_causes"]]
    own = axis_settings(axis, s["settings"])
    rank = next((i + 1 for i, k in enumerate(causes) if k in own), None)
    return {"from": labels[0], "to": labels[1], "rows": s["rows"], "summary": s["summary"],
            "components": s["components"],
            "likely_causes": s["likely_causes"], "cause": causes[0] if causes else None,
            "cause_is_axis": rank == 1, "axis_rank": rank, "axis_settings": own}


def _noise(good: list[dict], bad: list[dict], metric: str) -> tuple[dict, float | None, float | None]:
    from specscope.sweep.matrix import own_noise

    pairs = launch_spread(good) + launch_spread(bad)
    band = launch_noise(pairs)
    return band, band.get(metric), own_noise(pairs).get(metric)


# ---- the search -----------------------------------------------------------------------------------------------
def bisect(state: SweepState, metric: str, launches: Launches, note=None) -> BisectResult:
    """Launch the ends, judge them, and halve the interval between them (see the module's doc)."""
    note = note or (lambda _: None)
    spec = state.spec
    check_spec(spec)
    axis, n = spec.axes[0], len(spec.axes[0].values)
    res = BisectResult(state.name, axis.name, axis.key, list(axis.values), metric, repeats=spec.repeats,
                       most_launches=2 * spec.repeats + probe_bound(n))
    good, bad, why = launches.ends(n, spec.repeats)
    res.good_runs, res.bad_runs = [r["id"] for r in good], [r["id"] for r in bad]
    if why:
        res.status, res.reason = "ends failed", "; ".join(why)
        return _counted(res, launches)
    band, res.noise, res.own_noise = _noise(good, bad, metric)
    keys = [c.key for c in launches.cells]
    res.ends = judge(good, bad, metric, band, (keys[0], keys[-1]))
    if res.ends is None:
        raise SpecscopeError(f"--metric {metric}: the runs have no such row (they have "
                             f"{', '.join(_metrics_of(good[0], bad[0]))}); the runs are kept: run bisect again "
                             f"with another --metric and nothing is launched twice")
    res.label = res.ends.label
    note(f"ends {keys[0]} → {keys[-1]}: {res.label} {res.ends.words()}" + _band_words(res))
    if res.ends.verdict not in CHANGED:
        res.status = "no change"
        return _counted(res, launches)
    known, lo, hi, skipped = _search(res, launches, {0: good, n - 1: bad}, band, note)
    res.last_good, res.first_bad = axis.values[lo], axis.values[hi]
    res.skipped_between = [axis.values[i] for i in sorted(skipped) if lo < i < hi]
    res.most_launches += len(skipped)
    res.attribution = attribution(known[lo], known[hi], metric, band, (keys[lo], keys[hi]), axis)
    return _counted(res, launches)


def _search(res: BisectResult, launches: Launches, known: dict, band: dict, note) -> tuple[dict, int, int, set]:
    """Halve (last good, first bad) until they are neighbours, skipped values aside; a probe's change is measured
    from the good end's runs and it goes to the nearer end (the ends' change is called, so it is not zero)."""
    keys = [c.key for c in launches.cells]
    lo, hi, skipped = 0, len(keys) - 1, set()
    while True:
        todo = [i for i in range(lo + 1, hi) if i not in skipped]
        if not todo:
            return known, lo, hi, skipped
        mid = (lo + hi) / 2
        i = min(todo, key=lambda k: (abs(k - mid), k))
        rec, why = launches.run(i, 0)
        if rec is None:
            skipped.add(i)
            res.probes.append(Probe(res.values[i], i, [], "skipped", reason=why))
            note(f"{keys[i]}: skipped ({why})")
            continue
        j = judge(known[0], [rec], res.metric, band, (keys[0], keys[i]))
        if j is None or j.change is None:
            skipped.add(i)
            why = f"run {rec['id']} has no {res.label} to judge"
            res.probes.append(Probe(res.values[i], i, [rec["id"]], "skipped", j, reason=why))
            note(f"{keys[i]}: skipped ({why})")
            continue
        share = j.change / res.ends.change
        side = "bad" if share >= 0.5 else "good"
        known[i] = [rec]
        lo, hi = (lo, i) if side == "bad" else (i, hi)
        res.probes.append(Probe(res.values[i], i, [rec["id"]], side, j, share=share))
        note(f"{keys[i]}: {side} ({res.label} {probe_words(res.probes[-1])} against {keys[0]})")


def _counted(res: BisectResult, launches: Launches) -> BisectResult:
    res.launches, res.launched_now = launches.used, launches.now
    return res


def _metrics_of(a: dict, b: dict) -> list[str]:
    from specscope.registry.compare import compare_runs

    return [r["metric"] for r in compare_runs([a, b])["rows"]]


def _band_words(res: BisectResult) -> str:
    if res.noise is None:
        return "; no launch-to-launch noise measured for it"
    own = "" if res.own_noise is None else f" (its own repeats up to {res.own_noise * 100:.0f}%)"
    return f"; a change must leave the launch noise of {res.noise * 100:.0f}%{own}"


# ---- words ----------------------------------------------------------------------------------------------------
def probe_words(p: Probe) -> str:
    """'+31.0% (worse), 41% of the ends' change'."""
    return f"{p.judgement.words()}, {p.share * 100:.0f}% of the ends' change"


def text_lines(res: BisectResult) -> list[str]:
    """The answer as the terminal prints it."""
    ax = res.axis
    head = (f"bisect {res.name}: {res.label or res.metric} over {ax} ({len(res.values)} values, "
            f"{shown(res.values[0])} … {shown(res.values[-1])})")
    if res.status == "ends failed":
        return [head, f"  the ends gave no runs to judge: {res.reason}"]
    ends = f"  ends {ax}={shown(res.values[0])} → {shown(res.values[-1])}: {res.ends.words()}" + _band_words(res)
    count = (f"  launches: {res.launches} ({2 * res.repeats} at the ends: {res.repeats} repeats each, "
             f"{len(res.probes)} probe(s); at most {res.most_launches} for {len(res.values)} values), "
             f"{res.launched_now} now")
    if res.status == "no change":
        why = f" ({res.ends.note})" if res.ends.note else ""
        return [head, f"  no change beyond launch noise between the ends{why}: nothing to bisect", ends, count]
    out = [head, f"  first bad: {ax}={shown(res.first_bad)}    last good: {ax}={shown(res.last_good)}", ends]
    if res.skipped_between:
        out.append(f"  not judged between them (skipped): {', '.join(map(shown, res.skipped_between))}")
    for p in res.probes:
        what = p.reason if p.side == "skipped" else probe_words(p)
        out.append(f"    probe {ax}={shown(p.value)}: {p.side} ({what})")
    out.append(count)
    att = res.attribution
    out.append(f"  compare {att['from']} → {att['to']}: {att['summary']}")
    if att["likely_causes"]:
        rank, causes = att["axis_rank"], att["likely_causes"]
        words = [("" if i <= 3 else f"#{i} ") + c["key"] + (" (the axis)" if i == rank else "")
                 for i, c in enumerate(causes, 1) if i <= 3 or i == rank]
        out.append("    compare's likely causes: " + ", ".join(words))
    return out
