"""Which draft shape (or none) a batched step uses at a given batch size: `serve --spec-policy`.

'priced' (the default) learns it from the server's own steps (PricedPolicy, at the end of this module); 'always'
and 'off' need nothing; 'auto' and a JSON path read a table that `specscope tune --save-policy` writes:
the best predicted shape per concurrency level and the crossover concurrency past which plain decoding is faster.
`auto` looks the table up under the cache directory, keyed by the model, the drafter and the dtype (`policy_path`):
a bf16 step costs half an fp32 one while drafting does not, so their crossovers differ.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Callable

from specscope import cachedir
from specscope.errors import SpecscopeError
from specscope.jsonio import short_dtype

POLICIES = ("priced", "always", "off", "auto")
TABLE_KIND = "spec_policy"
TABLE_VERSION = 1


def spec_policy(value: str, cfg, *, model: str | None = None, draft: str | None = None,
                dtype: str | None = None, prices=None) -> Callable[[int], object]:
    """`--spec-policy` -> policy(batch_size) -> SpecConfig or None (a plain step). 'priced': a PricedPolicy, which
    the engine also tells about every step (`prices`: this host's verify curve, its first estimate); 'always': the
    drafter's shape at every batch size; 'off': never speculate (the drafter still loads, for comparison runs);
    'auto': the table `tune --save-policy` stored for this model, drafter and dtype (`model`, `draft`, `dtype` name
    them; see policy_path); any other value: the path of such a table. A table's shapes must fit within `cfg`, the shape the engine sized its
    regions and drafter caches for (`envelope(table)` is the smallest that does)."""
    dtype = short_dtype(dtype)
    if value == "priced":
        return PricedPolicy(cfg, prices)
    if value == "always":
        return lambda n: cfg
    if value == "off":
        return lambda n: None
    if value == "auto":
        if not model or not draft:
            raise SpecscopeError("--spec-policy auto looks the table up by model and drafter, which were not given; "
                                 "pass the table's path instead (`specscope tune --save-policy PATH`)")
        path = policy_path(model, draft, dtype)
        if cachedir.artifact(Path("spec-policy") / path.name, "spec-policy table") is None:   # warned why
            raise SpecscopeError(f"--spec-policy auto: not reading a table from the cache dir {cachedir.cache_dir()} "
                                 f"(the warning above says why); pass the table's path instead")
        if not path.is_file():
            raise SpecscopeError(f"--spec-policy auto: no table for model {model!r} and drafter {draft!r}"
                                 + (f" in {dtype}" if dtype and dtype != "fp32" else "") + f" at {path}; "
                                 f"make one with `specscope tune --run ID --verify-curve SURFACE --save-policy` "
                                 f"(or pass always, off or a table's path)")
        table = load_table(path)
    elif value.endswith(".json") or Path(value).is_file():
        table = load_table(Path(value))
    else:
        raise SpecscopeError(f"--spec-policy {value!r} is not one of {', '.join(POLICIES)} nor a table (.json) "
                             f"written by `specscope tune --save-policy`")
    if dtype and table.get("dtype") and short_dtype(table["dtype"]) != dtype:
        raise SpecscopeError(f"--spec-policy: the table was tuned in {table['dtype']}, not {dtype}: its costs are "
                             f"another dtype's; tune a run in {dtype} with --save-policy")
    if draft and table.get("draft") and table["draft"] != draft:
        raise SpecscopeError(f"--spec-policy: the table was tuned for drafter {table['draft']!r}, not {draft!r}")
    if model and table.get("model") and _canonical_model(table["model"]) != _canonical_model(model):
        raise SpecscopeError(f"--spec-policy: the table was tuned for model {table['model']!r}, not {model!r}")
    return policy_from_table(table, cfg)


# ------------------------------------------------------------------------------------------------ the table

def make_table(levels: list[dict], crossover: float | None, model: str, draft: str, **extra) -> dict:
    """levels: tune.by_concurrency rows (batch, steps, topk, draft_tokens, [ngram_tokens], speedup, ...)."""
    keep = ("batch", "steps", "topk", "draft_tokens", "ngram_tokens", "speedup", "tau", "tau_needed",
            "verify_tokens", "plain_ms_per_token", "spec_ms_per_token")
    return {"kind": TABLE_KIND, "version": TABLE_VERSION, "model": model, "draft": draft,
            "levels": [{k: r[k] for k in keep if k in r} for r in levels], "crossover": crossover, **extra}


def check_table(table, where: str = "the table") -> dict:
    if not isinstance(table, dict) or table.get("kind") != TABLE_KIND:
        raise SpecscopeError(f"{where} is not a spec-policy table (written by `specscope tune --save-policy`)")
    if table.get("version") != TABLE_VERSION:
        raise SpecscopeError(f"{where} is spec-policy table version {table.get('version')!r}; this specscope "
                             f"reads version {TABLE_VERSION}: tune again with --save-policy")
    levels = table.get("levels")
    if not isinstance(levels, list) or not levels:
        raise SpecscopeError(f"{where} has no concurrency levels")
    for r in levels:
        if not isinstance(r, dict) or not all(isinstance(r.get(k), int) and r[k] >= 1
                                              for k in ("batch", "steps", "topk", "draft_tokens")) \
                or not isinstance(r.get("speedup"), (int, float)):
            raise SpecscopeError(f"{where}: a level lacks batch, steps, topk, draft_tokens or speedup: {r!r}")
    c = table.get("crossover")
    if c is not None and not (isinstance(c, (int, float)) and c > 0):
        raise SpecscopeError(f"{where}: crossover must be a positive number or null, got {c!r}")
    return table


def load_table(path: Path) -> dict:
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecscopeError(f"--spec-policy {str(path)!r}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecscopeError(f"--spec-policy {str(path)!r}: cannot read it as JSON ({e})") from None
    return check_table(table, f"--spec-policy {str(path)!r}")


def save_table(table: dict, path) -> str:
    from specscope.fileio import write_atomic

    check_table(table)
    return str(write_atomic(path, json.dumps(table, indent=1) + "\n", "--save-policy", make_parents=True))


def _shape(row: dict):
    from specscope.speculative.decode import SpecConfig

    cfg = SpecConfig(row["steps"], row["topk"], row["draft_tokens"], int(row.get("ngram_tokens") or 0))
    cfg.validate()
    return cfg


def envelope(table: dict):
    """The smallest SpecConfig whose verify width and drafter-cache expansion hold every shape of the table: the
    shape to start an engine with under this policy."""
    from specscope.speculative.decode import SpecConfig

    rows = check_table(table)["levels"]
    return SpecConfig.from_knobs(max(r["steps"] for r in rows), max(r["topk"] for r in rows),
                                 max(r["draft_tokens"] for r in rows),
                                 max(int(r.get("ngram_tokens") or 0) for r in rows))


def policy_from_table(table: dict, cfg) -> Callable[[int], object]:
    """policy(B): None at or past the crossover, or where the level's best predicted speedup is not above 1;
    otherwise the shape of the largest level <= B (the first level below it)."""
    rows = sorted(check_table(table)["levels"], key=lambda r: r["batch"])
    cross = table.get("crossover")
    shapes = []
    for r in rows:
        s = _shape(r) if r["speedup"] > 1.0 else None
        if s is not None and cfg is not None and (s.verify_tokens > cfg.verify_tokens
                                                  or s.expansion_slots > cfg.expansion_slots):
            env = envelope(table)
            raise SpecscopeError(
                f"--spec-policy: the table's shape at batch {r['batch']} (steps {s.steps}, topk {s.topk}, draft "
                f"tokens {s.draft_tokens}, n-gram tokens {s.ngram_tokens}) is larger than the engine's (steps "
                f"{cfg.steps}, topk {cfg.topk}, draft tokens {cfg.draft_tokens}, n-gram tokens {cfg.ngram_tokens}); "
                f"start it with --steps {env.steps} --topk {env.topk} --draft-tokens {env.draft_tokens}"
                + (f" --ngram-tokens {env.ngram_tokens}" if env.ngram_tokens else ""))
        shapes.append((r["batch"], s))
    memo: dict[int, object] = {}

    def policy(n: int):
        if n not in memo:     # called every engine step: look each batch size up once
            if cross is not None and n >= cross:
                memo[n] = None
            else:
                memo[n] = next((s for b, s in reversed(shapes) if b <= n), shapes[0][1])
        return memo[n]

    return policy


# ------------------------------------------------------------------------------------------------ where it lives

def _canonical_model(model: str) -> str:
    """A known model's name whether given by name or by its pulled directory (tune reads the directory from its
    run, serve gets the name), else the resolved path of a directory, else the string as given."""
    from specscope.models.hub import KNOWN_MODELS, models_dir

    if model in KNOWN_MODELS:
        return model
    p = Path(model).expanduser()
    if p.is_dir():
        p = p.resolve()
        if p.parent == models_dir().resolve() and p.name in KNOWN_MODELS:
            return p.name
        return str(p)
    return model


def policy_key(model: str, draft: str, dtype: str | None = None) -> str:
    """The file name of a (model, drafter, dtype) table: readable names plus a hash of the exact triple (fp32, or
    no dtype, keeps the name tables had before dtypes were told apart)."""
    m, dtype = _canonical_model(model), short_dtype(dtype)
    tail = f"\0{dtype}" if dtype and dtype != "fp32" else ""
    h = hashlib.sha1(f"{m}\0{draft}{tail}".encode()).hexdigest()[:10]
    name = f"{Path(m).name}__{Path(draft).name}" + (f"__{dtype}" if tail else "")
    slug = re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("_")[:100]
    return f"{slug}-{h}.json"


def policy_dir() -> Path:
    from specscope.models.hub import cache_dir

    return cache_dir() / "spec-policy"


def policy_path(model: str, draft: str, dtype: str | None = None) -> Path:
    """Where `tune --save-policy` (no path) writes and `--spec-policy auto` reads the table:
    $SPECSCOPE_CACHE/spec-policy/<model>__<drafter>-<hash>.json (cache default ~/.cache/specscope)."""
    return policy_dir() / policy_key(model, draft, dtype)


# ------------------------------------------------------------------------------------------------ priced, live

class RowCosts:
    """T(rows): the target forward's ms by its rows, learned from the engine's own steps (each step's verify phase
    is a sample). A batched forward's cost depends on its total rows, not on how they split into sequences (the
    kernels stream the weights once for all rows), so this one curve is the verify surface T(B, n) ~ T(B (1 + n)).
    Samples fall in half-octave bins, each a running mean of (rows, ms); between bins T is linear, past the last
    it keeps the last slope. `prices` (economics/prices.py, one sequence's curve up to 16 rows) seeds the bins
    until steps replace them."""

    def __init__(self, prices=None, ema: float = 0.1):
        self.ema = ema
        self.bins: dict[int, list[float]] = {}     # bin -> [mean rows, mean ms, samples]
        if prices is not None:
            for n, r in sorted(prices.verify_ratio.items()):
                self.add(n, r * prices.decode_ms)

    @staticmethod
    def _bin(rows: int) -> int:
        return round(2 * math.log2(max(rows, 1)))

    def add(self, rows: int, ms: float) -> None:
        b = self.bins.setdefault(self._bin(rows), [0.0, 0.0, 0])
        b[2] += 1
        a = max(self.ema, 1.0 / b[2])
        b[0] += a * (rows - b[0])
        b[1] += a * (ms - b[1])

    def __call__(self, rows: float) -> float | None:
        pts = sorted((r, ms) for r, ms, _ in self.bins.values())
        if not pts:
            return None
        if rows <= pts[0][0] or len(pts) == 1:
            return pts[0][1] if rows <= pts[0][0] else pts[0][1] * rows / pts[0][0]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:]):
            if rows <= n1:
                return t0 + (t1 - t0) * (rows - n0) / max(n1 - n0, 1e-9)
        (n0, t0), (n1, t1) = pts[-2], pts[-1]
        return t1 + max(0.0, (t1 - t0) / max(n1 - n0, 1e-9)) * (rows - n1)


class _Mean:
    """A running mean that starts as a prior worth `weight` samples, then follows about the last 1/ema."""

    def __init__(self, prior: float, weight: float = 2.0, ema: float = 0.1):
        self.value, self.n, self.ema = prior, weight, ema

    def add(self, x: float) -> None:
        self.n += 1
        self.value += max(self.ema, 1.0 / self.n) * (x - self.value)


# why a priced step drafted or not (serve's /metrics: spec_policy_decisions{decision, reason})
REASON_NO_COSTS = "no_costs_yet"          # draft: nothing measured yet to say otherwise
REASON_FASTER = "predicted_faster"        # draft: more tokens per ms predicted than plain at this batch size
REASON_PROBE = "probe"                    # draft although slower: keeps τ and the draft cost current
REASON_SLOWER = "predicted_slower"        # plain: drafting predicted to commit fewer tokens per ms


class PricedPolicy:
    """`--spec-policy priced` (serve's default): each step drafts or not by which is predicted to commit more
    tokens per ms at this batch size B, from the server's own steps:

        plain:       B tokens                 in  T(B)           + B * other_plain
        speculative: B * accept_length tokens in  T(B (1 + v))   + draft(B) + B * other_spec

    T is the live rows -> ms curve (RowCosts), v the verified draft nodes per sequence, accept_length (τ) the tokens
    a drafting sequence commits per step, draft(B) and the per-sequence accept / commit / bookkeeping times
    running means of the steps that had them (steps that also computed prompt rows are left out of all but T). On
    a 2-core CPU a step of 16 sequences x 7 rows costs several plain steps, so what pays at one request stops paying
    under load; a GPU's flat T keeps drafting. Live rather than from a table: the curve moves with the machine and
    τ with the traffic. While the prediction says plain, a drafting step is still taken now and then (every
    `probe` steps when the two are within 20 %, else every 8 x `probe`) so that τ and the draft cost stay current,
    and a request that joins where drafting does not pay gets no drafter (`attach`). Lossless whatever it
    chooses: a plain step is the drafters' catch-up, not another output."""

    def __init__(self, cfg, prices=None, probe: int = 64, ema: float = 0.1):
        self.cfg, self.probe = cfg, probe
        # prices measured under load would make every verify look dear and the policy never draft: the curve is
        # then learned from the server's own steps alone
        self.costs = RowCosts(prices if prices is not None and not prices.loaded else None, ema)
        one = prices.decode_ms if prices is not None else 10.0
        # priors worth two steps: a drafter that makes two tokens a step at a third of a decode step's drafting
        self.tau = _Mean(2.0, ema=ema)
        self.nodes = _Mean(float(cfg.verify_tokens), ema=ema)
        self.draft_ms = _Mean(one / 3, ema=ema)                      # per drafting sequence
        self.other_ms = {True: _Mean(0.0, 0.0, ema), False: _Mean(0.0, 0.0, ema)}   # per sequence, by mode
        self.since_draft = 0
        self.pending: bool | None = None
        self.steps = {True: 0, False: 0}
        self.last: tuple[str, str] | None = None     # (draft | plain, why): the latest call's decision

    def predict(self, batch: int) -> tuple[float, float] | None:
        """(plain, speculative) tokens per ms at this batch size, or None before any cost is known."""
        t_plain, t_spec = self.costs(batch), self.costs(batch * (1 + self.nodes.value))
        if t_plain is None:
            return None
        plain = batch / (t_plain + batch * self.other_ms[False].value)
        spec = batch * self.tau.value / (t_spec + batch * (self.draft_ms.value + self.other_ms[True].value))
        return plain, spec

    def attach(self, batch: int) -> bool:
        """Whether a request joining a batch of `batch` sequences gets a drafter (engine/batch.py): only where
        drafting is predicted to pay at that size. One that joins a loaded server decodes plain to its end -- its
        prompt reuses cached prefixes and no drafter state is kept per token -- so under load a drafter costs
        nothing; requests that arrive once the load has dropped draft again."""
        rates = self.predict(batch)
        return rates is None or rates[1] > rates[0]

    def __call__(self, batch: int):
        rates = self.predict(batch)
        draft = True if rates is None else rates[1] > rates[0]
        why = REASON_NO_COSTS if rates is None else REASON_FASTER
        if not draft:
            close = rates[1] > 0.8 * rates[0]
            draft = self.since_draft >= self.probe * (1 if close else 8)
            why = REASON_PROBE if draft else REASON_SLOWER
        self.pending = draft
        self.last = ("draft" if draft else "plain", why)
        return self.cfg if draft else None

    def why_plain(self, batch: int) -> str:
        """The prediction behind a plain step at this batch size, in words (serve's log line)."""
        rates = self.predict(batch)
        if rates is None:
            return "no cost measured yet"
        return (f"drafting predicted at {rates[1] * 1e3:.1f} tok/s against {rates[0] * 1e3:.1f} plain at batch "
                f"{batch} (τ {self.tau.value:.2f}, draft {self.draft_ms.value:.2f} ms/seq, verify of "
                f"{batch * (1 + self.nodes.value):.0f} rows {self.costs(batch * (1 + self.nodes.value)):.1f} ms)")

    def observe(self, rec) -> None:
        """One engine step (engine/batch.py StepRecord) after the call that chose its shape."""
        self.costs.add(rec.rows, rec.phases_ms.get("verify", 0.0))
        drafted = bool(rec.drafted)
        self.since_draft = 0 if drafted else self.since_draft + 1
        if self.pending is None or rec.prompt_rows or not rec.batch:
            return
        self.pending = None
        self.steps[drafted] += 1
        ph = rec.phases_ms
        self.other_ms[drafted].add((ph.get("accept", 0) + ph.get("commit", 0) + ph.get("other", 0)) / rec.batch)
        if drafted and rec.drafted == rec.batch:
            self.tau.add(rec.tokens / rec.batch)
            self.nodes.add((rec.rows - rec.batch) / rec.batch)
            self.draft_ms.add(ph.get("draft", 0.0) / rec.batch)
