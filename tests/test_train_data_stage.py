"""The data stage tells the truth: progress rates count only this run's work (not what a resumed run found done),
and `--dataset --regenerate` caches its answers in a file of its own, keyed by what produced them."""

import json
import time

import pytest
from train_util import make_chat_target, write_dataset

from specscope.train.data import capture, read_conversations
from specscope.train.pipeline import regenerated
from specscope.train.tracking import Rate


def _rate(line: str) -> float:
    return float(line.split("(")[1].split("/s")[0])


def test_rate_counts_only_this_runs_work():
    lines = []
    r = Rate("answered", 100, lines.append, every_s=0)
    r(50)                                        # found done: the baseline, not speed
    assert lines == ["answered 50/100 already done (resumed)"]
    time.sleep(0.25)
    r(60, force=True)
    rate = _rate(lines[-1])
    assert rate <= 10 / 0.25 * 1.05, lines[-1]   # 10 done in >= 0.25 s; counting the 50 would give >= 240/s
    assert "left" in lines[-1]
    fresh = []
    Rate("captured", 10, fresh.append, every_s=0)(0)
    assert fresh == []                           # nothing done before: no resume line


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    from specscope.runtime.tokenizer import Tokenizer
    from specscope.models import load_model

    root = tmp_path_factory.mktemp("data-stage")
    tgt = make_chat_target(root / "target")
    return load_model(tgt, "fp32", "cpu"), Tokenizer(tgt), root


def test_capture_reports_resumed_work_first(chat, tmp_path):
    model, tok, root = chat
    convs, _ = read_conversations(write_dataset(tmp_path / "ds.jsonl", n=12))
    capture(model, tok, convs[:8], tmp_path / "d", [2, 4, 5], shard_size=4)
    calls = []
    capture(model, tok, convs, tmp_path / "d", [2, 4, 5], shard_size=4, progress=calls.append)
    assert calls == [8, 12]                      # 8 found captured (reported before any work), then this run's 4


def test_regenerate_cache_is_its_own_file_keyed_by_inputs(chat, tmp_path):
    model, tok, root = chat
    a, _ = read_conversations(write_dataset(tmp_path / "a.jsonl", n=3, seed=1))
    b, _ = read_conversations(write_dataset(tmp_path / "b.jsonl", n=3, seed=2))
    work = tmp_path / "w"
    work.mkdir()
    # a conversations.jsonl assembled from other sources is never taken for the regenerated dataset
    (work / "conversations.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "w1"},
                                                                        {"role": "assistant", "content": "w2"}]}))
    logs = []
    ra = regenerated(work, a, model, tok, "greedy", 8, 0, 4, logs.append)
    assert [c[0] for c in ra] == [c[0] for c in a] and (work / "regenerated.jsonl").exists()
    assert not any("reusing" in m for m in logs)
    again = regenerated(work, a, model, tok, "greedy", 8, 0, 4, logs.append)
    assert again == ra and "reusing 3 regenerated conversations" in logs[-1]
    # another dataset (or another answer length) in the same work directory: regenerated, not reused
    rb = regenerated(work, b, model, tok, "greedy", 8, 0, 4, logs.append)
    assert [c[0] for c in rb] == [c[0] for c in b]
    assert [c[0] for c in regenerated(work, b, model, tok, "greedy", 9, 0, 4, logs.append)] == [c[0] for c in b]
    assert sum("reusing" in m for m in logs) == 1


def test_streamed_features_equal_in_memory_ones(chat, tmp_path):
    import torch

    from specscope.train.data import CapturedData

    model, tok, root = chat
    convs, _ = read_conversations(write_dataset(tmp_path / "ds.jsonl", n=10))
    capture(model, tok, convs, tmp_path / "d", [2, 4, 5], shard_size=4)
    streamed, loaded = CapturedData(tmp_path / "d"), CapturedData(tmp_path / "d", stream=False)
    assert streamed.stream and not loaded.stream and len(streamed) == len(loaded) == 10
    assert streamed.tokens == loaded.tokens
    for i in range(10):
        a, b = streamed.seqs[i], loaded.seqs[i]
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in b), i
    assert [len(s["input_ids"]) for s in streamed.seqs[-3:]] == [len(s["input_ids"]) for s in loaded.seqs[-3:]]
    assert set(streamed.read(3, ("loss_mask",))) == {"loss_mask"}


@pytest.mark.parametrize("tie", [False, True])
def test_target_head_reads_only_what_training_needs(tmp_path, tie):
    import torch
    from tiny import make_hf_model

    from specscope.models import load_model
    from specscope.train.pipeline import TargetHead

    make_hf_model(tmp_path / "m", "llama", layers=2, tie=tie)
    full, head = load_model(tmp_path / "m", "fp32", "cpu"), TargetHead(tmp_path / "m")
    for part in ("embed_tokens", "lm_head", "norm"):
        assert torch.equal(getattr(head, part).weight, getattr(full, part).weight.float()), part
    assert head.config == full.config and head.device == torch.device("cpu")


def test_batched_generate_is_plain_greedy_generate(chat, tmp_path):
    """The data stage's batched decoding runs through the engine's loop: each greedy row is exactly what plain
    `generate` decodes for that prompt alone, whatever the other rows' lengths, a stop token included where a row
    stops early."""
    from specscope.generate import generate
    from specscope.runtime.sampling import SamplingParams
    from specscope.train.data import batched_generate

    model, tok, root = chat
    convs, _ = read_conversations(write_dataset(tmp_path / "ds.jsonl", n=5, seed=4))
    prompts = [tok.encode_messages(c[:1], add_generation_prompt=True) for c in convs]
    assert len({len(p) for p in prompts}) > 1                 # rows of different lengths
    greedy = SamplingParams()
    stop = [generate(model, prompts[0], 12, greedy).token_ids[3]]   # row 0 stops at its 4th token
    alone = [generate(model, p, 12, greedy, stop).token_ids for p in prompts]
    assert alone[0][-1] == stop[0] and len(alone[0]) <= 4
    assert batched_generate(model, prompts, 12, greedy, stop) == alone


def test_batched_sampling_is_seeded_by_the_generator(chat):
    """Sampled rows draw from the batch's generator: the same seed decodes the same rows (a resumed synthesis
    writes what an uninterrupted one would), another seed other rows."""
    import torch

    from specscope.runtime.sampling import SamplingParams
    from specscope.train.data import batched_generate

    model, tok, root = chat
    prompts = [tok.encode_messages([{"role": "user", "content": w}], add_generation_prompt=True)
               for w in ("w1 w2", "w3 w4 w5 w6", "w7")]
    sp = SamplingParams(temperature=1.0)

    def run(seed):
        return batched_generate(model, prompts, 10, sp, tok.eos_ids, torch.Generator().manual_seed(seed))

    first = run(7)
    assert run(7) == first and run(8) != first and [len(r) for r in first] != [0, 0, 0]
