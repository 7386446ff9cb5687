"""compare: planted regressions are found and attributed; same-distribution runs are not called different."""

import re

import numpy as np
import pytest

from specscope.errors import SpecscopeError
from specscope.registry import open_registry
from specscope.registry.causes import prior_for, rank
from specscope.registry.compare import compare_runs, lookup, matrix, settings_diff
from specscope.registry.stats import ratio_change, verdict

PHASES = {"draft": 4.0, "verify": 20.0, "accept": 0.6, "commit": 0.9, "other": 0.3}


def env(**over):
    e = {"collected_at": "2026-01-01T00:00:00", "host": "gpu-1", "cpu": {"model": "EPYC 9654", "cores_usable": 16},
         "memory": {"total_mib": 131072, "available_mib": 100000},
         "packages": {"torch": "2.13.0", "specscope": "0.1.0"}, "git": {"commit": "a" * 40, "dirty": False},
         "vars": {"NCCL_PROTO": "LL", "OMP_NUM_THREADS": "8"},
         "gpu": {"name": "NVIDIA H200", "driver_version": "570.1", "sm_clock_mhz": 1980, "sm_clock_max_mhz": 1980,
                 "mem_clock_max_mhz": 3201, "power_limit_w": 700.0, "temperature_c": 40, "pcie_gen": 5}}
    for path, v in over.items():
        d = e
        *head, last = path.split("__")
        for h in head:
            d = d[h]
        d[last] = v
    return e


def synth(seed, n=300, scale=None, decode=10.0, tau_p=0.6, env_over=None, config_over=None, name=""):
    """A speculative run with per-cycle samples (lognormal noise, CV ~10 %) and a baseline measured alongside."""
    rng = np.random.default_rng(seed)
    scale = scale or {}
    cm = {p: (m * scale.get(p, 1.0) * rng.lognormal(0, 0.1, n)).tolist() for p, m in PHASES.items()}
    total = [sum(x) for x in zip(*cm.values())]
    acc = (1 + rng.binomial(4, tau_p, n)).tolist()
    base = (decode * scale.get("decode", 1.0) * rng.lognormal(0, 0.1, n)).tolist()
    T = sum(total)
    results = {
        "tok_per_s": sum(acc) / T * 1e3, "accept_length": float(np.mean(acc)), "decode_ms_per_token": T / sum(acc),
        "cycle_ms": {"mean_ms": T / n},
        "phases": {p: {"mean_ms": float(np.mean(v)), "share": sum(v) / T} for p, v in cm.items()},
        "baseline": {"decode_ms_per_token": float(np.mean(base)), "tok_per_s": 1e3 / float(np.mean(base))},
        "per_position_acceptance": [float(np.mean([a - 1 > i for a in acc])) for i in range(4)],
    }
    config = {"model": "/m/llama", "model_hash": "fast1:x", "steps": 4, "topk": 1, "draft_tokens": 5,
              "dtype": "bf16", "device": "cuda", **(config_over or {})}
    return {"kind": "bench", "name": name, "config": config, "env": env(**(env_over or {})), "results": results,
            "samples": {"cycle_ms": cm, "cycle_total_ms": total, "accept_lengths": acc, "num_draft": [4] * n,
                        "baseline_step_ms": base}}


def rows_by(cmp):
    return {r["metric"]: r for r in cmp["rows"]}


def test_planted_nccl_regression_in_verify():
    a = synth(1)
    b = synth(2, scale={"verify": 1.53, "draft": 1.08, "accept": 1.08, "commit": 1.08, "decode": 1.08},
              env_over={"vars__NCCL_PROTO": "Simple", "git__commit": "b" * 40, "gpu__sm_clock_mhz": 1965,
                        "host": "gpu-2", "collected_at": "2026-01-02T00:00:00", "gpu__temperature_c": 60})
    cmp = compare_runs([a, b])
    rows = rows_by(cmp)
    assert rows["phase.verify"]["verdicts"][1] == "worse"
    assert rows["tok_per_s"]["verdicts"][1] == "worse"
    assert rows["phase.other"]["verdicts"][1] == "no significant change"
    att = cmp["attribution"][0]
    assert att["explains"] == "verify"
    assert att["out_of_proportion"]["phase"] == "verify"
    assert "verify +5" in att["out_of_proportion"]["message"] and "decode (baseline) +" in \
        att["out_of_proportion"]["message"]
    assert att["likely_causes"][0]["key"] == "env.vars.NCCL_PROTO"
    # differences only: volatile fields are left out, equal fields are not listed
    assert "env.collected_at" not in cmp["env_diff"] and "env.gpu.temperature_c" not in cmp["env_diff"]
    assert "env.gpu.name" not in cmp["env_diff"] and cmp["config_diff"] == {}
    assert cmp["env_diff"]["env.vars.NCCL_PROTO"] == ["LL", "Simple"]
    # the split of Δ ms/token is exact
    assert sum(c["delta_ms_per_token"] for c in att["contributions"]) == pytest.approx(att["delta_ms_per_token"],
                                                                                       abs=1e-3)


def test_planted_clock_drop_slows_everything():
    a = synth(3)
    slow = {p: 1.25 for p in PHASES} | {"decode": 1.25, "other": 1.0}
    b = synth(4, scale=slow, env_over={"gpu__sm_clock_max_mhz": 1500, "gpu__sm_clock_mhz": 1500,
                                       "vars__NCCL_DEBUG": "INFO", "git__commit": "c" * 40})
    att = compare_runs([a, b])["attribution"][0]
    assert att["out_of_proportion"] is None
    assert att["explains"] == "verify"
    keys = [c["key"] for c in att["likely_causes"]]
    assert keys[0] == "env.gpu.sm_clock_max_mhz"
    assert keys.index("env.gpu.sm_clock_max_mhz") < keys.index("env.vars.NCCL_DEBUG")


def test_planted_acceptance_drop_points_at_prompts():
    a = synth(5, config_over={"prompt_set_hash": "sha256:aa"})
    b = synth(6, tau_p=0.4, config_over={"prompt_set_hash": "sha256:bb"}, env_over={"git__commit": "d" * 40})
    cmp = compare_runs([a, b])
    rows = rows_by(cmp)
    assert rows["accept_length"]["verdicts"][1] == "worse"
    assert rows["acceptance.0"]["verdicts"][1] == "worse"
    assert rows["acceptance.0"]["values"][0] == pytest.approx(a["results"]["per_position_acceptance"][0], abs=1e-4)
    assert rows["phase.verify"]["verdicts"][1] == "no significant change"
    att = cmp["attribution"][0]
    assert att["explains"] == "acceptance (τ)"
    assert att["likely_causes"][0]["key"] == "config.prompt_set_hash"


def test_same_distribution_is_not_called_a_change():
    flagged = []
    for seed in range(20):
        a, b = synth(100 + 2 * seed), synth(101 + 2 * seed)
        cmp = compare_runs([a, b])
        changed = [r["metric"] for r in cmp["rows"] if r["verdicts"][1] in ("better", "worse")]
        if changed:
            flagged.append((seed, changed))
        else:
            assert cmp["attribution"][0]["summary"] == "no significant change in any metric"
    # Bonferroni over the rows keeps the family-wise false-alarm rate at 5 %: at most one pair in 20
    assert len(flagged) <= 1, flagged


def test_three_runs_and_runs_without_samples():
    a, b, c = synth(7), synth(8, scale={"verify": 1.3}), synth(9)
    c["samples"] = {}
    cmp = compare_runs([a, b, c])
    rows = rows_by(cmp)
    assert len(rows["tok_per_s"]["values"]) == 3
    assert rows["phase.verify"]["verdicts"][1] == "worse"
    assert rows["phase.verify"]["verdicts"][2].startswith("n/a")
    assert rows["phase.verify"]["changes"][2]["change"] == pytest.approx(
        c["results"]["phases"]["verify"]["mean_ms"] / a["results"]["phases"]["verify"]["mean_ms"] - 1, abs=1e-4)
    with pytest.raises(SpecscopeError, match="at least two"):
        compare_runs([a])


def test_stats_interval_and_verdict():
    rng = np.random.default_rng(0)
    x = rng.lognormal(0, 0.1, 400)
    same = ratio_change(x, np.ones(400), rng.permutation(x), np.ones(400))
    assert same["lo"] < 0 < same["hi"] and abs(same["change"]) < 1e-9
    up = ratio_change(x, np.ones(400), x * 1.1, np.ones(400))
    assert up["lo"] > 0.05 and verdict(up, higher_is_better=False) == "worse"
    assert verdict(up, higher_is_better=True) == "better"
    tiny = ratio_change(x, np.ones(400), x * 1.005, np.ones(400))
    assert verdict(tiny, False) == "no significant change"      # below the 2 % floor even if "significant"
    few = ratio_change([1.0, 2.0], [1, 1], [3.0, 4.0], [1, 1])
    assert few["lo"] is None and verdict(few, True).startswith("n/a")


def test_cause_priors_and_ranking():
    assert prior_for("env.vars.NCCL_ALGO")[1] == frozenset({"verify"})
    assert prior_for("env.gpu.sm_clock_max_mhz")[0] > prior_for("env.os.kernel")[0]
    ranked = rank({"env.gpu.sm_clock_mhz": (1980, 1965), "env.gpu.sm_clock_max_mhz": (1980, 1410)},
                  {"out_of_proportion": None, "tau_changed": False, "changed_phases": {"verify", "draft"}})
    assert ranked[0]["key"] == "env.gpu.sm_clock_max_mhz"       # jitter in the current clock counts less
    # vLLM CPU's thread binding moves everything, the all-reduce most: above a load average that differed too
    shape = {"out_of_proportion": None, "tau_changed": False, "changed_phases": {"verify", "draft", "accept"}}
    ranked = rank({"env.vars.VLLM_CPU_OMP_THREADS_BIND": ("0|1", "0|0"), "env.cpu.load_1m": (1.2, 2.9)}, shape)
    assert ranked[0]["key"] == "env.vars.VLLM_CPU_OMP_THREADS_BIND"


def test_settings_diff_and_lookup():
    a, b = synth(1), synth(1, config_over={"steps": 6}, env_over={"vars__NCCL_PROTO": "Simple"})
    d = settings_diff([a, b])
    assert set(d) == {"config.steps", "env.vars.NCCL_PROTO"}
    assert lookup(b, "steps") == 6 and lookup(b, "NCCL_PROTO") == "Simple"
    assert lookup(b, "config.steps") == 6 and lookup(b, "env.NCCL_PROTO") == "Simple"     # the README's spelling
    assert lookup(b, "env.gpu.sm_clock_max_mhz") == 1980 and lookup(b, "sm_clock_max_mhz") == 1980
    assert lookup(b, "tok_per_s") == b["results"]["tok_per_s"]


def test_matrix_by_env_var_and_steps():
    runs = []
    for proto in ("LL", "Simple"):
        for steps in (2, 4):
            for rep in range(2):
                r = synth(10 + len(runs), n=50, config_over={"steps": steps}, env_over={"vars__NCCL_PROTO": proto})
                r["id"] = f"run{len(runs)}"
                runs.append(r)
    m = matrix(runs, ["NCCL_PROTO", "steps"])
    assert m["rows"] == ["LL", "Simple"] and m["cols"] == ["2", "4"]
    cell = m["cells"][1][0]
    assert cell["n"] == 2 and cell["runs"] == ["run4", "run5"]
    assert cell["value"] == pytest.approx(np.mean([runs[4]["results"]["tok_per_s"], runs[5]["results"]["tok_per_s"]]),
                                          abs=1e-3)
    with pytest.raises(SpecscopeError, match="none of the runs"):
        matrix(runs, ["NO_SUCH_KEY"])


def test_compare_runs_from_the_registry():
    with open_registry() as reg:
        ids = [reg.add_run(synth(20)), reg.add_run(synth(21, scale={"verify": 1.5}))]
        runs = [reg.get_run(i) for i in ids]
    cmp = compare_runs(runs)
    assert cmp["reference"] == ids[0] and cmp["attribution"][0]["explains"] == "verify"


def test_baseline_vs_speculative_names_offsets():
    rng = np.random.default_rng(0)
    n = 200
    dec = (10.0 * rng.lognormal(0, 0.1, n)).tolist()
    spec = synth(1, n=100, config_over={"engine": "speculative"})     # τ ≈ 3.4 at ~26 ms/cycle: faster
    cfg = dict(spec["config"], engine="baseline", steps=None, topk=None, draft_tokens=None)
    base = {"kind": "generate", "config": cfg, "env": env(),
            "results": {"tok_per_s": 1e3 / np.mean(dec), "accept_length": 1.0,
                        "phases": {"decode": {"mean_ms": float(np.mean(dec)), "share": 1.0}}},
            "samples": {"cycle_ms": {"decode": dec}, "cycle_total_ms": dec, "accept_lengths": [1] * n}}
    att = compare_runs([base, spec])["attribution"][0]
    assert att["tok_per_s_verdict"] == "better"
    assert att["explains"] in ("decode", "acceptance (τ)")
    assert "offset by verify" in att["summary"]
    assert att["likely_causes"][0]["key"] == "config.engine"


def test_baseline_measured_alongside_under_a_flat_key():
    a, b = synth(30), synth(31)
    for r in (a, b):
        r["results"]["baseline_decode_ms_per_token"] = r["results"].pop("baseline")["decode_ms_per_token"]
        del r["samples"]["baseline_step_ms"]
    row = rows_by(compare_runs([a, b]))["baseline.decode"]
    assert row["values"] == [round(a["results"]["baseline_decode_ms_per_token"], 4),
                             round(b["results"]["baseline_decode_ms_per_token"], 4)]
    assert row["verdicts"][1].startswith("n/a")


def test_cpu_load_difference_is_ranked_for_a_uniform_slowdown():
    a = synth(40, env_over={"cpu__load_1m": 2})
    b = synth(41, scale={p: 1.4 for p in PHASES} | {"decode": 1.4}, env_over={"cpu__load_1m": 9,
                                                                            "git__commit": "e" * 40})
    att = compare_runs([a, b])["attribution"][0]
    assert att["likely_causes"][0]["key"] == "env.cpu.load_1m"


def test_benchmarks_compare_per_prompt_tok_s_paired_by_prompt():
    rng = np.random.default_rng(7)
    base = rng.uniform(10, 50, 20)                      # prompts differ a lot from each other

    def bench(vals, prompt_hash, seed):
        r = synth(seed, config_over={"prompt_set_hash": prompt_hash})
        r["samples"]["per_prompt"] = [{"index": i, "tok_per_s": float(v)} for i, v in enumerate(vals)]
        r["results"]["tok_per_s"] = float(np.mean(vals))
        return r

    a = bench(base, "sha256:p", 50)
    b = bench(base * 1.05 * rng.lognormal(0, 0.01, 20), "sha256:p", 51)
    rows = rows_by(compare_runs([a, b]))
    tok = rows["tok_per_s"]
    assert tok["label"] == "tok/s (per prompt)" and tok["changes"][1]["paired"] is True
    assert tok["values"][0] == pytest.approx(np.mean(base), abs=1e-3)
    assert tok["verdicts"][1] == "better"               # +5 % is clear once prompts are paired
    assert "decode_tok_per_s" in rows
    # a different prompt set cannot be paired: the same +5 % drowns in prompt-to-prompt spread
    c = bench(base * 1.05 * rng.lognormal(0, 0.01, 20), "sha256:q", 52)
    tok = rows_by(compare_runs([a, c]))["tok_per_s"]
    assert "paired" not in tok["changes"][1] and tok["verdicts"][1] == "no significant change"


def test_attribution_reads_as_numbers_and_says_what_over_100_percent_means():
    """verify slows by more than the whole ms/token change because draft got faster: the summary says so, with
    no more digits than the data carry."""
    a = synth(40, scale={"verify": 1.0, "draft": 1.0})
    b = synth(41, scale={"verify": 1.5, "draft": 0.2})
    att = compare_runs([a, b])["attribution"][0]
    assert att["explains"] == "verify"
    m = re.search(r"verify accounts for (\S+) ms/token of the (\S+) ms/token change \((\d+)%; over 100% because other "
                  r"changes went the other way\)", att["summary"])
    assert m, att["summary"]
    assert int(m.group(3)) > 100
    for num in m.group(1, 2):
        assert len(num.lstrip("+-").replace(".", "")) <= 4, num      # e.g. +2.41, not +2.41234


def test_runs_timed_under_load_are_named():
    quiet, busy = synth(50), synth(51, env_over={"cpu__load_1m": 40})
    assert compare_runs([quiet, busy])["load_warnings"] == {
        "#1": "recorded with a 1-minute load average of 40 on 16 usable cores: other work competed for the CPUs, "
              "so its timings are not comparable with a quiet run"}
    ingested = dict(busy, env=dict(busy["env"], ingested=True))     # the engine ran elsewhere: no local load
    assert compare_runs([quiet, ingested])["load_warnings"] == {}


def test_hidden_avx512_is_named_when_a_cpu_run_slows_down():
    """The same CPU model in a VM that hides AVX-512: the row kernels fall back to AVX2, and compare says so."""
    a = synth(50, env_over={"cpu__simd": "avx512f,avx2,fma", "cpu__row_kernels": "avx512"})
    b = synth(51, scale={p: 1.3 for p in PHASES} | {"decode": 1.3},
              env_over={"cpu__simd": "avx2,fma", "cpu__row_kernels": "avx2", "git__commit": "e" * 40})
    keys = [c["key"] for c in compare_runs([a, b])["attribution"][0]["likely_causes"]]
    assert keys[:2] == ["env.cpu.row_kernels", "env.cpu.simd"], keys


def test_a_net_change_within_noise_is_not_split_into_shares():
    """τ up 55 % and every phase 55 % slower: ms/token does not move. Saying "acceptance accounts for -5.3 of the
    -0.002 ms/token change (355453%)" would attribute noise; the summary names the moves that cancelled instead."""
    a = synth(60, tau_p=0.3)
    b = synth(61, tau_p=0.6, scale={p: 3.4 / 2.2 for p in PHASES})
    cmp = compare_runs([a, b])
    rows = rows_by(cmp)
    assert rows["ms_per_token"]["verdicts"][1] == "no significant change"
    assert rows["accept_length"]["verdicts"][1] == "better" and rows["phase.verify"]["verdicts"][1] == "worse"
    att = cmp["attribution"][0]
    assert "accounts for" not in att["summary"] and "%;" not in att["summary"], att["summary"]
    assert "ms/token: no significant change" in att["summary"] and "not split" in att["summary"]
    assert "acceptance (τ) -" in att["summary"] and "verify +" in att["summary"]
    assert att["explains"] is None and all(c["share"] is None for c in att["contributions"])
    # the same pair with a real slowdown on top: the split is back, shares and all
    c = synth(62, tau_p=0.6, scale={p: 3.4 / 2.2 * (1.4 if p == "verify" else 1.0) for p in PHASES})
    att = compare_runs([a, c])["attribution"][0]
    assert rows_by(compare_runs([a, c]))["ms_per_token"]["verdicts"][1] == "worse"
    assert "verify accounts for" in att["summary"] and att["explains"] == "verify"


def _plain(seed, n=300):
    rng = np.random.default_rng(seed)
    dec = (10.0 * rng.lognormal(0, 0.1, n)).tolist()
    return {"kind": "baseline", "id": f"plain{seed:05d}", "config": {"model": "/m/llama"}, "env": env(),
            "results": {"tok_per_s": 1e3 / float(np.mean(dec)), "accept_length": 1.0,
                        "decode_ms_per_token": float(np.mean(dec)), "phases": {"decode": {"mean_ms": float(np.mean(dec)),
                                                                                           "share": 1.0}}},
            "samples": {"cycle_ms": {"decode": dec}, "cycle_total_ms": dec, "accept_lengths": [1] * n}}


def test_rows_one_run_has_say_which_and_are_grouped(tmp_path, capsys):
    from cli_util import cli

    base, spec = _plain(70), dict(synth(71), id="spec000071")
    cmp = compare_runs([base, spec])
    rows = rows_by(cmp)
    assert rows["accept_length"]["verdicts"][1] == "better"              # τ = 1 is a plain run's real value
    assert rows["acceptance.0"]["verdicts"][1] == "only in spec000071"
    assert rows["phase.decode"]["verdicts"][1] == "only in plain00070"
    assert not any(v and v.startswith("n/a (missing)") for r in cmp["rows"] for v in r["verdicts"])
    with open_registry() as reg:
        ids = [reg.add_run(dict(r, id=None)) for r in (base, spec)]
    code, out, err = cli(capsys, "compare", *ids)
    assert code == 0, err
    only = [ln for ln in out.splitlines() if ln.startswith("only in ")]
    assert len(only) == 2, out                           # one line per run, not a table row per metric
    assert only[0].startswith(f"only in {ids[1]}") and "acceptance @1" in only[0] and "Draft ms/cyc" in only[0]
    assert only[1].startswith(f"only in {ids[0]}") and "Target decode ms/cyc" in only[1]
    assert out.count("only in ") == 2                    # the table itself carries no such rows


# ------------------------------------------------------------------ labels derived from the numbers they label

def _served_pair_stored():
    from served_runs import priced_and_always

    priced, always = priced_and_always()
    with open_registry() as reg:
        return priced, always, [reg.add_run(priced), reg.add_run(always)]


def _line(out: str, label: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(label))


def test_a_change_from_a_base_below_the_noise_floor_reads_from_zero(capsys):
    """A served run whose policy drafted in 4 of 501 steps has a draft phase of 0.009 ms per step: against 14.02 ms
    that is no percentage (+155678 %) but a change from ~0, in the rows, the table and the sentences."""
    from cli_util import cli

    priced, always, ids = _served_pair_stored()
    cmp = compare_runs([priced, always])
    draft = rows_by(cmp)["phase.draft"]
    assert draft["changes"][1]["change"] is None and draft["changes"][1]["from_zero"]
    assert draft["verdicts"][1] == "from ~0" and draft["changes"][1]["delta"] == pytest.approx(14.011)
    assert rows_by(cmp)["phase.verify"]["changes"][1]["change"] == pytest.approx(58.0 / 71.5 - 1, abs=1e-4)
    code, out, err = cli(capsys, "compare", *ids)
    assert code == 0, err
    line = _line(out, "Draft ms/cyc")
    assert "from ~0" in line and "%" not in line, line
    # the judged-or-not sentence names it as a move from ~0 with its unit, never as a percentage of ~0
    summary = cmp["attribution"][0]["summary"]
    assert "Draft ms/cyc from ~0 to 14.0 ms" in summary and "Accept" not in summary, summary


def test_served_runs_ms_per_token_and_cycle_are_measured(capsys):
    """A served run's engine steps give its ms/cycle and ms/token (the step's phases over the tokens a step
    yields): compare shows them, as the report's chart does, instead of "in neither run"."""
    from cli_util import cli

    priced, always, ids = _served_pair_stored()
    rows = rows_by(compare_runs([priced, always]))
    assert rows["cycle_ms"]["values"] == [pytest.approx(73.159), pytest.approx(73.67)]
    tokens = 1 + (priced["results"]["accept_length"] - 1) * priced["results"]["drafted_step_share"]
    assert rows["ms_per_token"]["values"][0] == pytest.approx(73.159 / tokens, rel=1e-4)
    from specscope.registry.rows import decode_ms_per_token     # the report's runs table and chart read it too

    assert rows["ms_per_token"]["values"][0] == pytest.approx(decode_ms_per_token(priced), rel=1e-4)
    code, out, err = cli(capsys, "compare", *ids)
    assert code == 0, err
    assert "neither" not in out and "not measured" not in out
    assert "73.16" in _line(out, "ms/cycle") and "-41.0%" in _line(out, "ms/token")


def test_no_interval_is_promised_where_there_is_none(capsys):
    """Runs without per-cycle samples have no interval: the caption says changes are shown as measured, and
    promises no level; with samples it gives the level."""
    from cli_util import cli

    _, _, ids = _served_pair_stored()
    code, out, err = cli(capsys, "compare", *ids)
    assert code == 0, err
    assert "intervals at" not in out.lower() and "No intervals" in out
    with open_registry() as reg:
        ids = [reg.add_run(synth(70)), reg.add_run(synth(71))]
    code, out, err = cli(capsys, "compare", *ids)
    assert code == 0, err
    assert re.search(r"Intervals at 9\d\.\d\d%", out), out


def _without_phase_samples(rec):
    return dict(rec, samples={k: v for k, v in rec["samples"].items() if k != "cycle_ms"})


def test_cancelling_out_needs_moves_both_ways_and_every_amount_has_its_unit():
    """ms/token unchanged: τ rose while the cycle grew by as much. With the phases judged too, τ and the phases
    moved both ways and cancel out; with only τ judged, one move cancels nothing and is not said to."""
    a = synth(80, tau_p=0.4)
    grow = (1 + 4 * 0.6) / (1 + 4 * 0.4)
    b = synth(81, tau_p=0.6, scale={p: grow for p in PHASES})
    both = compare_runs([a, b])["attribution"][0]["summary"]
    assert "ms/token: no significant change" in both, both
    m = re.search(r"what moved, cancelling out: (.*)", both)
    assert m and "acceptance (τ) -" in m.group(1) and re.search(r"verify \+[\d.]+ ms/token", m.group(1)), both
    one = compare_runs([_without_phase_samples(a), _without_phase_samples(b)])["attribution"][0]["summary"]
    assert "cancelling" not in one, one
    assert re.search(r"what moved: acceptance \(τ\) -[\d.]+ ms/token", one), one
