"""Bad input through outputs and silent options (issue 53): an output never overwrites an input (the target, the
drafter, the dataset, the registry), export's and check-drafter's knobs within range, a full disk during export
leaves nothing half-written, check-drafter reads the declared shape as generate does, and train's hub-only dataset
options are refused for a local file.

Each refusal is one `error:` line and exit 2, before any model loads, with every input byte-identical after.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cli_util import cli, one_error_line
from train_util import make_chat_target, write_dataset

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target with tokenizer, a drafter for it, a chat target and dataset for training, a registry."""
    from spec_helpers import tiny_world

    root = tmp_path_factory.mktemp("bad_outputs")
    return {**tiny_world(root), "chat": make_chat_target(root / "chat"), "data": write_dataset(root / "data.jsonl", n=8)}


def hashes(root: Path) -> dict:
    """Every regular file under root (or root itself) -> its content hash."""
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def no_load(*a, **k):
    raise AssertionError("a model was loaded before the input was refused")


@pytest.fixture
def refused(world, monkeypatch, capsys):
    """Runs a CLI case that must be refused from flags and files alone: one error line, no model load, and the
    files under `keep` byte-identical after. Returns the error line."""
    import specscope.models
    import specscope.session as session
    import specscope.train.pipeline as pipeline

    monkeypatch.setattr(session, "load_target", no_load)
    monkeypatch.setattr(pipeline, "load_target", no_load)
    monkeypatch.setattr(specscope.models, "load_model", no_load)
    monkeypatch.setattr("specscope.models.loader.load_model", no_load)

    def run(*argv, keep: Path):
        before = hashes(keep)
        code, _, err = cli(capsys, *argv)
        assert "internal error" not in err, err
        line = one_error_line(code, err)
        assert hashes(keep) == before, "a refused command changed an input"
        return line

    return run


def copy_dir(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------- outputs never inputs

@pytest.mark.parametrize("where", ["the target", "inside the target", "a symlink to the target",
                                   "the target of a --model config.json"])
def test_export_never_overwrites_its_target(refused, world, tmp_path, where):
    target = copy_dir(world["model"], tmp_path / "T")
    model_arg, out = target, target
    if where == "inside the target":
        out = target / "sub"
    elif where == "a symlink to the target":
        out = tmp_path / "link"
        out.symlink_to(target)
    elif where == "the target of a --model config.json":
        model_arg = target / "config.json"
    line = refused("export", world["drafter"], "--format", "speculators", "-o", out, "--model", model_arg,
                   keep=target)
    assert str(out) in line and str(model_arg) in line and "--model" in line and "choose another -o" in line, line
    assert not (target / "sub").exists()


def test_export_never_overwrites_its_source(refused, world, tmp_path):
    source = copy_dir(world["drafter"], tmp_path / "D")
    line = refused("export", source, "--format", "speculators", "-o", source, "--model", world["model"], keep=source)
    assert "drafter" in line and str(source) in line, line


def test_export_into_a_directory_holding_the_source_checkpoint(refused, world, tmp_path):
    """-o D where the source is D/model.safetensors' directory's file: the export would replace it."""
    d = tmp_path / "D"
    d.mkdir()
    ckpt = d / "config.json"
    ckpt.write_bytes((world["model"] / "config.json").read_bytes())
    line = refused("export", world["drafter"], "--format", "speculators", "-o", d, "--model", ckpt, keep=d)
    assert "contains" in line and str(ckpt) in line, line


@pytest.mark.parametrize("case", ["-o the --model", "-o inside the --model", "WORKDIR/drafter is the --init"])
def test_train_output_never_overwrites_an_input(refused, world, tmp_path, case):
    chat = copy_dir(world["chat"], tmp_path / "chat")
    work = tmp_path / "wd"
    argv = ["train", "--workdir", work, "--model", chat, "--dataset", world["data"], "--draft-vocab", "32"]
    keep = chat
    if case == "-o the --model":
        argv += ["-o", chat]
    elif case == "-o inside the --model":
        argv += ["-o", chat / "drafter"]
    else:
        keep = copy_dir(world["drafter"], work / "drafter")
        argv = ["train", "--workdir", work, "--model", world["model"], "--dataset", world["data"], "--init", keep]
    line = refused(*argv, keep=keep)
    assert ("--init" if "init" in case else "--model") in line and "choose another -o" in line, line


@pytest.mark.parametrize("how", ["--db", "SPECSCOPE_DB", "--db a symlink to it", "another spelling"])
@pytest.mark.parametrize("cmd", ["runs export", "report"])
def test_an_export_or_report_never_replaces_the_registry(refused, world, tmp_path, monkeypatch, cmd, how):
    import shutil

    db = tmp_path / "runs.db"
    shutil.copy(world["db"], db)
    out, flags = db, ["--db", db]
    if how == "SPECSCOPE_DB":
        monkeypatch.setenv("SPECSCOPE_DB", str(db))
        flags = []
    elif how == "--db a symlink to it":
        (tmp_path / "link.db").symlink_to(db)
        flags = ["--db", tmp_path / "link.db"]
    elif how == "another spelling":
        (tmp_path / "sub").mkdir()
        out = tmp_path / "sub" / ".." / "runs.db"
    argv = ["runs", "export", "last"] if cmd == "runs export" else ["report", "last"]
    line = refused(*argv, "-o", out, *flags, keep=db)
    assert "--db" in line and str(flags[-1] if flags else db) in line, line


# ---------------------------------------------------------------------------------------- export's knobs, disk

@pytest.mark.parametrize("argv", [["export", "{drafter}", "--format", "speculators", "-o", "{tmp}/out", "--steps",
                                   "1000000000"],
                                  ["check-drafter", "{drafter}", "--model", "{model}", "--no-run", "--steps",
                                   "1000000000"]])
def test_draft_depth_out_of_range_is_refused_with_the_range(refused, world, tmp_path, argv):
    args = [a.format(drafter=world["drafter"], model=world["model"], tmp=tmp_path) for a in argv]
    line = refused(*args, keep=world["drafter"])
    assert "--steps" in line and "1<=x<=64" in line, line
    assert not (tmp_path / "out").exists()


def test_export_steps_for_sglang_is_refused_not_ignored(refused, world, tmp_path):
    line = refused("export", world["drafter"], "--format", "sglang", "-o", tmp_path / "out", "--steps", "3",
                   keep=world["drafter"])
    assert "--steps" in line and "speculators" in line, line
    assert not (tmp_path / "out").exists()


def _limit_file_size():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # the write then fails with EFBIG, as on a full disk
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


@pytest.mark.parametrize("existing", [False, True])
def test_export_on_a_full_disk_is_one_line_and_writes_nothing(world, tmp_path, existing):
    """A real write failure (the OS refuses bytes past RLIMIT_FSIZE): one line, exit 2, and -o exactly as before --
    absent, or an earlier export byte-identical with no temp file beside it."""
    out = tmp_path / "sub" / "out"
    if existing:
        copy_dir(world["drafter"], out)
    before = hashes(out) if existing else None
    env = {**os.environ, "PYTHONPATH": str(SRC), "PYTHONDONTWRITEBYTECODE": "1"}
    p = subprocess.run([sys.executable, "-m", "specscope", "export", str(world["drafter"]), "--format", "speculators",
                        "-o", str(out), "--model", str(world["model"])], capture_output=True, text=True, env=env,
                       preexec_fn=_limit_file_size, timeout=120)
    line = one_error_line(p.returncode, p.stderr)
    assert str(out) in line and "nothing was written" in line, line
    if existing:
        assert hashes(out) == before and sorted(os.listdir(out)) == sorted(os.listdir(world["drafter"]))
    else:
        assert not (tmp_path / "sub").exists()


# ---------------------------------------------------------------------------------------- check-drafter's shape

@pytest.mark.parametrize("shape", ["{not json", json.dumps([2, 4, 8]), json.dumps({"steps": -3, "topk": 1,
                                                                                     "draft_tokens": 4})])
def test_check_drafter_refuses_the_shape_file_generate_refuses(refused, world, tmp_path, shape):
    from specscope.errors import SpecscopeError
    from specscope.speculative.decode import declared_shape

    d = copy_dir(world["drafter"], tmp_path / "D")
    (d / "specscope_shape.json").write_text(shape)
    with pytest.raises(SpecscopeError) as generate_says:
        declared_shape(str(d))              # what generate / serve read the shape with
    line = refused("check-drafter", d, "--model", world["model"], "--no-run", keep=d)
    assert line == f"error: {generate_says.value}", line


def test_check_drafter_reports_a_valid_declared_shape(world, tmp_path, capsys):
    d = copy_dir(world["drafter"], tmp_path / "D")
    (d / "specscope_shape.json").write_text(json.dumps({"steps": 2, "topk": 2, "draft_tokens": 5}))
    code, out, err = cli(capsys, "check-drafter", d, "--model", world["model"], "--no-run", "--json")
    checks = {c["check"]: c for c in json.loads(out)["checks"]}
    assert checks["declared shape"]["status"] == "ok" and "steps 2, topk 2" in checks["declared shape"]["detail"]


# ---------------------------------------------------------------------------------------- train's dataset options

@pytest.mark.parametrize("flag", [["--dataset-split", "nosuch"], ["--dataset-config", "foo"]])
@pytest.mark.parametrize("source", ["--dataset", "--prompt-file"])
def test_train_refuses_hub_dataset_options_it_would_ignore(refused, world, tmp_path, flag, source):
    line = refused("train", "--workdir", tmp_path / "wd", "--model", world["chat"], source, world["data"],
                   "--stages", "data", *flag, keep=world["data"])
    assert flag[0] in line and repr(flag[1]) in line, line
    assert not (tmp_path / "wd" / "data").exists()
