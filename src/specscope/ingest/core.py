"""Stream a file through the format parsers and turn what they found into one registry run."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import sys
from pathlib import Path

from specscope.errors import SpecscopeError, require_file
from specscope.ingest.base import MAX_EXAMPLES, Malformed
from specscope.ingest.lines import split_records
from specscope.ingest.plugin_steps import StepsParser
from specscope.ingest.profile_lines import ProfileParser
from specscope.ingest.prometheus import PrometheusParser
from specscope.ingest.sglang import SGLangParser
from specscope.ingest.torch_trace import FORMAT as TORCH_TRACE, is_trace, scan_trace
from specscope.ingest.vllm import VLLMParser

# tried in this order on each line; the step records go first (JSON lines a log parser could take for config)
FORMATS = {"specscope-steps": StepsParser, "sglang": SGLangParser, "vllm": VLLMParser, "specscope": ProfileParser,
           "prometheus": PrometheusParser}
MAX_LINE = 1 << 20  # longer physical lines are skipped (counted as malformed) rather than held in memory


PROGRESS_EVERY = 1 << 16  # lines between progress callbacks


def iter_lines(path: Path, digest, nbytes: list, progress=None):
    """(line number, text or None if overlong, terminated) without loading the file; .gz is read transparently.

    progress(bytes of the file read so far) is called every PROGRESS_EVERY lines (compressed bytes for .gz).
    """
    if str(path) == "-":  # a pipe: `kubectl logs pod | specscope ingest -`
        f = contextlib.nullcontext(sys.stdin.buffer)
    else:
        f = (gzip.open if path.suffix == ".gz" else open)(path, "rb")
    with f as f:
        raw_f = getattr(f, "fileobj", None) or f   # a GzipFile's position is in uncompressed bytes
        n = 0
        while True:
            raw = f.readline(MAX_LINE)
            if not raw:
                return
            n += 1
            if progress is not None and n % PROGRESS_EVERY == 0:
                progress(raw_f.tell())
            digest.update(raw)
            nbytes[0] += len(raw)
            if len(raw) == MAX_LINE and not raw.endswith(b"\n"):
                while True:  # drain the rest of the overlong line
                    more = f.readline(MAX_LINE)
                    digest.update(more)
                    nbytes[0] += len(more)
                    if not more or more.endswith(b"\n"):
                        break
                yield n, None, True
                continue
            yield n, raw.decode("utf-8", errors="replace").rstrip("\r\n"), raw.endswith(b"\n")


def scan(path: Path, engine: str = "auto", progress=None) -> dict:
    """Parse a file; returns the parsers and the line accounting (no registry involved)."""
    if engine != "auto" and engine not in FORMATS:
        raise SpecscopeError(f"unknown engine {engine!r}; use one of auto, {', '.join(FORMATS)}, {TORCH_TRACE}")
    if str(path) != "-":
        require_file(path, "log file")
    parsers = [cls() for cls in FORMATS.values()] if engine == "auto" else [FORMATS[engine]()]
    acc = {"lines": 0, "recognised": {p.name: 0 for p in parsers}, "malformed": 0,
           "malformed_by_format": {p.name: 0 for p in parsers}, "other": 0, "malformed_examples": [],
           "unterminated_last_line": False, "overlong": 0}
    digest = hashlib.sha256()
    nbytes = [0]

    def bad(lineno, fmt, why, text):
        acc["malformed"] += 1
        if fmt:
            acc["malformed_by_format"][fmt] += 1
        if len(acc["malformed_examples"]) < MAX_EXAMPLES:
            acc["malformed_examples"].append({"line": lineno, "format": fmt, "reason": why,
                                              "text": (text or "")[:160]})

    try:
        for lineno, text, terminated in iter_lines(path, digest, nbytes, progress):
            acc["lines"] += 1
            acc["unterminated_last_line"] = not terminated
            if text is None:
                acc["overlong"] += 1
                bad(lineno, None, f"line longer than {MAX_LINE} bytes", "")
                continue
            for piece in split_records(text):
                for p in parsers:
                    try:
                        got = p.feed(piece, lineno)
                    except Malformed as e:
                        bad(lineno, p.name, str(e), piece)
                        break
                    if got:
                        acc["recognised"][p.name] += 1
                        break
                else:
                    acc["other"] += 1
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise SpecscopeError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    acc["sha256"] = digest.hexdigest()
    acc["bytes"] = nbytes[0]  # uncompressed
    acc["parsers"] = parsers
    return acc


def line_report(acc: dict, parsers, main) -> dict:
    """Per kind of line: read, used, skipped and partly used, each with why; plus malformed and other lines."""
    out = {}
    for p in parsers:
        for kind, r in p.line_report().items():
            if p is not main:
                used = r["used"]
                r = dict(r, used=0, skipped=dict(r["skipped"]))
                if used:
                    why = f"another format: this run holds the {main.name} data only"
                    r["skipped"][why] = r["skipped"].get(why, 0) + used
            out[f"{p.name} {kind}"] = r
    if acc["other"]:
        why = ("other trace events (cpu_op, ...): not used" if acc.get("unit") == "events"
               else "no format recognised it")
        out["other"] = {"read": acc["other"], "used": 0, "skipped": {why: acc["other"]}, "partial": {}}
    overlong = acc["overlong"]
    if overlong:
        out["overlong"] = {"read": overlong, "used": 0,
                           "skipped": {f"line longer than {MAX_LINE} bytes": overlong}, "partial": {}}
    return out


def ingest_file(path, engine: str = "auto", tags=(), name: str | None = None, record: bool = True,
                db=None, progress=None) -> dict:
    """Parse one file into a registry run (kind "ingest"); returns a summary with the run id.

    progress: called with the bytes read so far (for a progress bar on large files)."""
    path = Path(path)
    if str(path) != "-" and engine in ("auto", TORCH_TRACE):
        require_file(path, "trace file" if engine == TORCH_TRACE else "log file")
    if engine == TORCH_TRACE or (engine == "auto" and is_trace(path)):
        acc = scan_trace(path, progress)     # one JSON document, not lines: same accounting, units are events
    else:
        acc = scan(path, engine, progress)
    parsers = acc.pop("parsers")
    with_data = sorted((p for p in parsers if p.has_data()), key=lambda p: -p.data_lines)
    if not with_data:
        tried = "; ".join(f"{p.name}: {p.description}" for p in parsers)
        hint = ""
        if acc["malformed"]:
            ex = acc["malformed_examples"][0]
            hint = (f"; {acc['malformed']} line(s) looked like {ex['format'] or 'a record'} but did not parse "
                    f"(line {ex['line']}: {ex['reason']})")
        raise SpecscopeError(f"{path}: no recognisable line in {acc['lines']} line(s); formats tried: {tried}{hint}")
    main = with_data[0]
    out = main.result()
    warnings = list(out.get("warnings", []))
    for p in with_data[1:]:
        warnings.append(f"also found {p.data_lines} {p.name} line(s); this run holds the {main.name} data only")
    if acc["malformed"]:
        warnings.append(f"{acc['malformed']} malformed {'event' if acc.get('unit') == 'events' else 'line'}(s) "
                        "skipped (corrupt, truncated or interleaved)")
    ingest_info = {"format": main.name, "lines": acc["lines"], **({"unit": acc["unit"]} if "unit" in acc else {}),
                   "recognised": acc["recognised"],
                   "malformed": acc["malformed"], "malformed_by_format": acc["malformed_by_format"],
                   "other": acc["other"], "malformed_examples": acc["malformed_examples"],
                   "unterminated_last_line": acc["unterminated_last_line"],
                   "kinds": line_report(acc, parsers, main), "warnings": warnings}
    config = {k: v for k, v in out["config"].items() if v is not None}
    # where the numbers came from; kept out of config so `compare` does not list file names as causes
    source = {"file": "<stdin>" if str(path) == "-" else str(path.resolve()), "sha256": acc["sha256"],
              "bytes": acc["bytes"]}
    results = dict(out["results"], ingest=ingest_info)
    summary = {"file": str(path), "format": main.name, "engine": config.get("engine"), "run_id": None,
               "source": source, "config": config, "results": results}
    from specscope.registry import make_record

    env = {k: v for k, v in out.get("env", {}).items() if v is not None}
    env["ingested"] = True  # the engine ran elsewhere: this is not the local machine's fingerprint
    label = "stdin" if str(path) == "-" else path.name
    summary["record"] = make_record("ingest", name or f"{main.name} {label}", config=config, results=results,
                                    samples=out.get("samples", {}), tags=tags, env=env, source=source)
    if record:
        store_parsed(summary, db)
    return summary


def store_parsed(summary: dict, db=None) -> dict:
    """Store a parsed file's run (ingest_file(..., record=False) parses without storing: a command refused for one
    bad file of several stores none)."""
    from specscope.registry import store_record

    summary["run_id"] = store_record(summary["record"], db)
    return summary


def ingest_files(files, engine: str = "auto", tags=(), name: str | None = None, record: bool = True, db=None,
                 progress_for=None) -> tuple[list[dict], list[str]]:
    """Parse every file, then store their runs only if all parsed: (summaries without their record objects, error
    messages). A refused command changes nothing: no file's run is stored when any file failed, and the summaries
    are then [].

    progress_for(file) -> (a progress bar to enter while the file is read, or None; its update callback)."""
    if record:       # before streaming what may be gigabytes of logs, not after each file
        from specscope.registry import check_registry

        check_registry(db)
    done, failed = [], []
    for f in files:
        bar, update = progress_for(f) if progress_for is not None else (None, None)
        try:
            with bar if bar is not None else contextlib.nullcontext():
                done.append(ingest_file(f, engine=engine, tags=tags, name=name, record=False, progress=update))
        except SpecscopeError as e:
            failed.append(str(e))
    if failed:
        return [], failed
    for s in done:
        if record:
            store_parsed(s, db)
        del s["record"]         # the record object stays internal: the summary is what is shown
    return done, failed


def refusal(failed: list[str], n_files: int) -> str:
    """The one error of a command refused because files failed (ingest_files stored none)."""
    if n_files == 1:
        return failed[0]
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return (f"{len(failed)} of {n_files} files could not be ingested, so nothing was stored: "
            f"{failed[0]}{more}; fix or drop them and ingest again")
