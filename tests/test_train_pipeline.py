"""`specscope train` end to end on a tiny chat target: data capture (resumable), vocabulary, training with exact
kill-and-resume, 2-process gloo DDP equal to 1 process, export -> load, and clear errors for bad input."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from drafter_util import random_drafter, tiny_target
from train_util import make_chat_target, write_dataset

from specscope.cli import main
from specscope.errors import SpecscopeError
from specscope.train.data import CapturedData, read_conversations, tokenize_conversation

TRAIN_ARGS = ["--stages", "train", "--ttt-steps", "3", "--steps", "10", "--batch-size", "4", "--lr", "3e-3",
              "--warmup", "2", "--eval-every", "5", "--ckpt-every", "2", "--threads", "1", "--no-progress",
              "--export-dtype", "fp32"]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Target, dataset, and a work directory with the data and vocab stages done."""
    root = tmp_path_factory.mktemp("train")
    tgt = make_chat_target(root / "target")
    ds = write_dataset(root / "ds.jsonl")
    work = root / "work"
    main(["train", "--workdir", str(work), "--target", str(tgt), "--dataset", str(ds), "--stages", "data,vocab",
          "--draft-vocab", "64", "--device", "cpu"])
    return tgt, ds, work


def _cli(args, env_extra=None, **kw):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.Popen([sys.executable, "-m", "specscope", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kw)


def _copy_prepared(work, dest):
    import shutil

    shutil.copytree(work, dest, ignore=shutil.ignore_patterns("train", "drafter"))
    return dest


def _final_params(work):
    ck = work / "train" / "checkpoints"
    st = torch.load(ck / (ck / "latest").read_text(), weights_only=False)
    return st


def test_data_stage_outputs(prepared):
    tgt, ds, work = prepared
    man = json.loads((work / "data" / "manifest.json").read_text())
    assert man["sequences"] == 24 and man["aux_layers"] == [2, 4, 5] and man["aux_convention"] == "input"
    data = CapturedData(work / "data")
    s = data.seqs[0]
    assert s["aux"].shape == (len(s["input_ids"]), 3, 64) and s["hidden"].dtype == torch.float16
    v = torch.load(work / "vocab.pt", weights_only=True)
    ids = torch.arange(64) + v["d2t"]
    assert torch.equal(ids, ids.sort().values) and int(v["t2d"].sum()) == 64 and bool(v["t2d"][ids].all())
    counts = torch.zeros(101, dtype=torch.long)
    for q in data.seqs:
        counts += torch.bincount(q["input_ids"].long()[q["loss_mask"].bool()], minlength=101)
    assert v["coverage"] == pytest.approx(float(counts.sort(descending=True).values[:64].sum() / counts.sum()))
    assert counts[ids].min() >= counts[~v["t2d"]].max()          # the most frequent ids were chosen
    # resumable: a second run keeps the shards it already has
    shard = next((work / "data").glob("shard-*.safetensors"))
    mtime = shard.stat().st_mtime_ns
    main(["train", "--workdir", str(work), "--target", str(tgt), "--dataset", str(ds), "--stages", "data",
          "--device", "cpu"])
    assert shard.stat().st_mtime_ns == mtime


def test_loss_mask_is_assistant_only(prepared):
    from specscope.runtime.tokenizer import Tokenizer

    tok = Tokenizer(prepared[0])
    msgs = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"},
            {"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]
    ids, mask = tokenize_conversation(tok, msgs, 100)
    assert [tok.tok.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m] == \
        ["w3", "w4", "<|im_end|>", "w6", "<|im_end|>"]


def test_kill_resume_and_ddp_match(prepared, tmp_path):
    tgt, _, work = prepared
    common = ["train", "--target", str(tgt), "--device", "cpu", *TRAIN_ARGS]
    a = _copy_prepared(work, tmp_path / "a")
    b = _copy_prepared(work, tmp_path / "b")
    c = _copy_prepared(work, tmp_path / "c")
    pa = _cli([*common, "--workdir", str(a)])
    # b: SIGKILL as soon as the first checkpoint exists, then --resume
    pb = _cli([*common, "--workdir", str(b)])
    latest = b / "train" / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and pb.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    pb.send_signal(signal.SIGKILL)
    pb.wait()
    killed_at = int(latest.read_text().split("-")[1].split(".")[0])
    assert killed_at < 10, "the run finished before it could be killed"
    pb2 = _cli([*common, "--workdir", str(b), "--resume"])
    out_b, err_b = pb2.communicate(timeout=600)
    assert pb2.returncode == 0, err_b
    assert f"resumed from ckpt-{killed_at:07d}.pt" in err_b or "resumed from" in err_b
    out_a, err_a = pa.communicate(timeout=600)
    assert pa.returncode == 0, err_a
    # no terminal, no bar: log lines with the rate and the time left ("done" on the last), and the evaluations
    assert re.search(r"^train step 10/10 \([\d.]+/s, (done|\d+:\d\d left)\)", err_a, re.M), err_a
    assert "step 5: held-out acc_0" in err_a, err_a
    # c: two processes over gloo, each with half of every global batch
    import socket

    with socket.socket() as sock:          # a free port: other test runs may use torchrun at the same time
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    pc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-port", str(port), "-m", "specscope", *common, "--workdir", str(c)],
                        capture_output=True, text=True, timeout=900)
    assert pc.returncode == 0, pc.stderr[-3000:]
    sa, sb, sc = _final_params(a), _final_params(b), _final_params(c)
    assert sa["step"] == sb["step"] == sc["step"] == 10
    for k in sa["model"]:
        torch.testing.assert_close(sb["model"][k], sa["model"][k], rtol=0, atol=1e-6)
        torch.testing.assert_close(sc["model"][k], sa["model"][k], rtol=1e-4, atol=1e-5)
    # the resumed curve is the uninterrupted one: same steps logged once, same losses
    ma = [json.loads(l) for l in (a / "train" / "metrics.jsonl").read_text().splitlines()]
    mb = [json.loads(l) for l in (b / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["split"]) for m in ma] == [(m["step"], m["split"]) for m in mb]
    assert [round(m.get("loss", 0), 5) for m in ma] == [round(m.get("loss", 0), 5) for m in mb]
    assert (a / "train" / "checkpoints" / "best.pt").exists()
    evals = [m for m in ma if m["split"] == "eval"]
    assert len(evals) == 2 and all(len(m["acc"]) == 3 for m in evals)
    train = [m for m in ma if m["split"] == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    # the exported drafter (written at the end of training) loads and equals the final checkpoint
    from specscope.models import load_model
    from specscope.speculative.formats import load_drafter

    d = load_drafter(a / "drafter", load_model(tgt, "fp32", "cpu"))
    for k, v in d.state_dict().items():
        assert torch.equal(v.cpu(), sa["model"][k]), k


def test_export_round_trip(prepared, tmp_path):
    tgt, _, work = prepared
    w = _copy_prepared(work, tmp_path / "w")
    main(["train", "--workdir", str(w), "--target", str(tgt), "--device", "cpu", *TRAIN_ARGS, "--steps", "2"])
    from specscope.speculative.formats import load_drafter

    st = _final_params(w)
    for fmt in ("speculators", "sglang"):
        main(["export", str(w), "--format", fmt, "--out", str(tmp_path / fmt)])
        raw = json.loads((tmp_path / fmt / "config.json").read_text())
        assert ("speculators_model_type" in raw) == (fmt == "speculators")
        d = load_drafter(tmp_path / fmt)
        for k, v in d.state_dict().items():
            assert torch.equal(v, st["model"][k]), k
    # --init fine-tunes an exported drafter (speculators layout here): training starts from its weights
    w2 = _copy_prepared(work, tmp_path / "w2")
    main(["train", "--workdir", str(w2), "--target", str(tgt), "--device", "cpu", *TRAIN_ARGS, "--steps", "1",
          "--lr", "1e-9", "--init", str(tmp_path / "speculators")])
    st2 = _final_params(w2)
    torch.testing.assert_close(st2["model"]["fc.weight"], st["model"]["fc.weight"], rtol=0, atol=1e-6)
    assert torch.equal(st2["model"]["d2t"], st["model"]["d2t"])
    # a drafter directory converts between formats too
    main(["export", str(tmp_path / "speculators"), "--format", "sglang", "--out", str(tmp_path / "again")])
    assert torch.equal(load_drafter(tmp_path / "again").fc.weight, st["model"]["fc.weight"])


def test_the_held_out_tau_says_what_it_rests_on(prepared, tmp_path, capsys):
    # 5 % of 24 conversations: one held out; its τ is printed with that count and called too few to trust
    tgt, _, work = prepared
    w = _copy_prepared(work, tmp_path / "w")
    main(["train", "--workdir", str(w), "--target", str(tgt), "--device", "cpu", *TRAIN_ARGS, "--steps", "2"])
    err = capsys.readouterr().err
    assert re.search(r"^step 2: held-out acc_0 [\d.]+ sim τ [\d.]+ chain τ [\d.]+ over 1 conversation, [1-9]\d* "
                     r"positions \(too few to trust\)$", err, re.M), err
    assert "warning: the held-out τ rests on 1 of 24 conversations (fewer than 20): too few to trust" in err
    assert "train on more conversations (at least 40 for --eval-fraction 0.5)" in err
    from specscope.train.ttt import heldout_warning

    # the run that misled: 2 of 48 conversations held out (5 %); 20 need --eval-fraction 0.42
    assert heldout_warning(2, 48).endswith("hold out more with --eval-fraction 0.42")
    assert heldout_warning(20, 400) is None


def test_init_incompatible_drafter(prepared, tmp_path, capsys):
    from specscope.speculative.formats import save_drafter

    tgt, _, work = prepared
    other = tiny_target(tmp_path, layers=8, hidden=48)
    save_drafter(random_drafter(other), tmp_path / "bad")
    with pytest.raises(SystemExit) as e:
        main(["train", "--workdir", str(tmp_path / "w"), "--target", str(tgt), "--device", "cpu",
              "--init", str(tmp_path / "bad"), "--stages", "train"])
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("error: --init ") and "hidden size 48" in err and "is 64" in err


def test_bad_jsonl(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n'
                 "not json\n"
                 '{"conversations": [{"from": "human", "value": "w1"}]}\n'
                 '{"foo": 1}\n'
                 '{"messages": [{"role": "wizard", "content": "w1"}]}\n\n')
    convs, rep = read_conversations(f)
    assert len(convs) == 1 and rep.lines == 5 and rep.malformed == 3 and rep.no_assistant == 1
    assert "skipped 3 malformed and 1 without an assistant turn" in rep.summary()
    assert rep.first_errors[0] == "line 2: not valid JSON"
    f.write_text("nope\n[1, 2]\n")
    with pytest.raises(SpecscopeError, match="no usable conversation .*2 malformed"):
        read_conversations(f)
    f.write_text('{"conversations": [{"from": "human", "value": "hi"}]}\n')
    with pytest.raises(SpecscopeError, match="1 without an assistant turn"):
        read_conversations(f)


def test_cli_errors(prepared, tmp_path, capsys):
    tgt = prepared[0]
    with pytest.raises(SystemExit):
        main(["train", "--workdir", str(tmp_path / "w"), "--target", str(tgt), "--device", "cpu"])
    assert "needs --prompt-file FILE, --dataset FILE|DIR|ID or --synth N" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--workdir", str(tmp_path / "w"), "--target", str(tgt), "--stages", "train,bogus"])
    assert "--stages takes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--workdir", str(tmp_path / "w2"), "--target", str(tgt), "--device", "cpu",
              "--stages", "train"])
    assert "has no manifest.json; run the data stage first" in capsys.readouterr().err


def test_regenerate_replaces_assistant_turns(prepared, tmp_path):
    tgt, ds, _ = prepared
    work = tmp_path / "r"
    main(["train", "--workdir", str(work), "--target", str(tgt), "--dataset", str(ds), "--stages", "data",
          "--regenerate", "greedy", "--response-tokens", "8", "--device", "cpu"])
    orig, _ = read_conversations(ds)
    regen, _ = read_conversations(work / "regenerated.jsonl")
    assert len(regen) == len(orig)
    assert [c[0] for c in regen] == [c[0] for c in orig]                 # same user turns
    assert all(len(c) == 2 and c[1]["role"] == "assistant" for c in regen)
    assert sum(c[1]["content"] != o[1]["content"] for c, o in zip(regen, orig)) > len(orig) // 2
    assert json.loads((work / "data" / "manifest.json").read_text())["sequences"] == len(orig)


def test_capture_extends_partial_last_shard(prepared, tmp_path):
    from specscope.runtime.tokenizer import Tokenizer
    from specscope.models import load_model
    from specscope.train.data import capture

    tgt, ds, _ = prepared
    model, tok = load_model(tgt, "fp32", "cpu"), Tokenizer(tgt)
    convs, _ = read_conversations(ds)
    m = capture(model, tok, convs[:5], tmp_path / "d", [2, 4, 5], shard_size=4)
    assert [s["sequences"] for s in m["shards"]] == [4, 1]
    first = (tmp_path / "d" / "shard-00000.safetensors").stat().st_mtime_ns
    m = capture(model, tok, convs[:8], tmp_path / "d", [2, 4, 5], shard_size=4)
    assert [s["sequences"] for s in m["shards"]] == [4, 4] and m["sequences"] == 8
    assert (tmp_path / "d" / "shard-00000.safetensors").stat().st_mtime_ns == first
    assert len(CapturedData(tmp_path / "d")) == 8
    assert len(CapturedData(tmp_path / "d").seqs) == 8
    m = capture(model, tok, convs[:4], tmp_path / "d", [2, 4, 5], shard_size=4)   # fewer: only those are listed
    assert m["sequences"] == 4 and len(CapturedData(tmp_path / "d")) == 4
    # the same count but other conversations in the first shard (a prompt file added in front): captured again
    swapped = convs[4:8] + convs[:4]
    capture(model, tok, swapped, tmp_path / "d", [2, 4, 5], shard_size=4)
    assert (tmp_path / "d" / "shard-00000.safetensors").stat().st_mtime_ns != first
    want = sorted(len(tokenize_conversation(tok, c, 1024)[0]) for c in swapped[:4])
    assert sorted(len(q["input_ids"]) for q in CapturedData(tmp_path / "d").seqs[:4]) == want


def test_synth_only_work_directory_is_adopted_not_overwritten(tmp_path):
    """A synth-only work directory from before synth.jsonl (Magpie conversations appended to conversations.jsonl,
    state beside it) moves to synth.jsonl, where synthesis resumes and --prompt-file runs assemble from; a directory
    already in the new layout, or a plain assembled conversations.jsonl, is left as it is."""
    from specscope.train.pipeline import _adopt_synth_only_layout

    out, synth = tmp_path / "conversations.jsonl", tmp_path / "synth.jsonl"
    lines = "".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"},
                                             {"role": "assistant", "content": "a"}], "source": "magpie"}) + "\n"
                    for i in range(3))
    answers = json.dumps({"id": "gsm8k:0", "source": "gsm8k", "messages": []}) + "\n"
    out.write_text(answers + lines)                 # already reassembled by an older --prompt-file run: stays put
    (tmp_path / "conversations.jsonl.state.json").write_text('{"next_batch": 1, "seed": 1}')
    _adopt_synth_only_layout(out, synth, log=lambda m: None)
    assert out.read_text() == answers + lines and not synth.exists()
    out.write_text(lines)
    (tmp_path / "conversations.jsonl.state.json").write_text('{"next_batch": 1, "seed": 1}')
    _adopt_synth_only_layout(out, synth, log=lambda m: None)
    assert synth.read_text() == lines and not out.exists()
    assert json.loads((tmp_path / "synth.jsonl.state.json").read_text())["next_batch"] == 1
    out.write_text("assembled\n")                     # the new layout: nothing moves again
    _adopt_synth_only_layout(out, synth, log=lambda m: None)
    assert out.read_text() == "assembled\n" and synth.read_text() == lines
