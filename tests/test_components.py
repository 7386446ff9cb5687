"""What a phase spent its time on (profile/components.py, plugins/windows.py): ops painted onto a phase's time line
by the engine version's op table, the profiler windows the in-engine recorder opens itself, the components' way
through `ingest` into a run, and `compare` naming the component that moved.

The engine here is a small torch model driven step by step the way the vLLM plugin drives the recorder (vLLM's
scope names, real torch-profiler windows, real ops); the same inside a real vLLM (dense and a 32-expert MoE) is
tests/engines/test_components.py and tests/engines/test_vllm.py."""

import gzip
import io
import json
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

from specscope.engines.vllm import op_table
from specscope.ingest.core import ingest_file
from specscope.plugins.steps import StepRecorder
from specscope.plugins.windows import Windows
from specscope.profile.components import Classifier, Scope, Span, change, lines, paint
from specscope.registry import open_registry
from specscope.registry.compare import compare_runs

from components_util import adds_up



# ---- painting: every instant of a scope goes to one component -----------------------------------------------------
def test_outermost_classified_op_wins_unknown_is_unclassified_and_the_rest_is_host_gap():
    c = Classifier(op_table("0.32.0")[0])
    sc = Scope("verify", "forward", 0.0, 100.0)
    spans = [Span("aten::linear", 10, 40), Span("aten::addmm", 12, 38),       # a GEMM holding its own op
             Span("vllm::unified_attention_with_output", 40, 55), Span("aten::copy_", 41, 44),
             Span("_C::some_new_kernel", 60, 70),                               # no rule: unclassified
             Span("my_wrapper", 75, 95), Span("aten::mul", 80, 90),            # unknown around a known op
             Span("aten::linear", 98, 130)]                                    # runs past the scope: clipped
    unknown = {}
    got = paint(sc, spans, c, unknown)
    assert got == {"host_gap": 10 + 5 + 5 + 3, "gemm": 30 + 2, "attention": 15, "unclassified": 10 + 10,
                   "elementwise": 10}
    assert sum(got.values()) == 100.0
    assert unknown == {"_C::some_new_kernel": 10, "my_wrapper": 10}


def test_torch_compiles_wrappers_are_host_time_and_their_ops_are_painted_as_themselves():
    """torch.compile's regions (in vLLM even with --enforce-eager) wrap the forward's ops: their own time is the
    host's, never `unclassified`, and never swallows the ops inside, known or not."""
    c = Classifier(op_table("0.32.0")[0])
    sc = Scope("verify", "forward", 0.0, 100.0)
    spans = [Span("Torch-Compiled Region: 0/0", 0, 90), Span("TorchDynamo Cache Lookup", 1, 3),
             Span("## Call CompiledFxGraph fabc123 ##", 5, 85), Span("Pregraph bytecode", 5, 6),
             Span("AOTDispatcher Runtime Wrapper Prologue", 6, 8), Span("aten::linear", 10, 40),
             Span("vllm::unified_attention_with_output", 40, 55), Span("_C::some_new_kernel", 60, 70)]
    unknown = {}
    got = paint(sc, spans, c, unknown)
    assert got == {"host_gap": 10 + 5 + 20 + 10, "gemm": 30, "attention": 15, "unclassified": 10}
    assert unknown == {"_C::some_new_kernel": 10}


def test_a_scope_part_decides_what_its_ops_are():
    c = Classifier(op_table("0.32.0")[0])
    assert c.component("_C::onednn_mm", "forward") == "gemm"
    assert c.component("_C::onednn_mm", "postprocess") == "lm_head"        # the logits after the forward
    assert c.component("aten::add", "sample") == "sampling"                # the rejection sampler's own ops
    assert c.component("_C::cpu_fused_moe", "forward") == "experts"
    assert c.component("aten::topk", "forward") == "experts"               # the router's top-k
    assert c.component("aten::topk", "draft") == "sampling"                # a drafter's top-k
    assert c.component("c10d::allreduce_", "forward") == "collectives"
    assert c.component("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "forward") == "collectives"


def test_a_version_without_a_table_gets_a_note_and_unclassified_never_a_guess():
    rules, note = op_table("0.9.9")
    assert rules is None and "0.9.9" in note and "unclassified" in note
    c = Classifier(rules, note)
    assert c.component("_C::onednn_mm", "forward") is None                 # vLLM's own op: not guessed
    assert c.component("vllm::unified_attention_with_output", "forward") is None
    assert c.component("aten::mm", "forward") == "gemm"                     # torch's own names hold everywhere
    stored = {"verify@4": {"steps": 1, "components": {"verify": {"unclassified": 2.0, "gemm": 1.0}},
                           "measured": {"verify": 3.0}}}
    text = "\n".join(lines(stored, note=note, unknown={"_C::onednn_mm": 2000.0}))
    assert "unclassified 2.00 (67%)" in text and note in text and "_C::onednn_mm 2.00 ms" in text


# ---- the recorder's windows around a real torch model --------------------------------------------------------------
class _Block(torch.nn.Module):
    """One decoder-like block of plain torch ops: norm, QKV, attention, output, MLP; a separate LM head."""

    def __init__(self, d=256, vocab=4096):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.o = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
        self.head = torch.nn.Linear(d, vocab)
        self.ctx = torch.randn(1, 4, 64, d // 4)

    def forward(self, x):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q, k, v = self.qkv(h).chunk(3, -1)
        q = q.view(1, -1, 4, 64).transpose(1, 2)
        k = torch.cat([self.ctx, k.view(1, -1, 4, 64).transpose(1, 2)], 2)
        v = torch.cat([self.ctx, v.view(1, -1, 4, 64).transpose(1, 2)], 2)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        x = x + self.o(a)
        return x + self.down(F.silu(self.up(x)))


def _engine(path, steps=12, collective=False, every=1e-9, out=None):
    """Drive the recorder as the vLLM plugin does, with vLLM's scope names: preprocess, forward, postprocess (the
    logits), sample, draft, bookkeep; a verify of 4 tokens per step."""
    net = _Block()
    rec = StepRecorder(path, "vllm", "0.32.0", {"method": "eagle3", "num_speculative_tokens": 3}, every_s=1e9,
                       out=out or io.StringIO(), windows=Windows(Classifier(op_table("0.32.0")[0]), every_s=every, steps=4,
                                                          first=2))
    buf = torch.zeros(1 << 18)
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(1, 4, 256)
            rec.begin_step("verify", 4)
            with rec.engine_scope("commit", "preprocess"):
                x = x.clone()
            with rec.engine_scope("forward", "forward"):
                for _ in range(4):
                    x = net(x)
                    for _ in range(2 if collective else 0):
                        # functional collectives: the all-reduce and its wait are ops (c10d's eager all_reduce
                        # waits outside any op: its time shows as host gap, as it would in an engine using it)
                        fc.wait_tensor(fc.all_reduce(buf, "sum", torch.distributed.group.WORLD))
            with rec.engine_scope("forward", "postprocess"):
                logits = net.head(x)
            with rec.engine_scope("accept", "sample", sub=False):
                logits.argmax(-1)
            with rec.engine_scope("draft", "draft", sub=False):
                net.head(net(x[:, :1]))
            with rec.engine_scope("commit", "bookkeep"):
                logits[0, 0, :8].tolist()
            rec.end_step([3], [2])
    rec.close()
    return rec


def test_windows_split_each_profiled_step_and_ingest_stores_the_components(tmp_path):
    path = tmp_path / "steps.jsonl"
    rec = _engine(path)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    windows = [r for r in rows if "window" in r]
    profiled = [s for w in windows for s in w["window"]]
    assert len(profiled) == 10 and [s["i"] for s in profiled] == list(range(2, 12))    # from step 2, windows of 4
    assert sum(1 for r in rows if r.get("win")) == 10
    res = ingest_file(path, record=False)["results"]
    b = res["components"]["verify@4"]
    assert b["steps"] == 10
    adds_up(res)
    fwd = b["components"]["verify"]
    assert {"gemm", "attention", "elementwise", "lm_head", "host_gap"} <= set(fwd)
    assert fwd["gemm"] > fwd["attention"] and "unclassified" not in fwd and "collectives" not in fwd
    assert set(b["components"]["accept"]) <= {"sampling", "host_gap"}
    assert rec.buckets["verify@4"].steps == 10


def test_the_report_under_target_verify_names_the_components(tmp_path):
    out = io.StringIO()
    _engine(tmp_path / "steps.jsonl", steps=8, out=out)
    text = out.getvalue()
    assert "Target verify: " in text
    assert "verify components, 4 tokens (6 steps profiled): " in text and "GEMMs" in text and "host gap" in text


def test_no_window_while_another_profiler_runs(tmp_path):
    """torch runs one profiler at a time: the engine's own (vLLM's /start_profile) must never fail for ours."""
    from torch.profiler import ProfilerActivity, profile

    w = Windows(Classifier(op_table("0.32.0")[0]), every_s=1e-9, steps=1, first=0)
    with profile(activities=[ProfilerActivity.CPU]):
        assert w.begin(0) is False
    assert w.begin(1) is True
    w.close()


# ---- compare names the component that moved ------------------------------------------------------------------------
@pytest.fixture
def gloo():
    """A one-process gloo group: real all-reduce ops (_c10d_functional::all_reduce + wait_tensor) in the forward."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def test_compare_names_collectives_when_the_verify_grows_by_an_all_reduce(tmp_path, gloo):
    db = tmp_path / "runs.db"
    ids = []
    for name, coll in (("plain", False), ("allreduce", True)):
        path = tmp_path / f"{name}.jsonl"
        _engine(path, steps=16, collective=coll)
        ids.append(ingest_file(path, db=db)["run_id"])
    with open_registry(db) as reg:
        runs = [reg.get_run(i) for i in ids]
    att = compare_runs(runs)["attribution"][0]
    moved = att["components"]
    assert moved["phase"] == "verify" and moved["lead"] == "collectives" and moved["tokens"] == [4, 4]
    assert "collectives +" in att["summary"] and "verify tokens" not in att["summary"]


def test_a_sweep_slice_names_the_component_over_its_pooled_repeats(tmp_path, gloo):
    """A sweep judges a cell's repeats pooled: their profiled steps are merged bucket by bucket, so the slice's
    compare names the component that moved, as compare does for two runs."""
    from specscope.profile.components import merged
    from specscope.sweep.axes import compare_cells

    db, cells = tmp_path / "runs.db", {}
    for name, coll in (("plain", False), ("allreduce", True)):
        for rep in range(2):
            path = tmp_path / f"{name}-{rep}.jsonl"
            _engine(path, steps=8 + 4 * rep, collective=coll)
            with open_registry(db) as reg:
                run = reg.get_run(ingest_file(path, db=db)["run_id"])
            cells.setdefault(name, []).append(dict(run, sweep={"repeat": rep}))
    s = compare_cells(cells["plain"], cells["allreduce"], "plain", "allreduce")
    assert s["components"]["phase"] == "verify" and s["components"]["lead"] == "collectives", s
    assert "collectives +" in s["summary"]
    # the pooled bucket: each repeat's per-step means weighted by its steps (6 and 10 profiled steps)
    two = [r["results"]["components"] for r in cells["allreduce"]]
    m = merged(two)["verify@4"]
    steps = [c["verify@4"]["steps"] for c in two]
    assert m["steps"] == sum(steps) == 16
    want = sum(c["verify@4"]["components"]["verify"]["collectives"] * n for c, n in zip(two, steps)) / 16
    assert m["components"]["verify"]["collectives"] == pytest.approx(want, abs=1e-3)


def test_merged_buckets_weigh_each_run_by_its_steps_and_keep_the_experts():
    from specscope.profile.components import merged

    a = {"verify@4": {"steps": 1, "components": {"verify": {"experts": 10.0}}, "measured": {"verify": 12.0},
                      "experts": {"distinct_per_layer": 8.0, "bytes": 800, "of": 32, "steps": 1}}}
    b = {"verify@4": {"steps": 3, "components": {"verify": {"experts": 14.0}}, "measured": {"verify": 16.0},
                      "experts": {"distinct_per_layer": 12.0, "bytes": 1200, "of": 32, "steps": 3}},
         "decode@1": {"steps": 2, "components": {"decode": {"gemm": 5.0}}}}
    m = merged([a, b, {}])
    assert m["verify@4"]["steps"] == 4 and m["verify@4"]["components"]["verify"]["experts"] == 13.0
    assert m["verify@4"]["measured"]["verify"] == 15.0
    assert m["verify@4"]["experts"] == {"distinct_per_layer": 11.0, "bytes": 1100, "of": 32, "steps": 4}
    assert m["decode@1"]["components"] == {"decode": {"gemm": 5.0}} and "experts" not in m["decode@1"]


def test_component_change_says_when_the_verify_ran_more_tokens():
    a = {"verify@2": {"steps": 4, "components": {"verify": {"gemm": 10.0, "host_gap": 5.0}}}}
    b = {"verify@4": {"steps": 4, "components": {"verify": {"gemm": 14.0, "host_gap": 5.2}}}}
    moved = change(a, b, "verify")
    assert moved["lead"] == "gemm" and moved["tokens"] == [2, 4]
    assert "GEMMs +4.00 (95%)" in moved["words"] and "verify tokens per step 2 -> 4" in moved["words"]
    assert change(a, b, "draft") is None
    # a draft runs inside a verify step: the tokens it is told with are the verify's
    a["verify@2"]["components"]["draft"] = {"gemm": 3.0}
    b["verify@4"]["components"]["draft"] = {"gemm": 9.0}
    assert "; verify tokens per step 2 -> 4" in change(a, b, "draft")["words"]


# ---- vLLM's own trace, read the same way -----------------------------------------------------------------------------
MOE_TRACE = Path(__file__).parent / "data" / "torch_traces" / "vllm-moe-ngram-k3.two-steps.pt.trace.json.gz"


def test_a_vllm_trace_of_a_moe_is_split_by_the_same_table(tmp_path):
    """A real vLLM 0.32 CPU trace of a 32-expert MoE (two verify steps): each step's experts are exactly its MoE
    kernel's and router's op time in the forward (recounted here from the raw events), and its components are its
    scopes."""
    doc = json.loads(gzip.decompress(MOE_TRACE.read_bytes()))
    ev = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in ev if e["name"].startswith("execute_")), key=lambda e: e["ts"])
    fwd = [e for e in ev if e["name"] == "gpu_model_runner: forward"]
    # the experts' kernel and the router's top-k (vLLM's CPU router: softmax by logsumexp, then top-k)
    moe = [e for e in ev if e["name"] in ("_C::cpu_fused_moe", "aten::topk", "aten::logsumexp")]
    expect = {}
    for st in steps:
        tokens = int(st["name"].rsplit("(", 1)[1].rstrip(")"))
        f = next(x for x in fwd if x["ts"] >= st["ts"])
        mine = [m for m in moe if f["ts"] <= m["ts"] <= f["ts"] + f["dur"]]
        outer = [m for m in mine if not any(o is not m and o["ts"] <= m["ts"] and m["ts"] + m["dur"] <= o["ts"] + o["dur"]
                                             for o in mine)]     # aten::logsumexp calls itself (an overload)
        ms = sum(m["dur"] for m in outer) / 1e3
        expect[f"verify@{tokens}"] = ms
    res = ingest_file(MOE_TRACE, record=False)["results"]
    comps = res["components"]
    assert set(comps) == set(expect)
    for key, ms in expect.items():
        assert comps[key]["components"]["verify"]["experts"] == pytest.approx(ms, abs=2e-3)
        for ph, parts in comps[key]["components"].items():
            assert sum(parts.values()) == pytest.approx(comps[key]["measured"][ph], abs=2e-3)
        v = comps[key]["components"]["verify"]
        assert {"attention", "gemm", "lm_head", "elementwise", "host_gap"} <= set(v) and "unclassified" not in v


def test_a_sweep_cell_shows_its_verify_components_pooled_over_its_repeats():
    from specscope.sweep.matrix import _components
    from specscope.sweep.render import component_words

    runs = [{"id": "a", "results": {"components": {"verify@4": {"steps": 4, "components": {
                "verify": {"gemm": 6.0, "host_gap": 2.0, "attention": 1.0}}}}}},
            {"id": "b", "results": {"components": {"verify@4": {"steps": 4, "components": {
                "verify": {"gemm": 8.0, "host_gap": 2.0, "attention": 1.0}}}}}},
            {"id": "c", "results": {}}]
    got = _components(runs)
    assert got["verify"] == {"ms": {"gemm": 7.0, "host_gap": 2.0, "attention": 1.0}, "tokens": 4, "steps": 8}
    assert component_words(got) == ["  GEMMs 70% · host gap 20%"]
    assert _components(runs[2:]) == {} and component_words({}) == []


def test_the_report_draws_the_components_of_each_phase(tmp_path):
    from specscope.report.build import build_report
    from specscope.report.components_chart import components_breakdown

    path = tmp_path / "steps.jsonl"
    _engine(path, steps=8)
    db = tmp_path / "runs.db"
    rid = ingest_file(path, db=db)["run_id"]
    with open_registry(db) as reg:
        run = reg.get_run(rid)
    assert components_breakdown.layout_problems([run]) == []
    page = build_report([run])
    assert "components of each phase: stacked ms per profiled step" in page


@pytest.mark.parametrize("name, value", [("SPECSCOPE_WINDOW_EVERY", "abc"), ("SPECSCOPE_WINDOW_STEPS", "2.5"),
                                         ("SPECSCOPE_WINDOW_FIRST", "-1")])
def test_a_bad_window_setting_is_named_with_its_fix(monkeypatch, name, value):
    """The plugin turns windows off in one line on this error (plugins/vllm.py) instead of failing the engine."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}={value!r} is not a .*number >= 0 .*profiler windows off"):
        Windows(Classifier(op_table("0.32.0")[0]))
