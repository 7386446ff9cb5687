"""A decode command's default thread count follows the cores other processes leave free at its start (issue 51
item 3), says so in `generate --json` and in the run's fingerprint, and `--threads` still wins. The load is real:
one busy process per usable core (test_loaded_prices' fixture)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from cli_util import cli
from specscope.registry import open_registry
from test_loaded_prices import busy  # noqa: F401  (the fixture)
from tiny import make_hf_model, make_tiny_tokenizer

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="CPU accounting is read from Linux's /proc")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_hf_model(d, "llama")
    make_tiny_tokenizer(d)
    return d


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _gen(capsys, model, *extra):
    code, out, err = cli(capsys, "generate", "--model", model, "--prompt", "the quick brown fox",
                         "--max-new-tokens", 4, "--json", *extra)
    assert code == 0, err
    return json.loads(out)


def test_the_default_leaves_busy_cores_alone_and_says_why(busy, tiny, capsys, keep_threads):  # noqa: F811
    res = _gen(capsys, tiny)
    t = res["threads"]
    assert t["source"] == "free cores" and t["threads"] == 1 and t["usable"] == busy
    assert t["others_cores"] >= 0.5 * busy and "busy" in t["why"] and "--threads overrides" in t["why"]
    with open_registry() as reg:
        env = reg.get_run(res["run_id"])["env"]
    assert env["torch"]["threads"] == 1 and env["torch"]["threads_chosen"] == t["why"]


def test_threads_flag_wins_under_load(busy, tiny, capsys, keep_threads):  # noqa: F811
    want = busy + 1
    t = _gen(capsys, tiny, "--threads", want, "--no-record")["threads"]
    assert t["source"] == "--threads" and t["threads"] == want and torch.get_num_threads() == want
