"""Where a sweep's launches run (sweep/placement.py) and how long they warm up (sweep/cell.py): the engine's compute
threads bound to cores of their own, its server and the client kept on the rest, where the host has cores enough;
warm-up until two requests in a row take the same time per token; the resolving power the repeats give.

The end-to-end checks launch tests/sweep_engine.py (a real process on loopback) with a command that names vLLM, so
the sweep places it as it places vLLM's CPU build, and read back the cores the process was started on and the
binding it was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cli_util import cli

from specscope.benchserve.warmup import MORE_WARMUP, WarmUp, settled
from specscope.sweep.placement import Placement, pinned, plan
from specscope.sweep.spec import SweepSpec, parse_flag_axis
from specscope.sweep.statecheck import Damaged, check_spec
from specscope.sweep.workload import workload_spec

HERE = Path(__file__).parent
VLLM = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "m", "--port", "{port}"]
TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="placement needs two cores to place apart")


# ---- the plan -----------------------------------------------------------------------------------------------------
def test_a_vllm_cpu_launch_gets_compute_cores_and_the_rest_apart():
    p = plan(VLLM, {}, cores=[0, 1])
    assert p.pinned and p.compute == ((0,),) and p.rest == (1,)
    assert p.env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert p.words == "pinned: the engine's compute threads on core 0; its API server, scheduler and the client on core 1"
    big = plan(VLLM + ["--tensor-parallel-size", "2"], {}, cores=list(range(16)))
    assert big.env == {"VLLM_CPU_OMP_THREADS_BIND": "0,1,2,3,4,5,6|7,8,9,10,11,12,13"} and big.rest == (14, 15)
    assert "rank 0 on cores 0-6; rank 1 on cores 7-13" in big.words


def test_where_it_cannot_place_it_says_why_and_changes_nothing():
    cases = {
        "2 core(s) for 2 rank(s)": plan(VLLM + ["-tp", "2"], {}, cores=[0, 1]),
        "1 core(s) for 1 rank(s)": plan(VLLM, {}, cores=[0]),
        "does not know how SGLang binds": plan(["python", "-m", "sglang.launch_server", "--port", "1"], {}),
        "does not know how this engine binds": plan(["my-engine", "--port", "{port}"], {}),
        "--pin off": plan(VLLM, {}, "off", cores=[0, 1]),
        "VLLM_CPU_OMP_THREADS_BIND=auto leaves": plan(VLLM, {"VLLM_CPU_OMP_THREADS_BIND": "auto"}, cores=[0, 1]),
    }
    for words, p in cases.items():
        assert not p.pinned and not p.env and p.words.startswith("not pinned") and words in p.words, p.words


def test_the_users_binding_is_kept_and_only_the_rest_is_placed_around_it():
    p = plan(VLLM, {"VLLM_CPU_OMP_THREADS_BIND": "1"}, cores=[0, 1])
    assert p.env == {} and p.compute == ((1,),) and p.rest == (0,) and "(VLLM_CPU_OMP_THREADS_BIND=1)" in p.words
    both = plan(VLLM, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, cores=[0, 1])
    assert not both.pinned and "binds every core" in both.words


@TWO_CORES
def test_pinned_moves_every_thread_and_a_child_inherits_it_then_restores():
    import threading

    before = os.sched_getaffinity(0)
    seen = {}
    ready, go = threading.Event(), threading.Event()

    def other():                # a thread started before the block: moved too (the client's pool threads)
        ready.set()
        go.wait()
        seen["thread"] = os.sched_getaffinity(0)

    t = threading.Thread(target=other)
    t.start()
    ready.wait()
    p = Placement(((0,),), (1,), {}, "")
    with pinned(p):
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True).stdout
        go.set()
        t.join()
        assert os.sched_getaffinity(0) == {1}
    assert json.loads(child) == [1] and seen["thread"] == {1}
    assert os.sched_getaffinity(0) == before


# ---- a sweep that places its launches ------------------------------------------------------------------------------
@TWO_CORES
@pytest.mark.parametrize("pin", ["auto", "off"])
def test_a_sweep_launch_is_placed_and_says_so(tmp_path, capsys, monkeypatch, pin):
    import specscope.sweep.cell as cell

    monkeypatch.setattr(cell, "SETTLE_S", 0.2)
    where = tmp_path / "vllm-placement.json"        # the command names vLLM: the sweep places it as vLLM's CPU build
    cmd = [sys.executable, str(HERE / "sweep_engine.py"), "--port", "{port}", "--placement-file", str(where)]
    before = os.sched_getaffinity(0)
    code, out, err = cli(capsys, "sweep", "-w", tmp_path / "w", "--flag", "steps=1", "--repeats", "2",
                         "--num-prompts", "2", "--output-len", "8", "--pin", pin, "--no-progress", "--json",
                         "--serve-cmd", " ".join(cmd))
    assert code == 0, err
    doc = json.loads(out)
    got = json.loads(where.read_text())
    cores = sorted(before)
    if pin == "auto":
        assert got == {"affinity": cores[-1:], "bind": ",".join(map(str, cores[:-1]))}
        assert doc["placement"] == [plan(cmd, {}, cores=cores).words]
    else:
        assert got == {"affinity": cores, "bind": None} and doc["placement"] == ["not pinned (--pin off)"]
    assert os.sched_getaffinity(0) == before                    # the client's cores given back
    code, text, _ = cli(capsys, "sweep", "-w", tmp_path / "w", "--no-progress")
    assert f"placement: {doc['placement'][0]}" in text
    # the warm-up: the first request again until two in a row agree, recorded with the run
    from specscope.registry import open_registry

    with open_registry(None, create=False) as reg:
        rec = reg.get_run(doc["matrix"]["cells"][0][0]["runs"][0])
    warm = rec["results"]["sweep_warmup"]
    assert warm["requests"] >= 2 and len(warm["tpot_ms"]) == warm["requests"]
    assert warm["steady"] or warm["requests"] == 1 + MORE_WARMUP      # unsettled only once the extra ones ran out
    assert rec["env"]["placement"]["pinned"] == (pin == "auto")
    # the host's own speed, read on the compute cores before the engine started and after it stopped
    ref = rec["env"]["host_reference"]
    assert ref["before_gbps"] > 0 and ref["after_gbps"] > 0 and ref["cores"] == (cores[:-1] if pin == "auto" else [])
    assert doc["host"]["readings"] == 4 and doc["host"]["min_gbps"] <= ref["gbps"] <= doc["host"]["max_gbps"]
    assert "the host's own speed (a fixed 64 MiB read on the compute cores" in text


# ---- warm-up and resolving power -----------------------------------------------------------------------------------
def test_settled_needs_two_requests_within_three_percent():
    assert not settled([]) and not settled([10.0])
    assert settled([50.0, 10.0, 10.25]) and not settled([10.0, 10.4])
    w = WarmUp([40.0, 30.0, 36.0], steady=False)
    assert "did not settle in 3 warm-up requests" in w.words() and "40.0, 30.0, 36.0" in w.words()


def test_the_sweep_states_what_its_repeats_resolve():
    from specscope.sweep.render import resolves_words

    doc = {"launch_noise": {"resolves": [{"metric": "phase.verify", "label": "verify", "change": 0.058},
                                         {"metric": "tok_per_s", "label": "tok/s", "change": 0.0}]}}
    assert resolves_words(doc) == "with these repeats the sweep resolves changes ≥ 6% in verify, ≥ 1% in tok/s"
    assert resolves_words({"launch_noise": None}) is None


# ---- the sweep file -----------------------------------------------------------------------------------------------
def _spec(pin="auto"):
    return SweepSpec(["engine", "--port", "{port}"], [parse_flag_axis("steps=1,3")], 2, workload_spec(), "none",
                     pin=pin)


def test_pin_is_stored_only_when_off_and_an_older_file_reads_back():
    assert "pin" not in _spec().identity()            # a sweep file from before --pin reads back unchanged
    assert check_spec(_spec().identity()).pin == "auto"
    off = _spec("off").identity()
    assert off["pin"] == "off" and check_spec(off).pin == "off"
    with pytest.raises(Damaged, match="'pin' is not one of auto, off"):
        check_spec(dict(off, pin="sometimes"))


# ---- the host's own speed --------------------------------------------------------------------------------------------
def test_host_spread_and_compare_names_a_slower_host():
    from specscope.registry.causes import rank
    from specscope.sweep.hostspeed import host_reference, reference_gbps, spread

    assert reference_gbps([sorted(os.sched_getaffinity(0))[0]]) > 0
    runs = [{"env": {"host_reference": host_reference(20.0, 22.0, [0])}},
            {"env": {"host_reference": host_reference(25.0, None, [0])}}, {"env": {}}]
    assert runs[1]["env"]["host_reference"]["gbps"] == 25.0
    assert spread(runs) == {"min_gbps": 20.0, "max_gbps": 25.0, "change": 0.25, "readings": 3, "mib": 64}
    assert spread([{"env": {}}]) is None
    top = rank({"env.host_reference.gbps": (25.0, 20.0), "env.host_reference.cores": ([0], [0, 1]),
                "env.os.kernel": ("a", "b")}, {"changed_phases": {"verify", "draft"}})
    assert top[0]["key"] == "env.host_reference.gbps" and "drift" in top[0]["why"]
