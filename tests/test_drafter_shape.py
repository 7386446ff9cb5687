"""A drafter directory may declare its best measured shape (specscope_shape.json): used when no knob is given."""

import json

import pytest

from specscope.errors import SpecscopeError
from specscope.speculative.decode import SHAPE_FILE, SpecConfig


def test_declared_shape_used_only_without_knobs(tmp_path):
    (tmp_path / SHAPE_FILE).write_text(json.dumps({"steps": 5, "topk": 4, "draft_tokens": 12}))
    assert SpecConfig.for_drafter(str(tmp_path)) == SpecConfig(5, 4, 12)
    assert SpecConfig.for_drafter(str(tmp_path), steps=3) == SpecConfig.from_knobs(steps=3)
    assert SpecConfig.for_drafter("ngram") == SpecConfig.from_knobs()
    (tmp_path / SHAPE_FILE).unlink()
    assert SpecConfig.for_drafter(str(tmp_path)) == SpecConfig.from_knobs()


@pytest.mark.parametrize("body", ['{"steps": 5}', "not json", '{"steps": 2, "topk": 1, "draft_tokens": 9}'])
def test_bad_shape_file_is_one_clear_error(tmp_path, body):
    (tmp_path / SHAPE_FILE).write_text(body)
    with pytest.raises(SpecscopeError, match="shape file|draft-tokens"):
        SpecConfig.for_drafter(str(tmp_path))


def test_shipped_drafter_declares_a_valid_shape():
    cfg = SpecConfig.for_drafter("smollm2-135m-eagle3")
    cfg.validate()
    assert cfg != SpecConfig.from_knobs()


def test_drafting_options_are_declared_once():
    """generate's, the demo's, serve's and tune's requests embed the one DraftOptions instead of each declaring
    --draft and its knobs."""
    import dataclasses

    from specscope.demo import DemoOptions
    from specscope.economics.tune_session import TuneRequest
    from specscope.server.worker import ServeConfig
    from specscope.session import GenerateRequest
    from specscope.speculative.decode import DraftOptions

    knobs = {"draft", "steps", "topk", "draft_tokens", "ngram_tokens", "draft_budget"}
    for cls in (GenerateRequest, DemoOptions, ServeConfig, TuneRequest):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        assert not knobs & set(fields), cls.__name__
        assert isinstance(cls().drafting, DraftOptions), cls.__name__
    assert ServeConfig().drafting.budget == TuneRequest().drafting.budget == "fixed"
    assert GenerateRequest().drafting.budget == DemoOptions().drafting.budget == "priced"


def test_checked_options_carry_their_shape(tmp_path):
    """DraftOptions.checked() is the drafting a run uses: the flags as given plus the shape they resolve to (the
    declared one without knobs), and decode_spec takes it as it is."""
    from specscope.speculative.decode import DraftOptions

    (tmp_path / SHAPE_FILE).write_text(json.dumps({"steps": 5, "topk": 4, "draft_tokens": 12}))
    opts = DraftOptions("ngram", steps=3)
    checked = opts.checked()
    assert checked.shape == SpecConfig.from_knobs(steps=3) and checked.draft == "ngram" and opts.shape is None
    assert DraftOptions(str(tmp_path)).checked().shape == SpecConfig(5, 4, 12)
    assert DraftOptions().checked() is None
    with pytest.raises(SpecscopeError, match="need --draft"):
        DraftOptions(topk=2).checked()
    with pytest.raises(SpecscopeError, match="--draft-budget must be one of"):
        DraftOptions("ngram", budget="cheap").checked()
