"""Predicted τ (engine/predict.py): the engine's loop replayed on the target's greedy output equals a real
speculative run, exactly on a tiny target, within 5 % per shape on the embedded model; a wrong drafter predicts
less."""

import pytest
import torch
from serve_util import LoopbackThread, QuietHandler
from spec_helpers import random_eagle3, tiny_target

from specscope.errors import SpecscopeError
from specscope.generate import speculative_generate
from specscope.speculative.decode import SpecConfig
from specscope.speculative.drafters import Eagle3TreeDrafter
from specscope.engine.predict import continuation_tokens, predict, replay, shapes_for
from specscope.generate import truths_from_target

VOCAB = 24


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = tiny_target(tmp_path_factory.mktemp("t"), layers=4, vocab=VOCAB, max_position_embeddings=256)
    return target, random_eagle3(target, seed=1, scale=2.0)


@pytest.mark.parametrize("cfg", [SpecConfig(3, 1, 4), SpecConfig(3, 2, 5)], ids=["chain", "tree"])
def test_replay_equals_a_real_run_on_a_tiny_target(tiny, cfg):
    target, d = tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (12,), generator=g).tolist() for _ in range(4)]
    truths = truths_from_target(target, prompts, continuation_tokens(40, [cfg]), d.aux_layers)
    accepted = 0
    for p, truth in zip(prompts, truths):
        real = speculative_generate(target, Eagle3TreeDrafter(d, target), p, 40, cfg=cfg)
        rep = replay(Eagle3TreeDrafter(d, target), truth, cfg, 40, context=target.config.max_position_embeddings)
        assert rep.tokens == real.token_ids and not rep.truncated
        s, r = rep.stats, real.stats
        assert (s.accept_lengths, s.accepted_per_pos, s.drafts_per_pos, s.acceptance_by_depth_rank) == \
            (r.accept_lengths, r.accepted_per_pos, r.drafts_per_pos, r.acceptance_by_depth_rank)
        accepted += sum(r.accepted_per_pos)
    assert accepted > 0          # drafts were accepted: the equality covers the commit of accepted states


def test_replay_stops_at_a_stop_token_as_decoding_does(tiny):
    target, d = tiny
    cfg = SpecConfig(3, 1, 4)
    p = list(range(3, 15))
    truth = truths_from_target(target, [p], continuation_tokens(40, [cfg]), d.aux_layers)[0]
    stop = truth.ids[len(p) + 9]           # a token the greedy output reaches
    real = speculative_generate(target, Eagle3TreeDrafter(d, target), p, 40, stop_ids=[stop], cfg=cfg)
    rep = replay(Eagle3TreeDrafter(d, target), truth, cfg, 40, stop_ids=[stop])
    assert real.stop_reason == "eos" and rep.tokens == real.token_ids
    assert rep.stats.accept_lengths == real.stats.accept_lengths


def test_a_short_truth_is_replayed_as_far_as_it_is_known(tiny):
    target, d = tiny
    p = list(range(3, 15))
    truth = truths_from_target(target, [p], 10, d.aux_layers)[0]
    rep = replay(Eagle3TreeDrafter(d, target), truth, SpecConfig(3, 1, 4), 40)
    assert rep.truncated and rep.tokens == truth.ids[len(p):len(p) + len(rep.tokens)] and len(rep.tokens) <= 10
    truth.prompt_len = len(truth.ids)
    with pytest.raises(SpecscopeError, match="continuation"):
        replay(Eagle3TreeDrafter(d, target), truth, SpecConfig(3, 1, 4), 40)


# ---------------------------------------------------------------- the embedded model and the shipped drafter

MAX_NEW = 40


@pytest.fixture(scope="module")
def smollm2():
    from specscope.prompts import load_prompts
    from specscope.session import load_target
    from specscope.speculative.decode import DEFAULT_DRAFTER, build_drafter, declared_shape
    from specscope.engine.predict import default_tree

    try:
        target, tok, _ = load_target("smollm2-135m", "fp32", "cpu")
        drafter = build_drafter(DEFAULT_DRAFTER, target)
    except SpecscopeError as e:
        pytest.skip(f"SmolLM2 or its drafter is unavailable: {e}")
    rows = load_prompts("spec_bench", num_prompts=3)["prompts"]
    prompts = [tok.encode(r["prompt"], chat=True) for r in rows]
    shapes = shapes_for(5, default_tree(declared_shape(DEFAULT_DRAFTER)))
    truths = truths_from_target(target, prompts, continuation_tokens(MAX_NEW, shapes), drafter.aux_layers)
    return target, drafter, prompts, shapes, truths


def test_prediction_agrees_with_measured_tau_on_the_embedded_model(smollm2):
    target, drafter, prompts, shapes, truths = smollm2
    assert [s.topk for s in shapes] == [1] * 5 + [4]
    for cfg in shapes:
        real = [speculative_generate(target, drafter, p, MAX_NEW, cfg=cfg).stats for p in prompts]
        measured = sum(sum(s.accept_lengths) for s in real) / sum(s.cycles for s in real)
        pred = predict(drafter, truths, cfg, MAX_NEW, context=target.config.max_position_embeddings)
        assert abs(pred.accept_length - measured) <= 0.05 * measured, (cfg, pred.accept_length, measured)
        assert pred.accept_length > 1.2     # the shipped drafter drafts something on chat prompts


def test_a_wrong_vocabulary_map_predicts_a_lower_tau(smollm2):
    target, drafter, prompts, shapes, truths = smollm2
    good = predict(drafter, truths, shapes[2], MAX_NEW).accept_length
    d2t = drafter.model.d2t
    saved = d2t.clone()
    try:
        with torch.no_grad():       # the map rolled by one draft id: every draft names its neighbour's token
            d2t.copy_(torch.roll(saved + torch.arange(saved.numel()), 1) - torch.arange(saved.numel()))
        bad = predict(drafter, truths, shapes[2], MAX_NEW).accept_length
    finally:
        with torch.no_grad():
            d2t.copy_(saved)
    assert bad < good - 0.3 and bad < 1.2


# ---------------------------------------------------------------- where it is reported, and where it travels

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny chat target, a training run through the select stage (greedy answers captured) and its export."""
    from train_util import make_chat_target, write_dataset

    from specscope.cli import main

    root = tmp_path_factory.mktemp("trained")
    tgt, ds, work = make_chat_target(root / "target"), write_dataset(root / "ds.jsonl"), root / "w"
    main(["train", "--workdir", str(work), "--target", str(tgt), "--dataset", str(ds), "--stages",
          "data,vocab,train,select", "--regenerate", "greedy", "--response-tokens", "24", "--draft-vocab", "64",
          "--device", "cpu", "--ttt-steps", "3", "--steps", "6", "--batch-size", "4", "--lr", "3e-3", "--warmup", "2",
          "--eval-every", "3", "--ckpt-every", "3", "--threads", "1", "--no-progress", "--export-dtype", "fp32",
          "--eval-fraction", "0.25", "--select-prompts", "2", "--out", str(root / "drafter")])
    main(["export", str(root / "drafter"), "--format", "speculators", "--out", str(root / "spec"), "--model", str(tgt)])
    return root, tgt, ds, work


def test_train_records_the_predicted_tau_and_it_travels_with_the_drafter(trained, tmp_path):
    import json

    from specscope.cli import main

    root, tgt, ds, work = trained
    sel = json.loads((work / "select.json").read_text())
    pt = sel["predicted_tau"]
    assert [s["shape"] for s in pt["shapes"]] == [f"chain {k}" for k in range(1, 6)] + ["tree 4x4x32"]
    assert pt["source"] == "own forward" and pt["prompts"] == 2 and all(s["tau"] >= 1 for s in pt["shapes"])
    recorded = json.loads((root / "drafter" / "config.json").read_text())["specscope"]["predicted_tau"]
    assert recorded == {k: pt[k] for k in ("tau", "prompts", "max_new_tokens", "source")}
    # kept through a format conversion (sglang -> speculators)
    assert json.loads((root / "spec" / "config.json").read_text())["specscope"]["predicted_tau"] == recorded
    # fine-tuning changes the weights: the --init drafter's recorded τ is not carried to the new one
    main(["train", "--workdir", str(tmp_path / "w2"), "--target", str(tgt), "--dataset", str(ds), "--stages",
          "data,vocab,train", "--draft-vocab", "64", "--device", "cpu", "--ttt-steps", "3", "--steps", "1",
          "--batch-size", "4", "--threads", "1", "--no-progress", "--export-dtype", "fp32",
          "--init", str(root / "spec"), "--out", str(tmp_path / "tuned")])
    assert "specscope" not in json.loads((tmp_path / "tuned" / "config.json").read_text())


def test_check_drafter_shows_the_recorded_tau_and_predicts_from_a_forward_or_a_capture(trained, capsys):
    import json

    from specscope.cli import main

    root, tgt, _, work = trained
    capsys.readouterr()
    main(["check-drafter", str(root / "spec"), "--model", str(tgt), "--no-run"])     # no fault: no exit 1
    out = capsys.readouterr().out
    assert "recorded with the drafter: chain 1 " in out, out
    main(["check-drafter", str(root / "spec"), "--model", str(tgt), "--predict", "--num-prompts", "2",
          "--max-new-tokens", "8", "--steps", "2"])
    out = capsys.readouterr().out
    assert "[ok  ] predicted τ: trained for chain 1 " in out and "; predicted here chain 1 " in out, out
    for args, source in (([], "own forward"), (["--features", str(work / "data")], "captured")):
        main(["check-drafter", str(root / "spec"), "--model", str(tgt), "--predict", "--num-prompts", "2",
              "--max-new-tokens", "8", "--steps", "2", "--json", *args])
        p = json.loads(capsys.readouterr().out)["prediction"]
        assert p["source"] == source and [s["shape"] for s in p["shapes"]] == ["chain 1", "chain 2", "tree 4x4x32"]
        assert p["prompts"] == 2 and all(s["cycles"] > 0 and s["tau"] >= 1 for s in p["shapes"])


def test_features_without_captured_data_are_refused_before_any_decoding(tmp_path, capsys, monkeypatch):
    """A --features directory with no capture is one line and exit 2, before the target loads or decodes."""
    import specscope.check_drafter as cd
    from cli_util import cli

    def no_run(*a, **k):
        raise AssertionError("the check ran before --features was checked")
    monkeypatch.setattr(cd, "check_drafter", no_run)
    code, _, err = cli(capsys, "check-drafter", "smollm2-135m-eagle3", "--model", "smollm2-135m", "--features",
                       tmp_path / "nothing")
    assert code == 2 and err.strip().startswith("error: --features") and "manifest.json" in err, err


# ---------------------------------------------------------------- check-drafter --served --features

def test_served_features_are_the_captures_own_prompts(trained):
    """--served --features serves the capture's prompts: each one recovered as the user turn the capture tokenised
    (re-encoding it gives the captured prompt ids), each asking for no more new tokens than its greedy answer
    verifies with the deepest chain."""
    import json

    from specscope.runtime.tokenizer import Tokenizer
    from specscope.speculative.formats import resolve_target
    from specscope.train.predicted import captured_prompts

    root, tgt, ds, work = trained
    tok = Tokenizer(tgt)
    rows = [json.loads(ln) for ln in ds.read_text().splitlines()]
    users = {r["messages"][0]["content"] if "messages" in r else r["conversations"][0]["value"] for r in rows}
    cap = captured_prompts(work / "data", tok, resolve_target(str(tgt)), [], 3, 40, 2)
    assert len(cap.texts) == 3 and set(cap.texts) <= users, cap.texts
    assert [tok.encode(t, chat=True) for t in cap.texts] == cap.prompt_ids
    assert 1 <= cap.max_new_tokens <= 40
    assert all(len(t.ids) - t.prompt_len >= cap.max_new_tokens + 3 for t in cap.truths)


class DraftingVLLM(QuietHandler):
    """A vLLM serving with a drafter, as far as check-drafter looks before its first request: /metrics with the
    spec-decode counters and /v1/models. Every POST is recorded and refused."""
    posts: list = []

    def do_GET(self):
        if self.path == "/v1/models":
            self._send(200, b'{"data": [{"id": "m"}]}')
            return
        lab = 'engine="0",model_name="m"'
        self._send(200, "".join(f"vllm:spec_decode_num_{n}_total{{{lab}}} 0\n"
                                for n in ("drafts", "draft_tokens", "accepted_tokens")).encode(), "text/plain")

    def do_POST(self):
        DraftingVLLM.posts.append(self.path)
        self._send(500, b"{}")


@pytest.mark.parametrize("case", ["another chat template", "another target"])
def test_served_features_of_another_target_are_one_line_before_any_request(trained, tmp_path, capsys, case):
    """--served --features DIR where DIR was captured from another target (another width), or with another chat
    template than the drafter's target has: one line naming --features, exit 2, and nothing sent to the engine."""
    import json
    import shutil
    import time

    from cli_util import cli, one_error_line

    root, tgt, _, work = trained
    if case == "another target":
        drafter, target = "smollm2-135m-eagle3", "smollm2-135m"
    else:
        drafter, target = root / "spec", shutil.copytree(tgt, tmp_path / "target")
        other = "{% for m in messages %}{{ m['role'] + ' : ' + m['content'] + ' ' }}{% endfor %}"
        cfg = json.loads((target / "tokenizer_config.json").read_text())
        (target / "chat_template.jinja").unlink(missing_ok=True)
        (target / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": other}))
    DraftingVLLM.posts = []
    srv = LoopbackThread(DraftingVLLM)
    try:
        t0 = time.monotonic()
        code, out, err = cli(capsys, "check-drafter", drafter, "--model", target, "--served", srv.url,
                             "--features", work / "data")
        took = time.monotonic() - t0
    finally:
        srv.close()
    line = one_error_line(code, err)
    assert line.startswith("error: --features") and "pass the data directory captured from this target" in line
    assert ("hidden size 64" in line) if case == "another target" else ("chat template" in line), line
    assert DraftingVLLM.posts == [] and out == "", (DraftingVLLM.posts, out)
    print(f"\n{case}: refused in {took:.1f} s: {line}")
