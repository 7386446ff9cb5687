"""Outside serving engines specscope launches, reads and checks (vLLM, SGLang): everything specscope knows about
one of them lives in its module here (`vllm.py`, `sglang.py`), behind the contract of `base.py`. Not to be confused
with `specscope.engine`, specscope's own decoding loop.

A module gives: NAME, TITLE, EXAMPLE and START (how its launch is recognised and named), PHASES_FROM (where a
sweep's per-phase timings come from), KNOBS and DRAFT_FLAG (the speculative flags check-drafter checks),
`from_log` / `claims` / `from_command` (its log line and command line -> `EngineArgs`) and `launch_checks` (a launch
against an EAGLE-3 drafter -> `Finding`s); optionally CPU_BIND_ENV and `cpu_bind` (how its CPU build binds each rank's
compute threads: a sweep's placement, sweep/placement.py). Adding an engine is one module and one entry in OUTSIDE_ENGINES."""

from __future__ import annotations

from types import ModuleType

from specscope.engines import sglang, vllm
from specscope.engines.base import EngineArgs, options, split_args
from specscope.errors import SpecscopeError

# asked in this order when a command line or log line could be either's
OUTSIDE_ENGINES: dict[str, ModuleType] = {sglang.NAME: sglang, vllm.NAME: vllm}


def outside_engine(name: str) -> ModuleType:
    """The module of the outside engine called `name` ("vllm", "sglang")."""
    try:
        return OUTSIDE_ENGINES[name]
    except KeyError:
        raise SpecscopeError(f"unknown engine {name!r}; specscope knows {', '.join(OUTSIDE_ENGINES)}") from None


def named_in(text: str) -> ModuleType | None:
    """The outside engine whose name a launch command holds (anywhere, any case), None when none does."""
    text = text.lower()
    return next((e for e in OUTSIDE_ENGINES.values() if e.NAME in text), None)


def parse_engine_args(text: str) -> EngineArgs:
    """An outside engine's launch command line, or its server-args log line (SGLang's `server_args=ServerArgs(...)`,
    vLLM's `non-default args:` or `speculative_config=SpeculativeConfig(...)`) -> the speculative settings it names."""
    text = text.strip()
    if not text:
        raise SpecscopeError("--engine-args is empty; pass the engine's launch command line or its server-args "
                             "log line")
    for e in OUTSIDE_ENGINES.values():
        got = e.from_log(text)
        if got is not None:
            return got
    argv = split_args(text)
    opts, pos = options(argv)
    joined = " ".join(argv[:3])
    for e in OUTSIDE_ENGINES.values():
        if e.NAME in joined or e.claims(opts):
            return e.from_command(argv, opts, pos)
    known = " nor ".join(f"{e.TITLE} ({e.EXAMPLE})" for e in OUTSIDE_ENGINES.values())
    raise SpecscopeError(f"--engine-args names neither {known}")
