"""What every outside-engine module (`engines/vllm.py`, `engines/sglang.py`) gives and takes: what a launch says
(`EngineArgs`), a speculative knob's flag and range (`Knob`), what a check of a launch against a drafter is given
(`DrafterFacts`) and finds (`Finding`), and the command-line and log-line readers the engines share.

Stdlib only: vLLM's own processes import this through specscope's plugin."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from specscope.errors import SpecscopeError

OK, WARN, FAIL = "ok", "warn", "fail"
# EAGLE-3 drafters are trained to draft a few positions ahead (training-time test: 7 steps here and in SpecForge);
# past twice that, acceptance is nil while every step still costs a drafter forward (and, as a chain, a verified
# token), so a deeper launch is a misconfiguration, not a tuning choice
MAX_USEFUL_STEPS = 16
# key=value of a Python repr, as engines log their config objects: SpeculativeConfig(method='eagle3', ...)
PY_ARG = re.compile(r"\b(\w+)=('(?:[^'\\]|\\.)*'|\"[^\"]*\"|[^,()\s]+)")


@dataclass(frozen=True)
class EngineArgs:
    """What an outside engine's launch (a command line, its flags alone, or its server-args log line) says about
    speculative decoding. `knobs`: the engine's own speculative settings by its names, in the order the check-drafter
    report lists them (an int, or the text as given when it is not one); `argv`: the arguments as split (none for a
    log line)."""
    engine: str
    source: str
    algorithm: str | None = None
    draft: str | None = None
    model: str | None = None
    dtype: str | None = None
    knobs: dict = field(default_factory=dict)
    argv: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """The check-drafter report's `engine` object (its JSON keys)."""
        return {"engine": self.engine, "source": self.source, "algorithm": self.algorithm, "draft": self.draft,
                **self.knobs, "model": self.model, "dtype": self.dtype}


@dataclass(frozen=True)
class Knob:
    """A speculative setting of a launch: its flag as the launch spells it, its least valid value, and whether it
    is how many positions ahead the drafter drafts (bounded by MAX_USEFUL_STEPS)."""
    flag: str
    least: int
    depth: bool = False


@dataclass(frozen=True)
class DrafterFacts:
    """What the checks of a launch need of the EAGLE-3 drafter (check-drafter reads them from its config)."""
    vocab_size: int
    draft_vocab_size: int
    has_token_map: bool                 # the checkpoint holds d2t
    layout: str | None                  # the checkpoint's layout: "sglang", "speculators", ...
    aux_layer_ids: tuple[int, ...]      # hidden-state indices (entering each layer)
    aux_convention_in_file: str         # "input" or "output" (SpecForge's output-of-layer ids)
    aux_ids_in_file: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Finding:
    """One named check of a launch: check-drafter reports it as is."""
    check: str
    status: str
    detail: str


def split_args(text: str | None) -> list[str]:
    """--engine-args as argv, or one line saying why it cannot be split."""
    try:
        return shlex.split(text or "")
    except ValueError as e:
        raise SpecscopeError(f"--engine-args {text!r} cannot be split into arguments ({e})") from None


def options(argv: list[str]) -> tuple[dict, list[str]]:
    """argv -> ({flag without dashes, '-' as '_': value ("true" for a bare flag)}, positional arguments)."""
    opts, pos, i = {}, [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
            key = key.replace("-", "_")
            if not eq:
                if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                    val, i = argv[i + 1], i + 1
                else:
                    val = "true"
            opts[key] = val
        else:
            pos.append(a)
        i += 1
    return opts, pos


def to_int(v):
    """An integer knob: int, None when absent, else the text as given (the knob checks report it)."""
    if v in (None, "None", ""):
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        return str(v)


def py_args(text: str) -> dict:
    """key=value pairs of a logged Python repr, quotes stripped."""
    return {k: v.strip("'\"") for k, v in PY_ARG.findall(text)}


def flag_value(argv: list[str] | tuple[str, ...], name: str) -> str | None:
    """The value of `name` in argv (`--flag V` or `--flag=V`), None when absent."""
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
