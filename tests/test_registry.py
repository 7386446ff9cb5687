"""Run registry: records round-trip, references, tags, deletion, schema migration, fingerprints, record helper."""

import json
import os
import sqlite3

import pytest

from specscope.errors import SpecscopeError
from specscope.profile import CycleProfiler
from specscope.registry import default_db_path, make_record, model_hash, open_registry, prompt_set_hash
from specscope.registry.db import MIGRATIONS, SCHEMA_VERSION
from specscope.registry.fingerprint import ENV_PREFIXES, GPU_FIELDS, collect, flatten


def _rec(**kw):
    base = {"kind": "bench", "name": "n", "tags": ["b", "a"], "config": {"model": "/m", "steps": 3},
            "env": {"vars": {"NCCL_PROTO": "LL"}}, "results": {"tok_per_s": 12.5, "accept_length": 2.5},
            "samples": {"cycle_ms": {"verify": [1.0, 2.0]}, "accept_lengths": [2, 3]}}
    base.update(kw)
    return base


def test_default_path_follows_env(monkeypatch, tmp_path):
    assert default_db_path() == tmp_path / "runs.db"          # conftest sets SPECSCOPE_DB
    monkeypatch.delenv("SPECSCOPE_DB")
    assert default_db_path() == tmp_path / "xdg-data" / "specscope" / "runs.db"
    with open_registry() as reg:
        reg.add_run(_rec())
    assert (tmp_path / "xdg-data" / "specscope" / "runs.db").exists()


def test_round_trip_keeps_everything_and_unknown_keys():
    with open_registry() as reg:
        rid = reg.add_run(_rec(custom={"x": [1, 2]}))
        got = reg.get_run(rid)
        assert got["id"] == rid and got["kind"] == "bench" and got["tags"] == ["a", "b"]
        assert got["config"] == {"model": "/m", "steps": 3}
        assert got["samples"]["cycle_ms"]["verify"] == [1.0, 2.0]
        assert got["custom"] == {"x": [1, 2]}
        assert reg.get_run(rid, samples=False).get("samples") is None
        assert reg.get_run(rid[:5])["id"] == rid
        assert reg.journal_mode() == "wal"


def test_list_filters_and_last_references():
    with open_registry() as reg:
        a = reg.add_run(_rec(kind="generate", name="first"))
        b = reg.add_run(_rec(kind="bench", name="second", tags=["sweep"]))
        assert [r["id"] for r in reg.list_runs()] == [b, a]
        assert [r["id"] for r in reg.list_runs(kind="generate")] == [a]
        assert [r["id"] for r in reg.list_runs(tag="sweep")] == [b]
        assert reg.list_runs(limit=1)[0]["tok_per_s"] == 12.5
        assert reg.resolve("last") == b and reg.resolve("last~1") == a
        with pytest.raises(SpecscopeError, match="fewer runs"):
            reg.resolve("last~5")


def test_tag_untag_delete_and_unknown_ids():
    with open_registry() as reg:
        rid = reg.add_run(_rec())
        reg.tag(rid, "good")
        assert "good" in reg.get_run(rid)["tags"]
        reg.tag(rid, "good", remove=True)
        assert "good" not in reg.get_run(rid)["tags"]
        reg.delete_run(rid)
        with pytest.raises(SpecscopeError, match="no run"):
            reg.get_run(rid)
        with pytest.raises(SpecscopeError, match="too short"):
            reg.get_run("ab")
        # deleting cascades to tags and samples
        assert reg._conn.execute("SELECT COUNT(*) FROM tags").fetchone()[0] == 0
        assert reg._conn.execute("SELECT COUNT(*) FROM samples").fetchone()[0] == 0


@pytest.mark.parametrize("bad,msg", [
    ("x", "must be a dict"), ({"name": "n"}, "kind"), ({"kind": "b", "tags": "t"}, "tags"),
    ({"kind": "b", "config": [1]}, "'config' must be a dict"), ({"kind": "b", "tags": ["a\nb"]}, "one-line"),
])
def test_bad_records_are_rejected(bad, msg):
    with open_registry() as reg:
        with pytest.raises(SpecscopeError, match=msg):
            reg.add_run(bad)
        assert reg.count() == 0


def test_migration_from_v1_keeps_runs(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0])
    conn.execute("INSERT INTO runs VALUES ('abcdef0123', '2025-01-01T00:00:00', 'bench', 'old', ?, '{}', ?, ?, '{}')",
                 (json.dumps({"model": "/m"}), json.dumps({"tok_per_s": 7.0}), json.dumps({"accept_lengths": [1]})))
    conn.execute("INSERT INTO tags VALUES ('abcdef0123', 'legacy')")
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()
    with open_registry(path) as reg:
        assert reg.schema_version() == SCHEMA_VERSION
        old = reg.get_run("abcdef0123")
        assert old["samples"] == {"accept_lengths": [1]} and old["tags"] == ["legacy"]
        assert reg.list_runs()[0]["tok_per_s"] == 7.0 and reg.list_runs()[0]["model"] == "/m"
        reg.add_run(_rec())
        assert reg.count() == 2


def test_newer_schema_and_garbage_files_are_refused(tmp_path):
    newer = tmp_path / "newer.db"
    conn = sqlite3.connect(newer)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(SpecscopeError, match="newer than this specscope"):
        open_registry(newer)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(SpecscopeError, match="not a usable specscope registry"):
        open_registry(junk)


def test_fingerprint_complete_on_this_machine(monkeypatch):
    monkeypatch.setenv("NCCL_PROTO", "Simple")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    fp = collect(torch_details=True)
    assert fp["cpu"]["model"] and fp["cpu"]["cores_logical"] >= 1 and fp["cpu"]["cores_usable"] >= 1
    assert fp["memory"]["total_mib"] > 0
    assert fp["os"]["kernel"] and fp["os"]["system"] == "Linux"
    assert fp["python"]["version"].count(".") == 2
    for pkg in ("torch", "transformers", "specscope"):
        assert fp["packages"][pkg]
    assert fp["torch"]["threads"] >= 1
    assert fp["vars"] == {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    assert fp["vars"]["NCCL_PROTO"] == "Simple" and "UNRELATED_VAR" not in fp["vars"]
    # run from this checkout: commit known
    assert len(fp["git"]["commit"]) == 40 and isinstance(fp["git"]["dirty"], bool)
    gpu = fp["gpu"]
    for f in GPU_FIELDS + ("driver_version", "cuda_driver_version"):
        assert f in gpu
    if gpu["count"] == 0:
        assert all(gpu[f] is None for f in GPU_FIELDS) and gpu["reason"]
    else:
        assert gpu["name"] and gpu["driver_version"] and gpu["sm_clock_max_mhz"]
    json.dumps(fp)
    flat = flatten(fp)
    assert flat["vars.NCCL_PROTO"] == "Simple" and "gpu.sm_clock_max_mhz" in flat


def test_model_hash_is_content_based(tmp_path):
    from safetensors.torch import save_file
    import torch

    a, b = tmp_path / "a", tmp_path / "b"
    for d, seed in ((a, 0), (b, 1)):
        d.mkdir()
        save_file({"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(seed))},
                  str(d / "model.safetensors"))
        (d / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "a2").mkdir()
    for f in a.iterdir():
        (tmp_path / "a2" / f.name).write_bytes(f.read_bytes())
    assert model_hash(a).startswith("fast1:")
    assert model_hash(a) == model_hash(tmp_path / "a2") != model_hash(b)
    assert model_hash("ngram") is None
    assert prompt_set_hash(["x", "y"]) != prompt_set_hash(["y", "x"])


def test_make_record_from_profiler_stores_and_reads_back(tmp_path):
    prof = CycleProfiler()
    for i in range(4):
        with prof.phase("draft"):
            pass
        with prof.phase("verify"):
            sum(range(2000))
        prof.end_cycle(1 + i % 2, num_draft=2)
    rec = make_record("bench", "unit", config={"model": str(tmp_path), "steps": 2}, profiler=prof,
                      results={"per_prompt": [{"tok_per_s": 1.0}]}, tags=["t"])
    assert rec["config"]["model_hash"] and rec["env"]["cpu"]["model"]
    with open_registry() as reg:
        got = reg.get_run(reg.add_run(rec))
    r = got["results"]
    assert r["cycles"] == 4 and r["accept_length"] == 1.5 and set(r["phases"]) >= {"draft", "verify"}
    assert r["per_prompt"] == [{"tok_per_s": 1.0}]
    assert got["samples"]["accept_lengths"] == [1, 2, 1, 2]
    assert len(got["samples"]["cycle_ms"]["verify"]) == 4


def test_registry_import_does_not_pull_torch():
    import subprocess
    import sys

    code = "import sys, specscope.registry, specscope.registry.fingerprint as f; f.collect(); " \
           "print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_device_check_script_passes_here():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "bench" / "fingerprint.py"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["problems"] == [] and report["fingerprint"]["cpu"]["model"]


def test_write_lock_held_too_long_is_a_clear_error(tmp_path):
    db = tmp_path / "locked.db"
    with open_registry(db) as reg:
        reg.add_run(_rec())
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")        # another writer holds the lock
    try:
        with open_registry(db, timeout=0.3) as reg:
            with pytest.raises(SpecscopeError, match="cannot write to the run registry"):
                reg.add_run(_rec())
            assert reg.count() == 1          # reads still work under WAL
    finally:
        other.execute("ROLLBACK")
        other.close()


def test_per_prompt_stats_from_a_generation_result():
    from specscope.generate import GenerationResult
    from specscope.registry import per_prompt_stats
    from specscope.speculative.stats import SpecStats

    stats = SpecStats("ngram", 4, 1, 5, [2, 2], [2, 0, 0, 0], [2, 2, 0, 0], {}, 5.0)
    res = GenerationResult([1, 2, 3, 4], prompt_len=7, prefill_s=0.5, decode_s=1.5, stop_reason="length",
                           stats=stats)
    p = per_prompt_stats(res, 3, category="coding")
    assert p == {"index": 3, "prompt_tokens": 7, "new_tokens": 4, "seconds": 2.0, "prefill_s": 0.5,
                 "tok_per_s": 2.0, "stop_reason": "length", "cycles": 2, "accept_length": 2.0, "category": "coding"}
