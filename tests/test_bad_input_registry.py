"""Bad input through the run registry (issue 53, item 7): damaged rows, files that are not registries, and records
holding NaN, through every command that reads runs.

Each registry is a real SQLite file written by `add_run` and then damaged with sqlite3 as a crash, a bad disk or a
careless hand would. A command addressing a damaged run by id gets one `error:` line naming the run, the file and
the fix (exit 2); `runs list` still lists the good runs and marks the damaged one; a file that is not a registry
is refused by name and left exactly as it was.
"""

from __future__ import annotations

import json
import math
import shutil
import sqlite3
import zlib

import pytest

from cli_util import cli, one_error_line
from specscope.registry import open_registry


def _record(name: str, **results) -> dict:
    return {"kind": "generate", "name": name, "tags": ["t"], "config": {"model": "/m/tiny"}, "env": {"host": "h"},
            "results": {"tok_per_s": 10.0, **results}, "samples": {"cycle_ms": {"verify": [1.0, 2.0, 3.0]}}}


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A registry of two runs: `good`, then `bad` (the newest), the one the damage goes to."""
    db = tmp_path_factory.mktemp("registry") / "runs.db"
    with open_registry(db) as reg:
        good = reg.add_run(_record("good"))
        bad = reg.add_run(_record("bad"))
    return {"db": db, "good": good, "bad": bad}


@pytest.fixture(autouse=True)
def _state(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))     # a crash report, if any, stays here
    monkeypatch.delenv("SPECSCOPE_DB", raising=False)


def _sql(db, *statements):
    conn = sqlite3.connect(db)
    for st in statements:
        conn.execute(st)
    conn.commit()
    conn.close()


DAMAGE = {       # kind -> the statements that do it, on the run `bad` (its id as {bad})
    "a record column that is not JSON": ["UPDATE runs SET config = '{\"model\": \"/m/tiny\", ' WHERE id = '{bad}'"],
    "a record column that is a JSON list": ["UPDATE runs SET results = '[1, 2]' WHERE id = '{bad}'"],
    "a record column stored as a blob": ["UPDATE runs SET env = X'00FF10' WHERE id = '{bad}'"],
    "samples that are not zlib": ["UPDATE samples SET data = X'0011223344556677' WHERE run_id = '{bad}'"],
    "samples that are zlib of garbage": [
        f"UPDATE samples SET data = X'{zlib.compress(b'not json').hex()}' WHERE run_id = '{{bad}}'"],
    "no runs table": ["PRAGMA foreign_keys = OFF", "DROP TABLE runs"],
}
COMMANDS = {     # name -> argv; {good} / {bad} / {out} filled in
    "runs show": ["runs", "show", "{bad}", "--samples", "--json"],
    "compare": ["compare", "{good}", "{bad}"],
    "report": ["report", "{bad}", "-o", "{out}"],
    "runs export": ["runs", "export", "{bad}", "--format", "json"],
    "runs list": ["runs", "list"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_registry_is_one_line_naming_the_run_and_file(stored, tmp_path, capsys, command, damage):
    db = tmp_path / "runs.db"
    shutil.copy(stored["db"], db)
    _sql(db, *[st.replace("{bad}", stored["bad"]) for st in DAMAGE[damage]])
    before = db.read_bytes()
    fill = {"good": stored["good"], "bad": stored["bad"], "out": str(tmp_path / "report.html")}
    argv = [a.format(**fill) for a in COMMANDS[command]] + ["--db", str(db)]
    code, out, err = cli(capsys, *argv)
    assert "internal error" not in err, err
    if damage == "no runs table":
        line = one_error_line(code, err)
        assert str(db) in line and "not a specscope registry" in line and "--db" in line, line
    elif command == "runs list":
        assert code == 0, err
        listed = out.splitlines()
        assert any(stored["good"] in ln and "(damaged)" not in ln for ln in listed), out
        assert any(stored["bad"] in ln and "(damaged)" in ln for ln in listed), out
        warnings = [ln for ln in err.splitlines() if ln.strip()]
        assert len(warnings) == 1 and warnings[0].startswith("warning: run " + stored["bad"]), err
        assert "runs delete " + stored["bad"] in warnings[0] and str(db) in warnings[0], err
    else:
        line = one_error_line(code, err)
        assert f"run {stored['bad']}" in line and str(db) in line and "damaged" in line, line
        assert f"runs delete {stored['bad']}" in line, line
    assert not (tmp_path / "report.html").exists()
    assert db.read_bytes() == before, "a reader changed the registry"


def test_runs_list_json_marks_the_damaged_run_and_keeps_the_good_one(stored, tmp_path, capsys):
    db = tmp_path / "runs.db"
    shutil.copy(stored["db"], db)
    _sql(db, f"UPDATE samples SET data = X'DEADBEEF' WHERE run_id = '{stored['bad']}'")
    code, out, err = cli(capsys, "runs", "list", "--json", "--db", db)
    assert code == 0, err
    rows = {r["id"]: r for r in json.loads(out)}
    assert set(rows) == {stored["good"], stored["bad"]}
    assert "damaged" not in rows[stored["good"]] and "samples" in rows[stored["bad"]]["damaged"]
    assert err.count("warning:") == 1
    # the good run still reads, and the fix the warning names works
    assert cli(capsys, "runs", "show", stored["good"], "--samples", "--json", "--db", db)[0] == 0
    assert cli(capsys, "runs", "delete", stored["bad"], "--db", db)[0] == 0
    code, out, err = cli(capsys, "runs", "list", "--json", "--db", db)
    assert code == 0 and [r["id"] for r in json.loads(out)] == [stored["good"]] and not err.strip(), err


def test_a_damaged_run_can_still_be_tagged(stored, tmp_path, capsys):
    db = tmp_path / "runs.db"
    shutil.copy(stored["db"], db)
    _sql(db, f"UPDATE runs SET extra = 'oops' WHERE id = '{stored['bad']}'")
    code, out, err = cli(capsys, "runs", "tag", stored["bad"], "broken", "--json", "--db", db)
    assert code == 0, err
    assert json.loads(out) == {"id": stored["bad"], "tags": ["broken", "t"]}
    code, out, err = cli(capsys, "runs", "list", "--tag", "broken", "--db", db)
    assert code == 0 and stored["bad"] in out and "(damaged)" in out and err.count("warning:") == 1, err


def _foreign_files(tmp_path) -> dict:
    """Other programs' SQLite files: one unversioned, one whose user_version happens to be ours (1), one holding
    a `runs` table of its own; and a file that is not SQLite at all."""
    files = {}
    for name, version, table in (("notes", 0, "notes (body TEXT)"), ("app", 1, "things (id INTEGER, v TEXT)"),
                                 ("tracker", 0, "runs (id TEXT, started TEXT)")):
        path = tmp_path / f"{name}.sqlite"
        _sql(path, f"CREATE TABLE {table}", f"PRAGMA user_version = {version}")
        files[name] = path
    files["garbage"] = tmp_path / "garbage.db"
    files["garbage"].write_bytes(b"not sqlite at all\n" * 64)
    return files


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_file_that_is_not_a_registry_is_refused_and_left_unchanged(tmp_path, capsys, command):
    for what, path in _foreign_files(tmp_path).items():
        before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        fill = {"good": "abcd1234", "bad": "last", "out": str(tmp_path / "report.html")}
        argv = [a.format(**fill) for a in COMMANDS[command]] + ["--db", str(path)]
        line = one_error_line(*cli(capsys, *argv)[::2])
        assert str(path) in line and "--db" in line, (what, line)
        after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
        assert after == before, f"reading {what} changed or added files"


def test_storing_into_another_programs_database_creates_no_table(tmp_path):
    from specscope.errors import SpecscopeError

    for what, path in _foreign_files(tmp_path).items():
        before = path.read_bytes()
        with pytest.raises(SpecscopeError, match=str(path)):
            open_registry(path).add_run(_record("x"))
        assert path.read_bytes() == before, what
    conn = sqlite3.connect(tmp_path / "notes.sqlite")
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["notes"]
    conn.close()


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))


def test_nan_in_a_record_is_null_in_every_json_output(tmp_path, capsys):
    db = tmp_path / "runs.db"
    with open_registry(db) as reg:
        good = reg.add_run(_record("good"))
        rid = reg.add_run(_record("nan", accept_length=math.nan, cycle_ms=math.inf,
                                  phases={"verify": {"mean_ms": -math.inf, "share": 0.5}}))
    code, out, err = cli(capsys, "runs", "show", rid, "--json", "--db", db)
    assert code == 0, err
    res = _strict(out)["results"]
    assert res["accept_length"] is None and res["cycle_ms"] is None and res["phases"]["verify"]["mean_ms"] is None
    assert res["tok_per_s"] == 10.0
    code, out, err = cli(capsys, "runs", "export", rid, good, "--format", "json", "--db", db)
    assert code == 0, err
    recs = _strict(out)
    assert recs[0]["results"]["accept_length"] is None and recs[1]["results"]["tok_per_s"] == 10.0
    code, out, err = cli(capsys, "runs", "export", rid, "-o", tmp_path / "x.json", "--db", db)
    assert code == 0, err
    assert _strict((tmp_path / "x.json").read_text())[0]["results"]["cycle_ms"] is None
    for argv in (["compare", good, rid, "--json"], ["runs", "list", "--json"]):
        code, out, err = cli(capsys, *argv, "--db", db)
        assert code == 0, err
        _strict(out)
