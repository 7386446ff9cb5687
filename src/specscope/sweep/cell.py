"""One cell of a sweep, one repeat: start the engine (plugin on), wait for /health, warm up, run the workload,
stop the engine, and store ONE run: the engine's per-phase steps (vLLM's plugin, or SGLang's log) joined with
the workload's numbers, carrying the cell's settings in config (flags) and env.vars (environment variables)."""

from __future__ import annotations

import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from specscope.benchserve.warmup import warm_up
from specscope.engines import vllm
from specscope.engines.builds import BuildFailed, ensure_env
from specscope.errors import SpecscopeError
from specscope.fileio import why, write_atomic
from specscope.serverproc import ServerFailed, ServerProcess, free_port, root_cause
from specscope.sweep.hostspeed import host_reference, reference_gbps
from specscope.sweep.placement import pinned, plan
from specscope.sweep.spec import Cell, SweepSpec
from specscope.sweep.workload import (Workload, WorkloadFailed, config_of, headline_level, levels_results, per_prompt,
                                     send, serve_results)

STEPS_FILE, LOG_FILE, MEASURED_STEPS = "steps.jsonl", "engine.log", "steps.measured.jsonl"
SETTLE_S = 1.0          # the plugin's step count must stay put this long after warm-up before it is read


@dataclass
class Context:
    """What every cell of one sweep invocation shares."""
    spec: SweepSpec
    workload: Workload
    workdir: Path
    sweep_id: str
    name: str
    db: str | None = None
    startup_s: float = 600.0
    workload_s: float = 1800.0
    stop_s: float = 30.0
    on_start: object = None          # on_start(pgid): the engine is up (the state file records its group)
    builds: dict = field(default_factory=dict)   # engine build -> its interpreter, or why it cannot be made

    def cell_dir(self, cell: Cell, repeat: int) -> Path:
        return cell_dir(self.spec, self.workdir, cell.key, repeat)


def cell_dir(spec: SweepSpec, workdir: Path, key: str, repeat: int) -> Path:
    """Where a (cell, repeat)'s engine log and steps are: WORKDIR/cells/NN-rR."""
    index = [c.key for c in spec.cells()].index(key)
    return Path(workdir) / "cells" / f"{index:02d}-r{repeat + 1}"


def engine_env(ctx: Context, cell: Cell, d: Path) -> dict:
    env = {**os.environ, **ctx.spec.env(cell)}
    if ctx.spec.resolved_phases() == "plugin":
        env["SPECSCOPE_PHASES"] = str(d / STEPS_FILE)        # specscope's vLLM plugin: every step's phases
    env.setdefault("PYTHONUNBUFFERED", "1")                  # the log's last lines are the engine's last words
    return env


def run_cell(ctx: Context, cell: Cell, repeat: int) -> dict:
    """{"status": "ok", "run_id", ...} or {"status": "failed", "reason", "log_tail", ...}. KeyboardInterrupt
    passes through, the engine stopped first."""
    d = ctx.cell_dir(cell, repeat)
    try:
        d.mkdir(parents=True, exist_ok=True)
        for stale in (STEPS_FILE, MEASURED_STEPS):      # a rerun of an interrupted cell starts clean
            (d / stale).unlink(missing_ok=True)
    except OSError as e:
        raise SpecscopeError(f"cannot write the cell's files in {d} ({why(e)})") from None
    python = _build_python(ctx, cell)
    if isinstance(python, BuildFailed):     # one line in the matrix; the sweep goes on with the other builds
        return {"status": "failed", "reason": str(python), "log_tail": "", "pgid": None, "seconds": 0.0,
                "command": None}
    port = free_port()
    argv = ctx.spec.argv(cell, port, python)
    place = plan(argv, ctx.spec.env(cell), ctx.spec.pin)
    # vLLM's leftovers are named by its prefix alone: nothing of another engine's is touched
    eng = ServerProcess(argv, {**engine_env(ctx, cell, d), **place.env}, d / LOG_FILE, f"http://127.0.0.1:{port}",
                        ctx.startup_s, ctx.stop_s, leftovers=vllm.shm_leftovers)
    t0 = time.monotonic()
    out = mark = warm = None
    cores = [c for g in place.compute for c in g]
    before = reference_gbps(cores)          # the host's speed on the compute cores, the engine not yet running
    try:
        with pinned(place):         # the engine inherits the client's cores; its compute threads bind to theirs
            eng.start()
            if ctx.on_start:
                ctx.on_start(eng.pgid)
            eng.wait_healthy()
            mark, warm = _warm_up(ctx, eng.url, d)
            out = _workload(ctx, eng.url, d)
        _some_succeeded(ctx, out, d)
    except (ServerFailed, WorkloadFailed) as e:
        return {"status": "failed", "reason": str(e), "log_tail": getattr(e, "log_tail", "") or eng.log_tail(),
                "pgid": eng.pgid, "seconds": round(time.monotonic() - t0, 1), "command": shlex.join(argv)}
    finally:
        died = eng.proc is not None and not eng.alive() and eng.exit_words()
        eng.stop()      # always, and before the steps are read: the plugin writes its last ones at shutdown
    after = reference_gbps(cores)
    write_atomic(d / "bench.json", json.dumps({k: out[k] for k in ("model", "levels")}, default=str, indent=1),
                 "the cell's bench.json")
    phases, warnings = read_phases(ctx, d, mark)
    if died:            # the workload's failed requests say what it cost; this says why
        warnings.append(f"the engine {died} during the workload; its last lines are in {d / LOG_FILE}")
    if warm is not None and not warm.steady:
        warnings.append(warm.words())
    rec = build_record(ctx, cell, repeat, out, phases, argv, warnings)
    rec["env"]["placement"] = place.to_dict()
    rec["env"]["host_reference"] = host_reference(before, after, cores)
    if warm is not None:
        rec["results"]["sweep_warmup"] = warm.to_dict()
    from specscope.registry import store_record

    run_id = store_record(rec, ctx.db)
    return {"status": "ok", "run_id": run_id, "pgid": eng.pgid, "seconds": round(time.monotonic() - t0, 1),
            "warnings": warnings}


def _workload(ctx: Context, url: str, d: Path) -> dict:
    """The measured requests; an engine gone before them (it died in the warm-up: nothing answers) is a workload
    whose every request failed, named by the engine's log as any other."""
    try:
        return send(ctx.workload, url, ctx.workload.requests, ctx.workload_s)
    except WorkloadFailed:
        raise
    except SpecscopeError as e:
        raise WorkloadFailed(f"no request succeeded ({len(ctx.workload.requests)} failed; first error: {e})"
                             + _engine_cause(d)) from None


def _some_succeeded(ctx: Context, out: dict, d: Path) -> None:
    """WorkloadFailed when a concurrency level had no request succeed (the engine died, or refuses them all)."""
    for c, level in zip(ctx.workload.levels, out["levels"]):
        if not level["completed"]:
            first = (level.get("error_examples") or ["none reported"])[0]
            at = f" at concurrency {c}" if len(out["levels"]) > 1 else ""
            raise WorkloadFailed(f"no request succeeded{at} ({level['failed']} failed; first error: {first})"
                                 + _engine_cause(d))


def _engine_cause(d: Path) -> str:
    """"; the engine's log: <its root-cause line>" where the engine logged an error: a failed request's answer says
    only "see the stack trace above" (vLLM's EngineDeadError), the log says why."""
    try:
        cause = root_cause((d / LOG_FILE).read_text(errors="replace").splitlines())
    except OSError:
        return ""
    return f"; the engine's log: {cause}" if cause else ""


def _build_python(ctx: Context, cell: Cell) -> str | BuildFailed | None:
    """The interpreter of the cell's engine build (its environment made on first use), or why it cannot be made
    (asked once per sweep invocation: a build that failed is not installed again for each of its cells)."""
    build = ctx.spec.build(cell)
    if build is None:
        return None
    if build not in ctx.builds:
        try:
            ctx.builds[build] = str(ensure_env(build).python)
        except BuildFailed as e:
            ctx.builds[build] = e
    return ctx.builds[build]


# ---- warm-up and the phases that follow it --------------------------------------------------------------------
def _warm_up(ctx: Context, url: str, d: Path):
    """Warm up (benchserve.warmup: at least --warmup requests, then until steady). Returns (where the measured
    part of the phase source starts -- plugin: the first step index after warm-up; log: the byte offset -- so the
    first, slow steps do not count; the WarmUp, None without warm-up)."""
    first = ctx.workload.requests[:1]
    warm = warm_up(lambda k: send(ctx.workload, url, first * k, ctx.workload_s, concurrency=1),
                   ctx.workload.spec["warmup"])
    source = ctx.spec.resolved_phases()
    if source == "plugin":
        return _settled_steps(d / STEPS_FILE), warm
    if source == "log":
        return (d / LOG_FILE).stat().st_size, warm
    return None, warm


def _step_count(path: Path) -> int:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return 0
    return sum(1 for ln in text.splitlines() if ln.startswith('{"i":'))


def _settled_steps(path: Path, limit_s: float = 10.0) -> int:
    """Steps the plugin wrote so far, once the count stops moving (on GPUs it writes a step when its CUDA events
    are read, a little after the step)."""
    last, since, t_end = _step_count(path), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < t_end:
        time.sleep(0.2)
        now = _step_count(path)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= SETTLE_S:
            break
    return last


def _measured_file(ctx: Context, d: Path, mark) -> Path | None:
    """The phase source without its warm-up part: the plugin's steps from index `mark` on (headers, env and totals
    kept), or the engine log from byte `mark` on (its server_args line kept: the engine's configuration)."""
    source = ctx.spec.resolved_phases()
    if source == "plugin":
        src = d / STEPS_FILE
        if not src.exists():
            return None
        keep = []
        for ln in src.read_text(errors="replace").splitlines():
            if ln.startswith('{"i":'):
                try:
                    if json.loads(ln)["i"] < (mark or 0):
                        continue
                except (ValueError, KeyError, TypeError):
                    pass            # a torn line: ingest counts it as malformed
            keep.append(ln)
        return write_atomic(d / MEASURED_STEPS, "\n".join(keep) + "\n", "the cell's measured steps")
    if source == "log":
        raw = (d / LOG_FILE).read_bytes()
        head = [ln for ln in raw[:mark or 0].decode(errors="replace").splitlines() if "server_args=" in ln]
        return write_atomic(d / "engine.measured.log", "\n".join(head) + "\n" + raw[mark or 0:].decode(
            errors="replace"), "the cell's measured log")
    return None


def read_phases(ctx: Context, d: Path, mark) -> tuple[dict | None, list[str]]:
    """(the parsed record of the phase source, warnings): ingest's own parsers, nothing stored."""
    path = _measured_file(ctx, d, mark)
    if path is None:
        source = ctx.spec.resolved_phases()
        why = {"plugin": f"the engine wrote no {STEPS_FILE} (is specscope installed in the engine's environment, "
                         f"and its vLLM version one the plugin supports? see {d / LOG_FILE})"}.get(source)
        return None, [why] if why else []
    from specscope.ingest.core import ingest_file

    try:
        s = ingest_file(path, record=False)
    except SpecscopeError as e:
        return None, [f"no per-phase timings: {e}"]
    return s["record"], list(s["results"].get("ingest", {}).get("warnings") or [])


# ---- the run ----------------------------------------------------------------------------------------------------
def build_record(ctx: Context, cell: Cell, repeat: int, out: dict, phases: dict | None, argv: list[str],
                 warnings: list[str]) -> dict:
    from specscope.registry import make_record
    from specscope.registry.fingerprint import collect

    level = headline_level(ctx.workload, out)
    config = config_of(ctx.workload, out)
    if phases is not None:
        config.update(phases["config"])
        results, samples, kind = dict(phases["results"]), dict(phases["samples"]), "ingest"
        # the engine ran here, under this sweep: its fingerprint (taken inside it) is this machine's
        env = {k: v for k, v in phases["env"].items() if k != "ingested"}
        if "schema" not in env:         # the engine stopped before its plugin wrote the fingerprint
            env = {**collect(), **env}
    else:
        results, samples, kind, env = {}, {}, "bench_serve", collect()
        config.update(model=out["model"], engine=(level.get("spec_decode") or {}).get("engine"))
    for a in ctx.spec.axes:
        if a.kind != "env" and a.name in dict(cell.values):
            config[a.config_key] = cell.get(a.name)     # what `compare --by config.KEY` reads
    env = dict(env, vars={**(env.get("vars") or {}), **ctx.spec.env(cell)})
    build = ctx.spec.build(cell)
    if build is not None:      # the fingerprint names the engine's release (the plugin's header says it too)
        env.update(engine=build.engine, engine_version=config.get("engine_version") or build.version,
                   engine_build=build.requirement)
    srv = serve_results(level)
    if results.get("accept_length") is None and srv["serve"].get("accept_length") is not None:
        results["accept_length"] = srv["serve"]["accept_length"]     # the server's own counters, for this run
    results.update(srv)
    if len(out["levels"]) > 1:
        results["serve_levels"] = levels_results(ctx.workload, out)
    pp = per_prompt(out, ctx.workload.headline if len(out["levels"]) > 1 else None)
    if pp:
        samples["per_prompt"] = pp
    if warnings:
        results["sweep_warnings"] = warnings
    sweep = {"id": ctx.sweep_id, "name": ctx.name, "cell": cell.key, "repeat": repeat, "baseline": cell.baseline,
             "command": shlex.join(argv), "env": ctx.spec.env(cell), "phases": ctx.spec.resolved_phases()}
    rec = make_record(kind, f"sweep {ctx.name}: {cell.key} #{repeat + 1}", config=config, results=results,
                      samples=samples, tags=["sweep", f"sweep:{ctx.name}"], env=env, sweep=sweep)
    if phases is None:
        rec["config"].pop("model_hash", None)      # a served name, not a local checkpoint
    return rec
