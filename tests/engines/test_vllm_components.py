"""What a verify spends its time on, inside a real vLLM: the plugin's profiler windows on a random MoE (32 experts,
top-4) served by vLLM's CPU build with n-gram drafts — components that add up to the phase, and the experts each
step touched, equal to an independent count from the router's logits over the same steps.

The independent count is a forward pre-hook on each MoE layer (vLLM's MoERunner, called with the layer's hidden
states: vLLM 0.32 fuses the gate into its router) that computes the router logits itself from the checkpoint's gate
weights and takes their top-k, keyed by the plugin's step number; the plugin counts from vLLM's router capture hook
(the ids vLLM routed by). One process (VLLM_ENABLE_V1_MULTIPROCESSING=0), so both see the same steps.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from engine_util import make_moe
from components_util import adds_up

from specscope.ingest.core import ingest_file

EXPERTS, TOP_K = 32, 4

SCRIPT = r"""
import json, os, sys
if __name__ == "__main__":
    import torch
    from safetensors import safe_open
    from pathlib import Path
    from vllm import LLM, SamplingParams
    from specscope.plugins import vllm as plugin

    model, out, top_k = sys.argv[1], sys.argv[2], int(sys.argv[3])
    prompts = json.loads(sys.argv[4])
    seen = {}
    gates = {}
    for f in Path(model).glob("*.safetensors"):
        with safe_open(str(f), "pt") as t:
            for k in t.keys():
                if k.endswith("mlp.gate.weight"):
                    gates[int(k.split(".")[2])] = t.get_tensor(k).float()

    def hooks(net):
        n = 0
        for mod in net.modules():
            if type(mod).__name__ != "MoERunner":
                continue
            def pre(m, args, kwargs, layer=n):
                rec = plugin._state["recorder"]
                if rec is None or not rec._win:
                    return
                hidden = kwargs.get("hidden_states", args[0] if args else None)
                logits = hidden.float() @ gates[layer].T
                ids = torch.topk(logits, top_k, dim=-1).indices.reshape(-1).tolist()
                seen.setdefault(str(rec._n), {}).setdefault(layer, set()).update(ids)
            mod.register_forward_pre_hook(pre, with_kwargs=True)
            n += 1
        return n

    llm = LLM(model=model, dtype="float32", max_model_len=2048, enforce_eager=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                  "prompt_lookup_min": 1})
    layers = llm.apply_model(hooks)[0]
    llm.generate(prompts, SamplingParams(max_tokens=48, temperature=0))
    counts = {i: [len(v[k]) for k in sorted(v)] for i, v in seen.items()}
    json.dump({"layers": layers, "counts": counts}, open(out, "w"))
"""


@pytest.fixture(scope="module")
def moe_run(vllm_python, work, model_dir, prompts):
    moe = make_moe(work / "moe-32x4", model_dir, experts=EXPERTS, top_k=TOP_K, expert_dim=128)
    phases, counts = work / "moe-phases.jsonl", work / "moe-router-counts.json"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "SPECSCOPE_PHASES": str(phases), "SPECSCOPE_WINDOW_EVERY": "0.001", "SPECSCOPE_WINDOW_FIRST": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    # one prompt at a time: the repeated phrases give the n-gram drafter something to copy, so steps verify
    text = [p + " Repeat: one two three, one two three, one two three." for p in prompts[:2]]
    r = subprocess.run([vllm_python, "-c", SCRIPT, str(moe), str(counts), str(TOP_K), json.dumps(text)],
                       capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return phases, json.loads(counts.read_text()), r.stdout


def _window_steps(path: Path) -> list[dict]:
    steps = []
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        if "window" in obj:
            steps += obj["window"]
    return steps


def test_experts_touched_equal_the_routers_own_count(moe_run):
    phases, router, _ = moe_run
    steps = [s for s in _window_steps(phases) if s.get("experts")]
    assert len(steps) >= 8 and {s["kind"] for s in steps} >= {"verify"}
    for s in steps:
        assert s["experts"]["per_layer"] == router["counts"][str(s["i"])], s["i"]
        assert s["experts"]["of"] == EXPERTS and len(s["experts"]["per_layer"]) == router["layers"]
    # a verify of n tokens touches at least as many experts as one token routes to, and at most n * top-k
    for s in steps:
        assert all(TOP_K <= n <= min(EXPERTS, s["tokens"] * TOP_K) for n in s["experts"]["per_layer"])


def test_components_add_up_to_the_phase_and_name_the_experts(moe_run, work):
    phases, _, stdout = moe_run
    s = ingest_file(phases, db=work / "runs.db", tags=("engines", "moe", "components"))
    comps = s["results"]["components"]
    assert any(k.startswith("verify@") for k in comps)
    adds_up(s["results"])
    for key, b in comps.items():
        kind = key.partition("@")[0]
        fwd = b["components"][kind]
        assert fwd["experts"] > 0 and fwd["gemm"] > 0 and fwd["attention"] > 0 and fwd["lm_head"] > 0, fwd
        assert fwd.get("unclassified", 0.0) <= 0.01 * sum(fwd.values()), fwd
        assert b["experts"]["of"] == EXPERTS
    # the report under `Target verify:` names them
    assert "verify components, " in stdout and "MoE experts" in stdout and "experts touched: " in stdout
