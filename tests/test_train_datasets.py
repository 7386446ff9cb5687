"""`train --dataset` through Hugging Face datasets: Parquet, JSON and directories (with splits) read to the same
conversations as the JSONL reader, in every supported record shape, with bad records counted and clear errors."""

import json

import pytest
from cli_util import cli, one_error_line
from train_util import make_chat_target, write_dataset

from specscope.errors import SpecscopeError
from specscope.train.data import read_conversations
from specscope.train.datasets import load_conversations


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _specforge(recs):
    """SpecForge's shape: conversations with role/content turns, and an id column."""
    out = []
    for i, r in enumerate(recs):
        turns = r.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}[t["from"]],
                                       "content": t["value"]} for t in r["conversations"]]
        out.append({"id": f"q{i}", "conversations": turns})
    return out


def test_parquet_and_jsonl_directory_match_the_jsonl_reader(tmp_path):
    import datasets

    src = write_dataset(tmp_path / "ds.jsonl", n=10)               # ShareGPT and OpenAI records mixed
    want, _ = read_conversations(src)
    recs = _records(src)
    # Parquet, one shape per file as Arrow requires: ShareGPT, then OpenAI, then SpecForge
    for name, rows in (("sharegpt", [r for r in recs if "conversations" in r]),
                       ("openai", [r for r in recs if "messages" in r]), ("specforge", _specforge(recs))):
        f = tmp_path / f"{name}.parquet"
        datasets.Dataset.from_list(rows).to_parquet(str(f))
        convs, rep = load_conversations(str(f))
        expect = want if name == "specforge" else [c for c, r in zip(want, recs) if name in ("sharegpt",) and
                                                   "conversations" in r or name == "openai" and "messages" in r]
        assert convs == expect and rep.unit == "record" and rep.ok == len(rows), name
    # a directory of JSONL files, split by name, read by datasets (mixed shapes in one file included)
    d = tmp_path / "dir"
    d.mkdir()
    (d / "train.jsonl").write_text(src.read_text())
    (d / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:3]))   # one schema across splits
    assert load_conversations(str(d))[0] == want
    assert load_conversations(str(d), split="test")[0] == want[:3]
    with pytest.raises(SpecscopeError, match="cannot load --dataset .*validation"):
        load_conversations(str(d), split="validation")
    # a JSON array file
    (tmp_path / "a.json").write_text(json.dumps(recs))
    assert load_conversations(str(tmp_path / "a.json"))[0] == want
    # a save_to_disk directory
    datasets.DatasetDict({"train": datasets.Dataset.from_list(_specforge(recs))}).save_to_disk(str(tmp_path / "saved"))
    assert load_conversations(str(tmp_path / "saved"))[0] == want


def test_bad_records_are_counted_and_an_all_bad_dataset_is_an_error(tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]},
            {"messages": [{"role": "user", "content": "w1"}]},
            {"messages": [{"role": "wizard", "content": "w1"}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    convs, rep = load_conversations(str(tmp_path / "d.parquet"))
    assert len(convs) == 1 and rep.no_assistant == 1 and rep.malformed == 1
    assert "from 3 records" in rep.summary() and rep.first_errors[0] == "record 2: no assistant turn"
    datasets.Dataset.from_list([{"text": "hi"}]).to_parquet(str(tmp_path / "t.parquet"))
    with pytest.raises(SpecscopeError, match="no usable conversation .*1 malformed records.*record 1: has neither"):
        load_conversations(str(tmp_path / "t.parquet"))


def test_jsonl_keeps_its_line_numbers_and_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}\n'
                 "not json\n")
    convs, rep = load_conversations(str(f))
    assert len(convs) == 1 and rep.first_errors == ["line 2: not valid JSON"]


def test_cli_dataset_errors_before_the_target_loads(tmp_path, capsys, monkeypatch):
    from specscope.train import pipeline

    def no_load(*a, **k):
        raise AssertionError("the target was loaded before the dataset was checked")

    monkeypatch.setattr(pipeline, "load_target", no_load)
    tgt = make_chat_target(tmp_path / "target")   # its files are checked first; it is never loaded
    work = ["train", "--workdir", tmp_path / "w", "--stages", "data", "--model", tgt]
    line = one_error_line(*cli(capsys, *work, "--dataset", tmp_path / "nope.parquet")[::2])
    assert "nope.parquet" in line and "does not exist" in line
    line = one_error_line(*cli(capsys, *work, "--dataset", "nobody/no-such-dataset")[::2])
    assert "cannot load --dataset 'nobody/no-such-dataset'" in line
    (tmp_path / "bad.json").write_text('[{"messages": 3}')
    line = one_error_line(*cli(capsys, *work, "--dataset", tmp_path / "bad.json")[::2])
    assert "bad.json" in line


def test_train_data_stage_from_parquet(tmp_path):
    import datasets

    from specscope.cli import main
    from specscope.train.data import CapturedData

    tgt = make_chat_target(tmp_path / "target")
    recs = _records(write_dataset(tmp_path / "ds.jsonl", n=6))
    datasets.Dataset.from_list(_specforge(recs)).to_parquet(str(tmp_path / "ds.parquet"))
    main(["train", "--workdir", str(tmp_path / "w"), "--target-model-path", str(tgt), "--train-data-path",
          str(tmp_path / "ds.parquet"), "--stages", "data", "--device", "cpu"])
    assert len(CapturedData(tmp_path / "w" / "data")) == 6
