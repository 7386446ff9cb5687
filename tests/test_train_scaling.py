"""Training the way users run it: a device per torchrun process, epochs beside steps, SpecForge's flag spellings,
and an optional experiment tracker."""

import importlib.util
import json
import socket
import subprocess
import sys

import pytest
from cli_util import cli, one_error_line
from train_util import make_chat_target, write_dataset

from specscope.cli import main
from specscope.errors import SpecscopeError
from specscope.train.trainer import rank_device, total_steps_for


def test_rank_device_logic():
    assert rank_device("auto", None, 0) == "cpu" and rank_device("auto", 1, 0) == "cpu"
    assert rank_device("cpu", 3, 8) == "cpu"
    assert rank_device("auto", None, 2) == "cuda"                 # one process: the current device
    assert [rank_device("auto", r, 4) for r in range(4)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert rank_device("cuda", 1, 2) == "cuda:1"
    with pytest.raises(SpecscopeError, match="LOCAL_RANK=2 but only 2 CUDA"):
        rank_device("cuda", 2, 2)
    with pytest.raises(SpecscopeError, match="no CUDA device"):
        rank_device("cuda", 0, 0)


RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from specscope.train.trainer import process_device, rank_device
dist.init_process_group("gloo")
lr = int(os.environ["LOCAL_RANK"])
mine = {"rank": dist.get_rank(), "local_rank": lr, "on_2_gpus": rank_device("auto", lr, 2),
        "cuda_on_8_gpus": rank_device("cuda", lr, 8), "here": str(process_device("auto"))}
got = [None] * dist.get_world_size()
dist.all_gather_object(got, mine)
if dist.get_rank() == 0:
    open(sys.argv[1], "w").write(json.dumps(got))
dist.destroy_process_group()
"""


def test_two_processes_get_distinct_devices(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), str(script), str(tmp_path / "out.json")], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = sorted(json.loads((tmp_path / "out.json").read_text()), key=lambda r: r["rank"])
    assert [r["local_rank"] for r in got] == [0, 1]
    assert [r["on_2_gpus"] for r in got] == ["cuda:0", "cuda:1"]
    assert [r["cuda_on_8_gpus"] for r in got] == ["cuda:0", "cuda:1"]
    assert [r["here"] for r in got] == ["cpu", "cpu"]           # this machine has no GPU: both train on the CPU


def test_total_steps_for_epochs_and_steps():
    assert total_steps_for(None, None, 100, 8) == 1000
    assert total_steps_for(50, None, 100, 8) == 50
    assert total_steps_for(None, 2, 100, 8) == 24                 # 12 steps an epoch (100 // 8)
    assert total_steps_for(None, 0.5, 100, 8) == 6
    assert total_steps_for(10, 2, 100, 8) == 10 and total_steps_for(100, 2, 100, 8) == 24
    assert total_steps_for(None, 1, 3, 8) == 1                    # fewer sequences than a batch: still one step


def _params(*args):
    from specscope.cli.train import train

    return train.make_context("train", list(args)).params


def test_specforge_flags_parse_to_the_same_configuration(tmp_path):
    common = ["--workdir", str(tmp_path / "w"), "--stages", "train"]
    ours = _params(*common, "--model", "Qwen/Qwen3-8B", "--dataset", "sharegpt.jsonl", "--num-epochs", "2",
                   "--lr", "1e-4", "--max-len", "2048", "--ttt-steps", "7", "-o", "out", "--report-to", "tensorboard")
    specforge = _params(*common, "--target-model-path", "Qwen/Qwen3-8B", "--train-data-path", "sharegpt.jsonl",
                        "--num-epochs", "2", "--learning-rate", "1e-4", "--max-length", "2048", "--ttt-length", "7",
                        "--output-dir", "out", "--report-to", "tensorboard")
    assert specforge == ours
    assert (ours["target_name"], ours["dataset"], ours["num_epochs"], ours["lr"], ours["max_len"], ours["ttt_steps"],
            ours["output"], ours["report_to"]) == ("Qwen/Qwen3-8B", "sharegpt.jsonl", 2.0, 1e-4, 2048, 7, "out",
                                                   "tensorboard")
    assert ours["total_steps"] is None                            # the epochs decide
    assert _params(*common)["total_steps"] is None and _params(*common)["num_epochs"] is None


def test_help_lists_specforge_spellings(capsys):
    code, out, _ = cli(capsys, "train", "--help")
    assert code == 0
    for flag in ("--target-model-path", "--train-data-path", "--num-epochs", "--learning-rate", "--max-length",
                 "--ttt-length", "--output-dir", "--report-to"):
        assert flag in out, flag


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_report_to_missing_library_is_one_error_line(tmp_path, capsys):
    line = one_error_line(*cli(capsys, "train", "--workdir", tmp_path / "w", "--stages", "train", "--report-to",
                               "wandb", "--model", tmp_path / "nowhere")[::2])
    assert "--report-to wandb needs the wandb package" in line and "pip install wandb" in line


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_epochs_and_tensorboard(tmp_path):
    tgt = make_chat_target(tmp_path / "target")
    ds = write_dataset(tmp_path / "ds.jsonl", n=20)
    work = tmp_path / "work"
    main(["train", "--workdir", str(work), "--target-model-path", str(tgt), "--train-data-path", str(ds),
          "--stages", "data,vocab,train", "--draft-vocab", "64", "--device", "cpu", "--ttt-length", "2",
          "--num-epochs", "2", "--batch-size", "4", "--eval-fraction", "0.1", "--eval-every", "4",
          "--learning-rate", "3e-3", "--warmup", "2", "--threads", "1", "--no-progress", "--export-dtype", "fp32",
          "--report-to", "tensorboard", "--output-dir", str(tmp_path / "drafter")])
    recs = [json.loads(line) for line in (work / "train" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["split"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))           # 18 training conversations // 4 = 4 a pass
    assert (tmp_path / "drafter" / "config.json").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ev = EventAccumulator(str(work / "train" / "tensorboard"))
    ev.Reload()
    tags = ev.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/acc_0", "eval/chain_tau"} <= set(tags)
    assert [e.step for e in ev.Scalars("train/loss")] == list(range(1, 9))
    assert ev.Scalars("train/loss")[-1].value == pytest.approx(train[-1]["loss"], rel=1e-6)
