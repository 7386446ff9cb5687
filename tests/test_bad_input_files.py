"""Bad input through files (issue 26): outputs written atomically and to regular files only, a diverged training
run that ships nothing, strict UTF-8 text inputs, registries checked before the work, and every flag and file
decided before a model loads.

Each refusal must be one `error:` line and exit 2, with nothing replaced and no temp file left behind; the
`guarded` runner makes loading any model a test failure for the cases that flags and files alone decide.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from pathlib import Path

import pytest

from cli_util import cli, one_error_line
from train_util import make_chat_target, write_dataset

SGLANG_URL = "http://127.0.0.1:9"   # nothing listens on the discard port: dataset errors come before any request
NGRAM = ("--draft", "ngram", "--topk", "1", "--draft-tokens", "6")   # a chain: n-gram drafting proposes nothing else


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target with tokenizer, a drafter for it, the same drafter with NaN weights, a chat target for
    training and a registry holding one run."""
    import torch
    from safetensors.torch import load_file, save_file

    from spec_helpers import tiny_target_and_drafter
    from specscope.registry import make_record, store_record

    root = tmp_path_factory.mktemp("bad_files")
    model, drafter, _ = tiny_target_and_drafter(root)
    # what a diverged training run used to ship: the same files, every floating weight NaN
    nan_drafter = root / "nan-drafter"
    nan_drafter.mkdir()
    (nan_drafter / "config.json").write_bytes((drafter / "config.json").read_bytes())
    tensors = load_file(str(drafter / "model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in tensors.items()},
              str(nan_drafter / "model.safetensors"), metadata={"format": "pt"})
    db = root / "runs.db"
    run_id = store_record(make_record("generate", name="a run", config={"model": str(model)},
                                      results={"tok_per_s": 10.0}, env={"host": "test"}), db)
    chat = make_chat_target(root / "chat")
    return {"root": root, "model": model, "drafter": drafter, "nan_drafter": nan_drafter, "db": db, "run": run_id,
            "chat": chat}


def no_load(*a, **k):
    raise AssertionError("a model was loaded before the input was refused")


@pytest.fixture
def guarded(world, tmp_path, monkeypatch, capsys):
    """Runs a CLI case that must be refused from flags and files alone: any model load fails the test, and no
    file under tmp_path may change. Returns the error line."""
    import specscope.session as session
    import specscope.models
    import specscope.train.pipeline as pipeline

    monkeypatch.setenv("SPECSCOPE_DB", str(world["db"]))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    # every way in: the session's and the trainer's loaders, and load_model under both of its import paths
    monkeypatch.setattr(session, "load_target", no_load)
    monkeypatch.setattr(pipeline, "load_target", no_load)
    monkeypatch.setattr(specscope.models, "load_model", no_load)
    monkeypatch.setattr("specscope.models.loader.load_model", no_load)

    def run(*argv):
        before = tree(tmp_path)
        code, _, err = cli(capsys, *argv)
        assert "internal error" not in err, err
        line = one_error_line(code, err)
        assert tree(tmp_path) == before, "a refused command changed or left files"
        return line

    return run


def tree(root: Path) -> dict:
    """Every entry under root -> (kind, content hash for regular files): what a refusal must leave alone."""
    import hashlib

    out = {}
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            out[str(p)] = ("file", hashlib.sha256(p.read_bytes()).hexdigest())
        elif stat.S_ISLNK(st.st_mode):
            out[str(p)] = ("link", os.readlink(p))
        else:
            out[str(p)] = (stat.S_IFMT(st.st_mode), None)
    return out


def temp_files(d: Path) -> list[str]:
    return [p.name for p in d.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------- 1. outputs

def _special(kind: str, path: Path) -> Path:
    """A non-regular file at `path`: what a rename would have replaced."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("making a device node needs root")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 7))     # what /dev/full is
    elif kind == "symlink to a file":
        (path.parent / "real.html").write_text("keep me")
        path.symlink_to(path.parent / "real.html")
    elif kind == "dangling symlink":
        path.symlink_to(path.parent / "nowhere.html")
    elif kind == "directory":
        path.mkdir()
        (path / "inside.txt").write_text("keep me")
    return path


@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "symlink to a file", "dangling symlink", "directory"])
def test_report_never_replaces_what_is_not_a_regular_file(guarded, world, tmp_path, kind):
    target = _special(kind, tmp_path / "out.html")
    line = guarded("report", world["run"], "-o", target)
    assert str(target) in line and ("regular file" in line or "directory" in line), line
    assert not temp_files(tmp_path)


@pytest.mark.parametrize("kind", ["fifo", "symlink to a file", "directory"])
def test_runs_export_never_replaces_what_is_not_a_regular_file(guarded, world, tmp_path, kind):
    target = _special(kind, tmp_path / "out.json")
    line = guarded("runs", "export", world["run"], "-o", target)
    assert str(target) in line, line


def test_a_full_disk_leaves_the_old_report_and_no_temp_file(world, tmp_path, monkeypatch, capsys):
    """ENOSPC while the temp file is flushed: one line, the old report intact, nothing left beside it."""
    import specscope.fileio as fileio

    monkeypatch.setenv("SPECSCOPE_DB", str(world["db"]))
    out = tmp_path / "r.html"
    out.write_text("the old report")

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fileio.os, "fsync", full)
    code, _, err = cli(capsys, "report", world["run"], "-o", out)
    line = one_error_line(code, err)
    assert "no space left on the device" in line.lower() and str(out) in line
    assert out.read_text() == "the old report" and sorted(p.name for p in tmp_path.iterdir()) == ["r.html"]


def test_report_writes_a_regular_file_atomically(world, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECSCOPE_DB", str(world["db"]))
    out = tmp_path / "new" / "dir" / "r.html"
    code, _, err = cli(capsys, "report", world["run"], "-o", out)
    assert code == 0, err
    assert out.is_file() and "<html" in out.read_text().lower()
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask          # not mkstemp's private 0600
    code, _, err = cli(capsys, "report", world["run"], "-o", out)     # over an existing regular file: fine
    assert code == 0, err
    assert not temp_files(out.parent)


def test_a_failing_writer_leaves_no_temp_file(tmp_path):
    from specscope.fileio import atomic_output

    (tmp_path / "x.bin").write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_output(tmp_path / "x.bin") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("the writer broke")
    assert (tmp_path / "x.bin").read_bytes() == b"old" and sorted(os.listdir(tmp_path)) == ["x.bin"]


def test_plot_and_directory_outputs_are_checked_before_the_model_loads(guarded, world, tmp_path):
    link = _special("symlink to a file", tmp_path / "curve.png")
    assert "symbolic link" in guarded("verify-curve", "--model", world["model"], "-o", link, "--no-record")
    assert ".xyz" in guarded("verify-curve", "--model", world["model"], "-o", tmp_path / "c.xyz", "--no-record")
    (tmp_path / "plots").write_text("a file, not a directory")
    assert "is a file" in guarded("tune", "--profile", *NGRAM, "--model", world["model"], "-o", tmp_path / "plots")
    assert "/proc/x" in guarded("tune", "--profile", *NGRAM, "--model", world["model"], "-o", "/proc/x")
    fifo = _special("fifo", tmp_path / "demo-out")
    assert "demo-out" in guarded("demo", "--model", world["model"], *NGRAM, "-o", fifo)


# ---------------------------------------------------------------------------------------------- 2. NaN drafters

@pytest.fixture(scope="module")
def prepared(world, tmp_path_factory):
    """A work directory with the data and vocab stages done on the tiny chat target."""
    from specscope.cli import main

    root = tmp_path_factory.mktemp("nan_train")
    ds = write_dataset(root / "ds.jsonl", n=8)
    work = root / "work"
    main(["train", "--workdir", str(work), "--model", str(world["chat"]), "--dataset", str(ds), "--stages",
          "data,vocab", "--draft-vocab", "32", "--max-len", "64", "--device", "cpu", "--no-progress"])
    return work


def test_a_diverging_run_stops_and_writes_no_drafter(world, prepared, tmp_path, capsys):
    import shutil

    work = tmp_path / "work"
    shutil.copytree(prepared, work)
    code, _, err = cli(capsys, "train", "--workdir", work, "--model", world["chat"], "--stages", "train", "--lr",
                       "1e30", "--max-train-steps", "4", "--batch-size", "2", "--ttt-steps", "2", "--warmup", "1",
                       "--eval-every", "100", "--ckpt-every", "100", "--max-len", "64", "--device", "cpu",
                       "--no-progress", "-o", tmp_path / "drafter")
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(lines) == 1, err
    assert "diverged at step" in lines[0] and "--lr 1e+30" in lines[0] and "far too high" in lines[0], lines[0]
    assert not (tmp_path / "drafter").exists() and not (work / "drafter").exists()


def test_check_drafter_reports_non_finite_weights(world, capsys):
    code, out, err = cli(capsys, "check-drafter", world["nan_drafter"], "--model", world["model"], "--no-run")
    assert code == 1, out + err
    assert "[FAIL] weights" in out and "NaN" in out and "no faults" not in out
    code, out, err = cli(capsys, "check-drafter", world["drafter"], "--model", world["model"], "--no-run")
    assert "[ok  ] weights: every weight is finite" in out, out


def test_generate_refuses_a_drafter_with_non_finite_weights(world, monkeypatch, capsys):
    code, _, err = cli(capsys, "generate", "--model", world["model"], "--prompt", "the quick brown fox",
                       "--draft", world["nan_drafter"], "--no-record", "--max-new-tokens", "4")
    line = one_error_line(code, err)
    assert "non-finite weights" in line and "nan-drafter" in line


def test_save_drafter_refuses_non_finite_weights(world, tmp_path):
    import torch

    from specscope.errors import SpecscopeError
    from specscope.speculative.formats import load_drafter, save_drafter

    d = load_drafter(world["drafter"])
    with torch.no_grad():
        d.fc.weight[0, 0] = float("inf")
    with pytest.raises(SpecscopeError, match="not finite"):
        save_drafter(d, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- 3. UTF-8

def test_text_inputs_are_strict_utf8(guarded, world, tmp_path):
    """Never U+FFFD standing in for bad bytes in training data or a benchmark's prompts: one line, the offset."""
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')           # Latin-1 é, byte 0xe9 at offset 32
    conv = tmp_path / "c.jsonl"
    conv.write_bytes(b'{"messages": [{"role": "user", "content": "\xff"}, {"role": "assistant", "content": "a"}]}\n')
    txt = tmp_path / "p.txt"
    txt.write_bytes(b"one prompt\nanother \xc3\x28 one\n")                  # a cut 2-byte sequence at 19
    for argv, name, at in (
            (train(world, tmp_path, "--prompt-file", bad), bad, "0xe9 at offset 32, line 2"),
            (train(world, tmp_path, "--dataset", conv), conv, "0xff at offset 43, line 1"),
            (["bench-serve", "--base-url", SGLANG_URL, "--dataset", bad, "--no-record"], bad, "0xe9 at offset 32"),
            (["bench-serve", "--base-url", SGLANG_URL, "--dataset", txt, "--no-record"], txt, "0xc3 at offset 19"),
            (["tune", "--profile", "--model", world["model"], *NGRAM, "--dataset", bad],
             bad, "0xe9 at offset 32")):
        line = guarded(*argv)
        assert "not valid UTF-8" in line and str(name) in line and at in line, line


# ---------------------------------------------------------------------------------------------- 5. registries

def _db_cases(tmp_path):
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not SQLite\n" * 50)
    (tmp_path / "dir.db").mkdir()
    return {"a directory": tmp_path / "dir.db", "a garbage file": garbage, "/proc/x.db": Path("/proc/x.db")}


def test_commands_that_store_runs_check_the_registry_before_the_model_loads(guarded, world, tmp_path):
    for what, db in _db_cases(tmp_path).items():
        for argv in (["generate", "--model", world["model"], "--prompt", "hi", "--db", db],
                     ["verify-curve", "--model", world["model"], "--no-plot", "--db", db],
                     ["tune", "--profile", "--model", world["model"], *NGRAM, "--db", db],
                     ["demo", "--model", world["model"], *NGRAM, "-o",
                      tmp_path / "demo", "--db", db]):
            line = guarded(*argv)
            assert str(db) in line, (what, argv[0], line)


def test_readers_never_create_a_registry(guarded, world, tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nope" / "runs.db"
    for argv in (["runs", "show", "last", "--db", missing], ["compare", "last", "last~1", "--db", missing],
                 ["report", "last", "-o", tmp_path / "r.html", "--db", missing],
                 ["runs", "export", "last", "--db", missing], ["breakeven", "--run", "last", "--db", missing]):
        line = guarded(*argv)
        assert "no run registry" in line and str(missing) in line, line
    code, out, err = cli(capsys, "runs", "list", "--db", missing, "--json")
    assert code == 0 and json.loads(out) == [], err
    assert not missing.parent.exists()


# ---------------------------------------------------------------------------------------------- 8. flags and files

def _case_files(w, tmp: Path) -> dict:
    f = {}
    f["no_conv"] = tmp / "no_conv.jsonl"
    f["no_conv"].write_text('{"messages": [{"role": "user", "content": "only a question"}]}\n')
    f["no_prompt"] = tmp / "no_prompt.jsonl"
    f["no_prompt"].write_text('{"other": 1}\nnot json\n')
    return f


def train(w, tmp, *extra):
    return ["train", "--workdir", tmp / "wd", "--model", w["chat"], "--draft-vocab", "32", *extra]


# id -> (argv(world, tmp, files), substrings of the error line)
CASES = {
    "train: no data source": (lambda w, t, f: train(w, t), ["--prompt-file", "--dataset", "--synth"]),
    "train: dataset without a usable conversation": (lambda w, t, f: train(w, t, "--dataset", f["no_conv"]),
                                                     ["no usable conversation", "no_conv.jsonl"]),
    "train: prompt file without a usable prompt": (lambda w, t, f: train(w, t, "--prompt-file", f["no_prompt"]),
                                                   ["no usable prompt", "no_prompt.jsonl"]),
    "train: --init missing": (lambda w, t, f: train(w, t, "--synth", "2", "--init", t / "missing"),
                              ["--init", "missing"]),
    "train: --init with NaN weights": (lambda w, t, f: ["train", "--workdir", t / "wd", "--model", w["model"],
                                                        "--synth", "2", "--init", w["nan_drafter"]],
                                       ["--init", "non-finite"]),
    "train: --draft-vocab 10^9": (lambda w, t, f: train(w, t, "--synth", "2", "--draft-vocab", "1000000000"),
                                  ["--draft-vocab"]),
    "train: --draft-vocab above the target's vocabulary": (
        lambda w, t, f: train(w, t, "--synth", "2", "--draft-vocab", "5000"), ["--draft-vocab 5000", "101"]),
    "train: --stages train without a vocabulary": (lambda w, t, f: train(w, t, "--stages", "train"),
                                                   ["manifest.json", "data stage"]),
    "train: --lr nan": (lambda w, t, f: train(w, t, "--synth", "2", "--lr", "nan"), ["--lr", "nan"]),
    "train: --lr -1": (lambda w, t, f: train(w, t, "--synth", "2", "--lr", "-1"), ["--lr", "-1"]),
    "train: --lr inf": (lambda w, t, f: train(w, t, "--synth", "2", "--lr", "inf"), ["--lr", "inf"]),
    "train: --weight-decay nan": (lambda w, t, f: train(w, t, "--synth", "2", "--weight-decay", "nan"),
                                  ["--weight-decay", "nan"]),
    "train: --max-minutes nan": (lambda w, t, f: train(w, t, "--synth", "2", "--max-minutes", "nan"),
                                 ["--max-minutes", "nan"]),
    "train: --grad-clip nan": (lambda w, t, f: train(w, t, "--synth", "2", "--grad-clip", "nan"),
                               ["--grad-clip", "nan"]),
    "train: --eval-fraction nan": (lambda w, t, f: train(w, t, "--synth", "2", "--eval-fraction", "nan"),
                                   ["--eval-fraction", "nan"]),
    "train: --user-temperature nan": (lambda w, t, f: train(w, t, "--synth", "2", "--user-temperature", "nan"),
                                      ["--user-temperature", "nan"]),
    "train: --ttt-steps 10^12": (lambda w, t, f: train(w, t, "--synth", "2", "--ttt-steps", str(10**12)),
                                 ["--ttt-steps"]),
    "tune: --profile --dataset missing": (
        lambda w, t, f: ["tune", "--profile", "--model", w["model"], *NGRAM, "--dataset",
                         t / "nope.jsonl"], ["nope.jsonl", "does not exist"]),
    "tune: --profile --dataset without prompts": (
        lambda w, t, f: ["tune", "--profile", "--model", w["model"], *NGRAM, "--dataset",
                         f["no_prompt"]], ["no_prompt.jsonl"]),
    "tune: --profile --draft ngram with the default --topk 4": (
        lambda w, t, f: ["tune", "--profile", "--model", w["model"], "--draft", "ngram"], ["n-gram", "--topk 1"]),
    "tune: --profile --draft ngram-lookup with the default --topk 4": (
        lambda w, t, f: ["tune", "--profile", "--model", w["model"], "--draft", "ngram-lookup"],
        ["n-gram", "--topk 1", "tune profiles"]),
    "tune: --profile --draft missing": (
        lambda w, t, f: ["tune", "--profile", "--model", w["model"], "--draft", t / "nope"],
        ["nope", "not found"]),
    "tune: --decode-ms inf": (lambda w, t, f: ["tune", "--run", "last", "--decode-ms", "inf"], ["--decode-ms", "inf"]),
    "tune: --max-new-tokens above the context": (
        lambda w, t, f: ["tune", "--profile", "--model", w["model"], *NGRAM,
                         "--max-new-tokens", "1000"], ["--max-new-tokens 1000", "256"]),
    "verify-curve: --repeats 0": (lambda w, t, f: ["verify-curve", "--model", w["model"], "--repeats", "0",
                                                   "--no-plot", "--no-record"], ["--repeats", "0"]),
    "verify-curve: --repeats -5": (lambda w, t, f: ["verify-curve", "--model", w["model"], "--repeats", "-5",
                                                    "--no-plot", "--no-record"], ["--repeats", "-5"]),
    "verify-curve: --repeats 10^12": (lambda w, t, f: ["verify-curve", "--model", w["model"], "--repeats",
                                                       str(10**12), "--no-plot", "--no-record"],
                                      ["--repeats", str(10**12)]),
    "verify-curve: --warmup -1": (lambda w, t, f: ["verify-curve", "--model", w["model"], "--warmup", "-1",
                                                   "--no-plot", "--no-record"], ["--warmup", "-1"]),
    "verify-curve: --context above the model's": (
        lambda w, t, f: ["verify-curve", "--model", w["model"], "--context", "250", "--tokens", "1,16", "--no-plot",
                         "--no-record"], ["context 250", "256"]),
    "demo: --draft missing": (lambda w, t, f: ["demo", "--model", w["model"], "--draft", t / "missing", "-o",
                                               t / "demo"], ["missing", "not found"]),
    "demo: --max-new-tokens above the context": (
        lambda w, t, f: ["demo", "--model", w["model"], *NGRAM, "--max-new-tokens", "300",
                         "-o", t / "demo"], ["--max-new-tokens 300", "256"]),
    "generate: --steps 10^12": (lambda w, t, f: ["generate", "--model", w["model"], "--prompt", "hi", "--draft",
                                                 "ngram", "--steps", str(10**12), "--no-record"], ["--steps"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_a_model_loads(guarded, world, tmp_path, case):
    make, expect = CASES[case]
    files = _case_files(world, tmp_path)
    line = guarded(*make(world, tmp_path, files))
    for s in expect:
        assert s in line, f"{s!r} not in {line!r}"
