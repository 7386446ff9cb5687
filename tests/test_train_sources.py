"""Training prompt sources: record shapes -> user turns, the evaluation-overlap refusal, the Magpie quality filter,
and the data stage's files surviving torn lines and same-named prompt files."""

import json

import pytest

from specscope.errors import SpecscopeError
from specscope.train.data import open_for_append, read_jsonl
from specscope.train.pipeline import gather_prompts
from specscope.train.sources import EvalOverlap, read_user_turns, user_turn, user_turn_problem


def test_record_shapes_give_their_user_turn():
    assert user_turn({"question": "How many?", "answer": "3"}) == "How many?"
    assert user_turn({"instruction": "Sort these.", "instances": [{"input": "b a", "output": "a b"}]}) == \
        "Sort these.\n\nb a"
    assert user_turn({"instruction": "Say hi.", "instances": [{"input": "", "output": "hi"}]}) == "Say hi."
    assert user_turn({"turns": ["first", "second"]}) == "first"
    assert user_turn({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}) == "u"
    with pytest.raises(ValueError, match="no prompt field"):
        user_turn({"text": 3})


def test_read_user_turns_counts_what_it_skips(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a real prompt"}\nnot json\n{"other": 1}\n{"prompt": ""}\n')
    texts, rep = read_user_turns(f)
    assert texts == ["a real prompt"] and rep.lines == 4 and sum(rep.skipped.values()) == 3
    f.write_text("not json\n")
    with pytest.raises(SpecscopeError, match="no usable prompt"):
        read_user_turns(f)


def test_eval_overlap_refuses_evaluation_prompts_and_near_copies():
    ov = EvalOverlap()                       # the packaged Spec-Bench + EAGLE GSM8K / HumanEval sets
    mt1 = json.loads(next(open(ov.files[0])))["turns"][0]
    assert ov.problem(mt1) == "same text as an evaluation prompt"
    assert "10-word span" in ov.problem("Please help: " + mt1.upper() + " Thanks!")
    assert ov.problem("Write a limerick about a cat who learns to code in Rust.") is None


def test_magpie_quality_filter():
    assert user_turn_problem("What's the best way to prepare for a job interview?") is None
    assert user_turn_problem("hi there") == "too short"
    assert user_turn_problem("Write a poem about the sea " + "sea " * 30) == "repetitive"
    assert user_turn_problem("Сколько будет два плюс два, скажи пожалуйста?") == "not English"


def test_same_named_prompt_files_keep_distinct_ids(tmp_path):
    (tmp_path / "a").mkdir(); (tmp_path / "b").mkdir()
    (tmp_path / "a" / "train.jsonl").write_text('{"prompt": "first file prompt one"}\n')
    (tmp_path / "b" / "train.jsonl").write_text('{"prompt": "second file prompt one"}\n')
    items, rep = gather_prompts([tmp_path / "a" / "train.jsonl", tmp_path / "b" / "train.jsonl"], EvalOverlap(),
                                log=lambda m: None)
    assert len({it["id"] for it in items}) == 2


def test_append_after_a_torn_line_starts_clean(tmp_path):
    f = tmp_path / "answers.jsonl"
    f.write_text('{"id": "a", "x": 1}\n{"id": "b", "x": ')          # killed mid-write
    with open_for_append(f) as out:
        out.write(json.dumps({"id": "c", "x": 3}) + "\n")
    assert [r["id"] for r in read_jsonl(f)] == ["a", "c"]
    assert f.read_text().count("\n") == 2


def test_a_kill_inside_a_multibyte_character_is_a_torn_line(tmp_path):
    f = tmp_path / "synth.jsonl"
    whole = json.dumps({"id": "a", "x": "naïve"}, ensure_ascii=False) + "\n"
    f.write_bytes(whole.encode() + json.dumps({"id": "b", "x": "café"}, ensure_ascii=False).encode()[:-3])
    assert [r["id"] for r in read_jsonl(f)] == ["a"]
    with open_for_append(f) as out:
        out.write(json.dumps({"id": "c", "x": "ok"}) + "\n")
    assert [r["id"] for r in read_jsonl(f)] == ["a", "c"]
