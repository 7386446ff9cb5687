"""The run registry: one SQLite file of run records.

Durability: WAL journal, every write in one `BEGIN IMMEDIATE` transaction (a process killed mid-write leaves the
previous state; readers never see half a run), `synchronous=NORMAL` (safe against process crashes; only a power loss
can drop the last commits, never corrupt), and a busy timeout so several processes can write at once.

Schema versions live in `PRAGMA user_version`; `MIGRATIONS[i]` takes a database from version i to i+1, each in its
own transaction. A database newer than this code is refused rather than guessed at.

Reading never trusts the file: an SQLite file without our tables is refused before anything is written to it (no
journal switch, no migration, no table created), and every stored run is read back through one validating reader
(`_record`): a row whose JSON columns or samples do not decode is a `DamagedRun` naming the run and the fix, and
`list_runs` marks such rows instead of failing on them.
"""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import stat
import time
import uuid
import zlib
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from specscope import jsonio
from specscope.errors import SpecscopeError
from specscope.fileio import check_writable

CORE_KEYS = ("kind", "name", "tags", "config", "env", "results", "samples")

MIGRATIONS = [
    # v1: runs and their tags
    """
    CREATE TABLE runs (
        id TEXT PRIMARY KEY,
        created_at TEXT NOT NULL,
        kind TEXT NOT NULL,
        name TEXT NOT NULL DEFAULT '',
        config TEXT NOT NULL,
        env TEXT NOT NULL,
        results TEXT NOT NULL,
        samples TEXT NOT NULL,
        extra TEXT NOT NULL
    );
    CREATE TABLE tags (
        run_id TEXT NOT NULL REFERENCES runs(id) ON DELETE CASCADE,
        tag TEXT NOT NULL,
        PRIMARY KEY (run_id, tag)
    );
    """,
    # v2: per-cycle samples move to their own compressed table (they dwarf the rest); list columns denormalised
    """
    CREATE TABLE samples (
        run_id TEXT PRIMARY KEY REFERENCES runs(id) ON DELETE CASCADE,
        data BLOB NOT NULL
    );
    INSERT INTO samples (run_id, data) SELECT id, samples FROM runs;
    ALTER TABLE runs ADD COLUMN model TEXT;
    ALTER TABLE runs ADD COLUMN tok_per_s REAL;
    ALTER TABLE runs ADD COLUMN accept_length REAL;
    UPDATE runs SET model = json_extract(config, '$.model'),
                    tok_per_s = json_extract(results, '$.tok_per_s'),
                    accept_length = json_extract(results, '$.accept_length');
    ALTER TABLE runs DROP COLUMN samples;
    CREATE INDEX runs_created ON runs(created_at);
    CREATE INDEX runs_kind ON runs(kind);
    CREATE INDEX tags_tag ON tags(tag);
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)

# the columns each schema version's readers and writers use: a file lacking them is not (or no longer) a registry
_V1_RUNS = {"id", "created_at", "kind", "name", "config", "env", "results", "extra"}
SCHEMA_TABLES = {
    1: {"runs": _V1_RUNS | {"samples"}, "tags": {"run_id", "tag"}},
    2: {"runs": _V1_RUNS | {"model", "tok_per_s", "accept_length"}, "tags": {"run_id", "tag"},
        "samples": {"run_id", "data"}},
}
JSON_COLUMNS = ("config", "env", "results", "extra")
_RUN_ROW = "SELECT id, created_at, kind, name, config, env, results, extra FROM runs WHERE id = ?"
# 1 where SQLite itself finds a row whole (text columns, JSON objects): list_runs parses only the others, in Python
# (which also reads the NaN that json_valid refuses). CASE keeps json_valid from seeing a blob, which it rejects.
_LOOKS_WHOLE = "(" + " AND ".join(
    [f"typeof({c}) = 'text'" for c in ("created_at", "kind", "name")]
    + [f"CASE WHEN typeof({c}) <> 'text' THEN 0 WHEN json_valid({c}) THEN json_type({c}) = 'object' ELSE 0 END"
       for c in JSON_COLUMNS]) + ")"

SQLITE_INT_MAX = 2**63 - 1


def default_db_path() -> Path:
    env = os.environ.get("SPECSCOPE_DB")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "specscope" / "runs.db"


def _dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), default=str)


def _pack(samples: dict) -> bytes:
    return zlib.compress(_dumps(samples).encode(), 6)


class DamagedRun(SpecscopeError):
    """A stored run whose row does not read back (a column that is not JSON, samples that do not decompress)."""

    def __init__(self, run_id: str, path: Path, reason: str):
        self.run_id, self.reason = run_id, reason
        super().__init__(f"run {run_id} in the registry {path} is damaged: {reason}; {damage_fix(run_id, path)}")


def damage_fix(run_id: str, path: Path) -> str:
    return (f"delete it with `specscope runs delete {run_id} --db {shlex.quote(str(path))}` or restore the registry "
            f"from a backup")


class _Damage(Exception):
    """What is wrong with one row; the Registry turns it into a DamagedRun naming the run and the file."""


def _json_column(value, what: str) -> dict:
    if not isinstance(value, (str, bytes)):
        raise _Damage(f"its {what} is stored as {type(value).__name__}, not JSON text")
    try:
        obj = jsonio.loads(value, f"its {what}")
    except SpecscopeError as e:
        raise _Damage(str(e)) from None
    if not isinstance(obj, dict):
        raise _Damage(f"its {what} is a JSON {type(obj).__name__}, not an object")
    return obj


def _unpack(blob) -> dict:
    if isinstance(blob, str):           # a v1 row carried over by the migration: plain JSON text
        return _json_column(blob, "samples")
    if not isinstance(blob, bytes):
        raise _Damage(f"its samples are stored as {type(blob).__name__}, not compressed data")
    try:
        text = zlib.decompress(blob)
    except zlib.error as e:
        raise _Damage(f"its samples are not zlib-compressed data ({e})") from None
    return _json_column(text, "samples")


def _samples_start_damage(head) -> str | None:
    """What is wrong with the first bytes of a samples value (`list_runs` does not decompress every run's
    samples): they must start what `_pack` or a v1 row wrote, a JSON object, zlib-compressed or not."""
    if head is None:        # no samples row: read as {}
        return None
    if isinstance(head, str):
        return None if head.lstrip().startswith("{") else "its samples are not a JSON object"
    try:
        start = zlib.decompressobj().decompress(head, 16) if isinstance(head, bytes) else b""
    except zlib.error:
        return "its samples are not zlib-compressed data"
    return None if start.lstrip().startswith(b"{") else "its samples do not decompress to a JSON object"


def _record(row, tags: list[str], samples_blob=None, samples: bool = False) -> dict:
    """A run record from its `runs` row (id, created_at, kind, name, config, env, results, extra): the one reader
    of stored rows. Raises _Damage."""
    for what, v in zip(("created_at", "kind", "name"), row[1:4]):
        if not isinstance(v, str):
            raise _Damage(f"its {what} is stored as {type(v).__name__}, not text")
    cols = {c: _json_column(v, f"{c} column") for c, v in zip(JSON_COLUMNS, row[4:8])}
    rec = {"id": row[0], "created_at": row[1], "kind": row[2], "name": row[3], "tags": tags,
           "config": cols["config"], "env": cols["env"], "results": cols["results"]}
    if samples:
        rec["samples"] = {} if samples_blob is None else _unpack(samples_blob)
    for k, v in cols["extra"].items():
        rec.setdefault(k, v)
    return rec


def normalize_record(record: dict) -> dict:
    """Check a record's shape; fill defaults. Unknown top-level keys are kept."""
    if not isinstance(record, dict):
        raise SpecscopeError(f"a run record must be a dict, got {type(record).__name__}")
    kind = record.get("kind")
    if not isinstance(kind, str) or not kind:
        raise SpecscopeError("a run record needs a non-empty string 'kind' (e.g. 'generate', 'bench')")
    rec = dict(record)
    rec["name"] = str(rec.get("name") or "")
    tags = rec.get("tags") or []
    if isinstance(tags, str) or not all(_good_tag(t) for t in tags):
        raise SpecscopeError("a run record's 'tags' must be a list of non-empty one-line strings")
    rec["tags"] = sorted(set(tags))
    for key in ("config", "env", "results", "samples"):
        v = rec.get(key)
        if v is None:
            rec[key] = {}
        elif not isinstance(v, dict):
            raise SpecscopeError(f"a run record's {key!r} must be a dict, got {type(v).__name__}")
    return rec


def _good_tag(t) -> bool:
    return isinstance(t, str) and bool(t.strip()) and t.isprintable()


def _retry_locked(fn, timeout: float):
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            return fn()
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
        except SpecscopeError as e:  # _write's wrapping of a lock timeout
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


class Registry:
    def __init__(self, path: Path, timeout: float = 60.0, create: bool = True):
        self.path = Path(path)
        _check_registry_path(self.path, create)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(str(self.path), timeout=timeout, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise SpecscopeError(f"cannot open the run registry at {self.path}: {e}; "
                                 f"set --db or SPECSCOPE_DB to a writable path") from None
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
            self._check_schema(create)      # before the first write: another program's file stays as it was
            # switching a new file to WAL can answer SQLITE_BUSY at once, without waiting on the busy handler,
            # while another process is creating or switching the same file: retry until the timeout instead
            _retry_locked(lambda: self._conn.execute("PRAGMA journal_mode = WAL"), timeout)
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._conn.execute("PRAGMA foreign_keys = ON")
            _retry_locked(self._migrate, timeout)
        except sqlite3.DatabaseError as e:
            self._conn.close()
            raise SpecscopeError(f"{self.path} is not a usable specscope registry ({e}); "
                                 f"point --db / SPECSCOPE_DB elsewhere") from None
        except SpecscopeError:
            self._conn.close()
            raise

    def _check_schema(self, create: bool) -> None:
        """Refuse, before anything is written, a file that is not a registry at a version we know: another
        program's database (or an empty one, to a reader), a registry that lost a table, one newer than us."""
        self._conn.execute("BEGIN")      # one snapshot: another process may be creating this registry right now
        try:
            v = self.schema_version()
            tables = {name: {c[1] for c in self._conn.execute(f"PRAGMA table_info({json.dumps(name)})")}
                      for (name,) in self._conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
        if v == 0 and not tables and create:
            return          # a new database: the migrations make it a registry
        if v > SCHEMA_VERSION:
            raise SpecscopeError(f"the registry {self.path} has schema version {v}, newer than this specscope "
                                 f"understands ({SCHEMA_VERSION}); upgrade specscope, or point --db / SPECSCOPE_DB "
                                 f"at a specscope registry if this is another program's database")
        if v == 0:
            missing = ["a specscope schema version" if "runs" in tables else "a runs table"]
        else:
            missing = [f"a {t} table" if t not in tables else f"the {t} columns {', '.join(sorted(cols - tables[t]))}"
                       for t, cols in SCHEMA_TABLES[v].items() if t not in tables or cols - tables[t]]
        if missing:
            raise SpecscopeError(f"{self.path} is an SQLite file but not a specscope registry of runs (it lacks "
                                 f"{'; '.join(missing)}); point --db / SPECSCOPE_DB at a registry, or restore this "
                                 f"one from a backup")

    # ---- plumbing -------------------------------------------------------------------------------------------
    def close(self):
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @contextmanager
    def _write(self):
        """One write transaction; the write lock is taken up front so concurrent writers queue, not deadlock."""
        try:
            self._conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:       # locked past the timeout, read-only file, disk full
            raise SpecscopeError(f"cannot write to the run registry {self.path}: {e}") from None
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException as e:
            if self._conn.in_transaction:
                self._conn.execute("ROLLBACK")
            if isinstance(e, sqlite3.OperationalError):
                raise SpecscopeError(f"cannot write to the run registry {self.path}: {e}") from None
            raise

    def schema_version(self) -> int:
        return self._conn.execute("PRAGMA user_version").fetchone()[0]

    def _migrate(self, target: int = SCHEMA_VERSION):
        if self.schema_version() == target:
            return          # the common case: no write lock just to open
        while True:
            with self._write() as c:
                v = c.execute("PRAGMA user_version").fetchone()[0]
                if v >= target:
                    return
                for stmt in MIGRATIONS[v].split(";"):
                    if stmt.strip():
                        c.execute(stmt)
                c.execute(f"PRAGMA user_version = {v + 1}")

    # ---- writes ---------------------------------------------------------------------------------------------
    def add_run(self, record: dict) -> str:
        """Store a record atomically; return its new id."""
        rec = normalize_record(record)
        created = rec.pop("created_at", None) or datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        rec.pop("id", None)
        extra = {k: v for k, v in rec.items() if k not in CORE_KEYS}
        for _ in range(5):
            run_id = uuid.uuid4().hex[:10]
            try:
                with self._write() as c:
                    self._insert(c, run_id, created, rec, extra)
                return run_id
            except sqlite3.IntegrityError:
                continue        # id collision: draw another
        raise SpecscopeError("could not allocate a unique run id")   # pragma: no cover - 1 in 2^40 five times

    def _insert(self, c, run_id, created, rec, extra):
        res = rec["results"]
        c.execute("INSERT INTO runs (id, created_at, kind, name, config, env, results, extra, model, tok_per_s, "
                  "accept_length) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                  (run_id, created, rec["kind"], rec["name"], _dumps(rec["config"]), _dumps(rec["env"]),
                   _dumps(res), _dumps(extra), _s(rec["config"].get("model")), _f(res.get("tok_per_s")),
                   _f(res.get("accept_length"))))
        c.executemany("INSERT INTO tags (run_id, tag) VALUES (?, ?)", [(run_id, t) for t in rec["tags"]])
        c.execute("INSERT INTO samples (run_id, data) VALUES (?, ?)", (run_id, _pack(rec["samples"])))

    def tag(self, run_id: str, tag: str, remove: bool = False) -> str:
        if not _good_tag(tag):
            raise SpecscopeError(f"bad tag {tag!r}: use a non-empty one-line string")
        rid = self.resolve(run_id)
        with self._write() as c:
            if remove:
                c.execute("DELETE FROM tags WHERE run_id = ? AND tag = ?", (rid, tag))
            else:
                c.execute("INSERT OR IGNORE INTO tags (run_id, tag) VALUES (?, ?)", (rid, tag))
        return rid

    def delete_run(self, run_id: str) -> str:
        rid = self.resolve(run_id)
        with self._write() as c:
            c.execute("DELETE FROM runs WHERE id = ?", (rid,))
        return rid

    # ---- reads ----------------------------------------------------------------------------------------------
    def resolve(self, ref: str) -> str:
        """A run id from an id, a unique id prefix (4+ characters), `last` or `last~N` (N runs before the last)."""
        with self._reading():
            return self._resolve(str(ref).strip())

    def _resolve(self, ref: str) -> str:
        if ref == "last" or ref.startswith("last~"):
            n = ref[5:] or "0"
            if not n.isdigit():
                raise SpecscopeError(f"bad run reference {ref!r}; use last or last~N")
            row = self._conn.execute("SELECT id FROM runs ORDER BY created_at DESC, rowid DESC LIMIT 1 OFFSET ?",
                                     (min(int(n), SQLITE_INT_MAX),)).fetchone()
            if row is None:
                raise SpecscopeError(f"no run {ref!r}: the registry {self.path} has fewer runs")
            return row[0]
        if len(ref) < 4:
            raise SpecscopeError(f"run id {ref!r} is too short; give at least 4 characters")
        rows = self._conn.execute("SELECT id FROM runs WHERE id >= ? AND id < ? LIMIT 2",
                                  (ref, ref + "\uffff")).fetchall()
        if not rows:
            raise SpecscopeError(f"no run {ref!r} in {self.path}; see `specscope runs list`")
        if len(rows) > 1:
            raise SpecscopeError(f"run id prefix {ref!r} is ambiguous; give more characters")
        return rows[0][0]

    def get_run(self, run_id: str, samples: bool = True) -> dict:
        rid = self.resolve(run_id)
        with self._reading():
            row = self._conn.execute(_RUN_ROW, (rid,)).fetchone()
            if row is None:     # deleted by another process since resolve()
                raise SpecscopeError(f"no run {run_id!r} in {self.path}; see `specscope runs list`")
            tags = self._tags(rid)
            blob = None
            if samples:
                s = self._conn.execute("SELECT data FROM samples WHERE run_id = ?", (rid,)).fetchone()
                blob = s[0] if s else None
        try:
            return _record(row, tags, blob, samples)
        except _Damage as e:
            raise DamagedRun(rid, self.path, str(e)) from None

    def tags_of(self, run_id: str) -> list[str]:
        """A run's tags, sorted: readable even where the rest of its row is damaged."""
        rid = self.resolve(run_id)
        with self._reading():
            return self._tags(rid)

    def _tags(self, rid: str) -> list[str]:
        return [r[0] for r in self._conn.execute("SELECT tag FROM tags WHERE run_id = ? ORDER BY tag", (rid,))]

    def list_runs(self, kind: str | None = None, tag: str | None = None, name: str | None = None,
                  model: str | None = None, limit: int | None = None) -> list[dict]:
        """Newest first: {id, created_at, kind, name, tags, model, tok_per_s, accept_length}, and `damaged` (what
        is wrong) on a run `get_run` would refuse: its columns are checked, its samples only by their first bytes."""
        where, args = [], []
        if kind:
            where.append("kind = ?")
            args.append(kind)
        if name:
            where.append("name LIKE ?")
            args.append(f"%{name}%")
        if model:
            where.append("model LIKE ?")
            args.append(f"%{model}%")
        if tag:
            where.append("id IN (SELECT run_id FROM tags WHERE tag = ?)")
            args.append(tag)
        sql = ("SELECT id, created_at, kind, name, model, tok_per_s, accept_length, "
               "(SELECT group_concat(tag, char(10)) FROM (SELECT tag FROM tags WHERE run_id = runs.id ORDER BY tag)), "
               f"{_LOOKS_WHOLE}, (SELECT substr(data, 1, 64) FROM samples WHERE run_id = runs.id) FROM runs")
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY created_at DESC, rowid DESC"
        if limit:
            sql += f" LIMIT {min(int(limit), SQLITE_INT_MAX)}"  # SQLite integers are signed 64-bit
        out = []
        with self._reading():
            for r in self._conn.execute(sql, args).fetchall():
                item = {"id": r[0], "created_at": r[1], "kind": r[2], "name": r[3],
                        "tags": r[7].split("\n") if r[7] else [],
                        "model": r[4], "tok_per_s": r[5], "accept_length": r[6]}
                damage = None if r[8] else self._damage(r[0])   # SQL vouched for the common row; Python decides
                damage = damage or _samples_start_damage(r[9])
                if damage:
                    item["damaged"] = damage
                out.append(item)
        return out

    def _damage(self, rid: str) -> str | None:
        try:
            _record(self._conn.execute(_RUN_ROW, (rid,)).fetchone(), [])
        except _Damage as e:
            return str(e)
        return None

    @contextmanager
    def _reading(self):
        """SQLite's read errors (a page that does not decode, a table gone) as one line naming the file."""
        try:
            yield
        except sqlite3.DatabaseError as e:
            raise SpecscopeError(f"cannot read the run registry {self.path} ({e}); restore it from a backup, or "
                                 f"point --db / SPECSCOPE_DB at another registry") from None

    def count(self) -> int:
        with self._reading():
            return self._conn.execute("SELECT COUNT(*) FROM runs").fetchone()[0]

    def journal_mode(self) -> str:
        return self._conn.execute("PRAGMA journal_mode").fetchone()[0]

    def integrity_check(self) -> str:
        return self._conn.execute("PRAGMA integrity_check").fetchone()[0]


def _f(v):
    try:
        return float(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def _s(v):
    return None if v is None else str(v)


def _check_registry_path(path: Path, create: bool) -> None:
    """What SQLite would only say late or vaguely: a directory, a device or a FIFO is not a registry, and a reader
    must not create an empty one where it was pointed at nothing."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if not create:
            raise SpecscopeError(f"no run registry at {path} (nothing has been stored there); point --db / "
                                 f"SPECSCOPE_DB at an existing one") from None
        return
    except OSError as e:
        raise SpecscopeError(f"cannot open the run registry at {path} ({e.strerror or e}); set --db or "
                             f"SPECSCOPE_DB to a writable path") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise SpecscopeError(f"the run registry {path} is {what}; point --db / SPECSCOPE_DB at a registry file")
    if not create and st.st_size == 0:      # SQLite would take it as a new database and a reader would create one
        raise SpecscopeError(f"the run registry {path} is an empty file (nothing has been stored there); point "
                             f"--db / SPECSCOPE_DB at an existing one")


def open_registry(db_path=None, timeout: float = 60.0, create: bool = True) -> Registry:
    """The registry at `db_path`, else $SPECSCOPE_DB, else $XDG_DATA_HOME/specscope/runs.db. `timeout`: seconds
    to wait for another writer's lock. `create=False` (commands that only read) refuses a missing file instead of
    leaving an empty registry behind."""
    return Registry(registry_path(db_path), timeout, create)


def registry_path(db_path=None) -> Path:
    """--db as given, else $SPECSCOPE_DB, else the default location."""
    return Path(db_path).expanduser() if db_path else default_db_path()


def check_registry(db_path=None) -> Path:
    """Before a command's work: the registry it will store runs in opens (an existing file is a usable registry;
    a new one could be created). Creates nothing; returns the path."""
    path = registry_path(db_path)
    if path.exists() or path.is_symlink():
        open_registry(path, create=False).close()
    else:
        check_writable(path, "--db")
    return path
