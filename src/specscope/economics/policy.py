"""Which draft shape (or none) a batched step uses at a given batch size: `serve --spec-policy`.

'always' and 'off' need nothing; 'auto' and a JSON path read a table that `specscope tune --save-policy` writes:
the best predicted shape per concurrency level and the crossover concurrency past which plain decoding is faster.
`auto` looks the table up under the cache directory, keyed by the model, the drafter and the dtype (`policy_path`):
a bf16 step costs half an fp32 one while drafting does not, so their crossovers differ.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

from specscope.errors import SpecscopeError
from specscope.jsonio import short_dtype

POLICIES = ("always", "off", "auto")
TABLE_KIND = "spec_policy"
TABLE_VERSION = 1


def spec_policy(value: str, cfg, *, model: str | None = None, draft: str | None = None,
                dtype: str | None = None) -> Callable[[int], object]:
    """`--spec-policy` -> policy(batch_size) -> SpecConfig or None (a plain step). 'always': the drafter's
    shape at every batch size; 'off': never speculate (the drafter still loads, for comparison runs); 'auto': the
    table `tune --save-policy` stored for this model, drafter and dtype (`model`, `draft`, `dtype` name them; see
    policy_path); any
    other value: the path of such a table. A table's shapes must fit within `cfg`, the shape the engine sized its
    regions and drafter caches for (`envelope(table)` is the smallest that does)."""
    dtype = short_dtype(dtype)
    if value == "always":
        return lambda n: cfg
    if value == "off":
        return lambda n: None
    if value == "auto":
        if not model or not draft:
            raise SpecscopeError("--spec-policy auto looks the table up by model and drafter, which were not given; "
                                 "pass the table's path instead (`specscope tune --save-policy PATH`)")
        path = policy_path(model, draft, dtype)
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
