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
