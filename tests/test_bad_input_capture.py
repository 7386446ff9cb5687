"""`specscope train --capture`'s bad input and damaged state, each refused in one `error:` line (exit 2) naming the
flag or file and the fix: bad --capture values, a --capture vllm without vLLM, capture files that are damaged, of
another width or of other token ids, a server of another model, --init drafters whose aux layers vLLM cannot
collect, a damaged work directory; and a capture killed with SIGKILL leaves nothing in the user's --capture-dir
once a rerun has finished. The server is a stand-in on loopback that writes the capture plugin's files with the
plugin's own writer (tests/engines/test_capture.py runs the real vLLM)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_util import cli, one_error_line
from serve_util import LoopbackThread, QuietHandler
from train_util import make_chat_target, write_dataset

from specscope.train.capture_files import XARG_LAYERS, capture_key, write_capture

ROOT = Path(__file__).resolve().parent.parent


class StandIn:
    """What `train --capture URL` sees of a vLLM running specscope's capture plugin: /v1/models lists `models`;
    /v1/completions writes the request's file into `out` with the plugin's writer (random features `hidden` wide,
    the ids sent). `damage`: "garbage" / "truncated" files, or "shift" (token 2 of the file differs from the one
    sent); `hold_after`: requests after that many wait for `release` (a capture in flight)."""

    def __init__(self, out: Path, hidden: int = 64, models=("m",), damage: str | None = None,
                 hold_after: int | None = None):
        self.out, self.hidden, self.damage, self.hold_after = Path(out), hidden, damage, hold_after
        self.models = [m if isinstance(m, dict) else {"id": m} for m in models]
        self.requests, self.held, self.written = 0, 0, 0
        self.release, self.lock = threading.Event(), threading.Lock()
        self.out.mkdir(parents=True, exist_ok=True)
        self.http = LoopbackThread(self._handler())
        self.url = self.http.url

    def _handler(self):
        s = self

        class Handler(QuietHandler):
            def do_GET(self):
                self._send(200, json.dumps({"object": "list", "data": s.models}).encode())

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with s.lock:
                    s.requests += 1
                    hold = s.hold_after is not None and s.requests > s.hold_after
                    s.held += hold
                if hold:
                    s.release.wait(120)
                s.write(body["prompt"], body["vllm_xargs"])
                with s.lock:
                    s.written += 1
                try:
                    self._send(200, json.dumps({"choices": [{"text": "x"}]}).encode())
                except OSError:         # the client is gone
                    pass

        return Handler

    def write(self, ids: list[int], xargs: dict) -> None:
        T, k = len(ids), len(xargs[XARG_LAYERS])
        g = torch.Generator().manual_seed(sum(ids))
        sent = list(ids) if self.damage != "shift" else ids[:2] + [ids[2] + 1] + ids[3:]
        path = write_capture(self.out, capture_key(xargs), torch.randn(T, k, self.hidden, generator=g),
                             torch.randn(T, self.hidden, generator=g), torch.zeros(T, dtype=torch.int64), sent,
                             {"engine_version": "stand-in", "tensor_parallel_size": "1"})
        if path is not None and self.damage == "garbage":
            path.write_bytes(b"\x00garbage, not safetensors" * 4)
        elif path is not None and self.damage == "truncated":
            data = path.read_bytes()
            path.write_bytes(data[:len(data) // 2])

    def close(self):
        self.release.set()
        self.http.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_capture")
    return {"target": make_chat_target(root / "target"), "data": write_dataset(root / "ds.jsonl", n=8)}


def capture_args(world, work, url, cdir, *more):
    return ["train", "--workdir", work, "--model", world["target"], "--dataset", world["data"], "--stages", "data",
            "--capture", url, "--capture-dir", cdir, "--no-progress", *more]


def last_error_line(code, err) -> str:
    """A refusal after progress lines: exit 2, one `error:` line, the last, no traceback."""
    errors = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == errors[0], err
    return errors[0]


# ---- flags, refused before anything is read -------------------------------------------------------------------
@pytest.mark.parametrize("value", ["", "ftp://host/", "http://[::1"])
def test_a_bad_capture_value_names_capture(value, world, tmp_path, capsys):
    code, _, err = cli(capsys, "train", "--workdir", tmp_path / "w", "--model", world["target"], "--dataset",
                       tmp_path / "missing.jsonl", "--stages", "data", "--capture", value, "--capture-dir", tmp_path)
    line = one_error_line(code, err)
    assert "--capture" in line and "--answers-from" not in line and "vllm" in line, line
    assert not (tmp_path / "w").exists()


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_capture_vllm_without_vllm_is_refused_before_the_dataset_is_read(world, tmp_path, capsys):
    # the dataset does not exist: reading it first would be refused for that instead
    code, _, err = cli(capsys, "train", "--workdir", tmp_path / "w", "--model", world["target"], "--dataset",
                       tmp_path / "missing.jsonl", "--stages", "data", "--capture", "vllm")
    line = one_error_line(code, err)
    assert line.startswith("error: --capture vllm starts vLLM with this Python") and "--capture-dir" in line


@pytest.mark.parametrize("aux", [[2, 2, 2], [5, 4, 2]])
def test_an_init_drafter_whose_aux_layers_are_not_increasing_is_refused(aux, world, tmp_path, capsys):
    from drafter_util import random_drafter

    from specscope.models import load_model
    from specscope.speculative.formats import save_drafter

    d = random_drafter(load_model(world["target"], "fp32", "cpu"))
    d.config.aux_layer_ids = list(aux)
    save_drafter(d, tmp_path / "drafter", "sglang", dtype=torch.float32)
    code, _, err = cli(capsys, "train", "--workdir", tmp_path / "w", "--model", world["target"], "--dataset",
                       tmp_path / "missing.jsonl", "--init", tmp_path / "drafter")
    line = one_error_line(code, err)
    assert "--init" in line and str(aux) in line and "distinct and increasing" in line, line


# ---- what the server sends back --------------------------------------------------------------------------------
@pytest.mark.parametrize("damage, words", [("garbage", "is damaged"), ("truncated", "is damaged"),
                                           ("shift", "token 2 is")])
def test_a_damaged_or_foreign_capture_file_is_one_line(damage, words, world, tmp_path, capsys):
    srv = StandIn(tmp_path / "in", damage=damage)
    try:
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w", srv.url, tmp_path / "in"))
    finally:
        srv.close()
    line = last_error_line(code, err)
    assert "the capture file " + str(tmp_path / "in") in line and words in line, line
    assert "tokens at" not in line       # not a count of tokens when the tokens themselves differ


def test_features_of_another_width_are_refused_when_captured(world, tmp_path, capsys):
    srv = StandIn(tmp_path / "in", hidden=32)
    try:
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w", srv.url, tmp_path / "in"))
    finally:
        srv.close()
    line = last_error_line(code, err)
    assert "hidden states 32 wide" in line and "hidden size is 64" in line, line
    assert not (tmp_path / "w" / "data" / "manifest.json").exists()


def test_a_server_of_another_model_is_named(world, tmp_path, capsys):
    other = {"id": "other-model", "root": "/models/other-model"}
    srv = StandIn(tmp_path / "in", models=[other])
    try:
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w", srv.url, tmp_path / "in",
                                                 "--served-model-name", "m"))
        line = last_error_line(code, err)
        assert "'other-model'" in line and "--served-model-name 'm'" in line, line
        # no name to match: it may be --model under vLLM's --served-model-name, so said loudly, not refused
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w", srv.url, tmp_path / "in"))
        assert code == 0, err
        warn = [ln for ln in err.splitlines() if ln.startswith("warning: ")]
        assert len(warn) == 1 and "'other-model'" in warn[0] and str(world["target"]) in warn[0], err
        srv.models = [other, {"id": "third"}]
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w2", srv.url, tmp_path / "in"))
        assert "none of them --model" in last_error_line(code, err)
        srv.models = [other, {"id": "alias", "root": str(world["target"])}]      # --model's checkpoint, renamed
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w3", srv.url, tmp_path / "in"))
        assert code == 0 and "warning" not in err, err
    finally:
        srv.close()


# ---- the work directory's captured data -----------------------------------------------------------------------
@pytest.fixture
def captured(world, tmp_path, capsys):
    """A work directory whose data stage ran (through the stand-in)."""
    srv = StandIn(tmp_path / "in")
    try:
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w", srv.url, tmp_path / "in"))
    finally:
        srv.close()
    assert code == 0, err
    return tmp_path / "w"


@pytest.mark.parametrize("manifest", [b"{not json", b'{"aux_layers": [2, 4, 5], "shards": "x"}', b"[]"])
def test_a_damaged_manifest_is_one_line(manifest, captured, world, capsys):
    (captured / "data" / "manifest.json").write_bytes(manifest)
    code, _, err = cli(capsys, "train", "--workdir", captured, "--model", world["target"], "--stages", "vocab",
                       "--draft-vocab", "50")
    line = one_error_line(code, err)
    assert str(captured / "data" / "manifest.json") in line and "--stages data" in line, line


def test_a_shard_narrower_than_the_target_is_refused_before_the_next_stage(captured, world, capsys):
    from safetensors.torch import load_file, save_file

    shard = captured / "data" / "shard-00000.safetensors"
    t = load_file(str(shard))
    save_file(dict(t, aux=t["aux"][..., :32].contiguous(), hidden=t["hidden"][..., :32].contiguous()), str(shard))
    code, _, err = cli(capsys, "train", "--workdir", captured, "--model", world["target"], "--stages", "vocab",
                       "--draft-vocab", "50")
    line = one_error_line(code, err)
    assert str(shard) in line and "the manifest says" in line and "--stages data" in line, line


def test_a_deleted_shard_is_captured_again(captured, world, tmp_path, capsys):
    shard = captured / "data" / "shard-00000.safetensors"
    shard.unlink()
    srv = StandIn(tmp_path / "in")
    try:
        code, _, err = cli(capsys, *capture_args(world, captured, srv.url, tmp_path / "in"))
    finally:
        srv.close()
    assert code == 0 and shard.exists() and srv.requests == 1 + 8, err


# ---- SIGKILL mid-capture -----------------------------------------------------------------------------------------
def test_a_capture_killed_mid_way_leaves_nothing_in_the_capture_dir(world, tmp_path, capsys):
    cdir = tmp_path / "mine"
    cdir.mkdir()
    (cdir / "keep.safetensors").write_bytes(b"the user's own file")
    srv = StandIn(cdir, hold_after=3)
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        proc = subprocess.Popen([sys.executable, "-m", "specscope",
                                 *map(str, capture_args(world, tmp_path / "w", srv.url, cdir))],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while srv.held == 0 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert srv.held, proc.stderr.read().decode() if proc.poll() is not None else "no request held"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        proc.stderr.close()
        srv.release.set()                   # the server finishes the requests in flight after the client died
        deadline = time.monotonic() + 30
        while srv.written < srv.requests and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.hold_after = None
        code, _, err = cli(capsys, *capture_args(world, tmp_path / "w", srv.url, cdir))
    finally:
        srv.close()
    assert code == 0, err
    assert sorted(p.name for p in cdir.iterdir()) == ["keep.safetensors"]
