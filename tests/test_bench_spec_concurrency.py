"""bench/spec_concurrency.py: the closed loop keeps C requests in flight and returns every output as offline
`generate` gives it; the small helpers; and the whole script once on tiny stand-ins (the real run is the lead's)."""

import json

import pytest

from bench_util import load_bench
from spec_helpers import tiny_target


def load():
    return load_bench("spec_concurrency")


class Recording:
    """A BatchEngine that records how many requests it holds at each step."""

    def __init__(self, engine):
        self.engine, self.held = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def step(self):
        self.held.append(len(self.engine.waiting) + len(self.engine.running))
        return self.engine.step()


@pytest.mark.parametrize("draft", [None, "ngram"])
def test_closed_loop_keeps_c_in_flight_and_matches_generate(tmp_path, draft):
    from specscope.engine import BatchEngine
    from specscope.generate import generate
    from specscope.speculative.decode import SpecConfig, build_drafter

    sc = load()
    target = tiny_target(tmp_path / "t")
    prompts = [[1, 5, 9, 14, 20, 7], [1, 30, 31, 32, 33], [1, 7, 7, 7, 7, 7, 7], [1, 40, 41], [1, 9, 8, 7, 6, 5]]
    refs = [generate(target, p, 12, None, [2]).token_ids for p in prompts]
    drafter = build_drafter(draft, target) if draft else None
    eng = Recording(BatchEngine(target, drafter, SpecConfig(3, 1, 4) if draft else None, 2, 24))
    r = sc.closed_loop(eng, prompts, 12, [2], 2)
    assert sc.mismatches(r["outputs"], refs) == []
    assert r["tokens"] == sum(map(len, refs)) and r["tok_per_s"] > 0 and r["steps"] == len(eng.held)
    assert max(eng.held) == 2 and eng.held[0] == 2           # never more than C, and C from the start
    assert (r["accept_length"] is None) == (draft is None)
    assert sc.mismatches([[1], [2, 3]], [[1], [2, 4]]) == [1]


def test_helpers():
    sc = load()
    assert sc.speedups({1: {"tok_per_s": 10.0}, 2: {"tok_per_s": 20.0}}, {1: {"tok_per_s": 15.0}}) == {1: 1.5}
    assert sc.surface_tokens(14) == [1, 2, 3, 4, 6, 8, 12, 14] and sc.surface_tokens(8) == [1, 2, 3, 4, 6, 8]
    assert sc.surface_tokens(7.5) == [1, 2, 3, 4, 6, 8]
    assert sc.parse_levels("16,1,4") == [1, 4, 16]
    c = sc.profile_shape("ngram", "5,4,24")
    assert (c.steps, c.topk, c.draft_tokens) == (5, 1, 6)
    c = sc.profile_shape("some-drafter+ngram", "5,4,24")
    assert (c.steps, c.topk, c.draft_tokens, c.ngram_tokens) == (5, 4, 24, 12)


def test_help_and_bad_levels(capsys):
    sc = load()
    with pytest.raises(SystemExit) as e:
        sc.main(["--help"])
    assert e.value.code == 0 and "crossover" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        sc.main(["--concurrency", "0,2"])
    assert e.value.code == 2 and "--concurrency must all be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sc.main(["--concurrency", "1,8", "--requests", "4"])
    assert e.value.code == 2 and "fewer than the largest --concurrency 8" in capsys.readouterr().err


def test_whole_script_on_tiny_stand_ins(tmp_path, capsys):
    from specscope.models import load_model
    from specscope.speculative.formats import save_drafter
    from spec_helpers import random_eagle3
    from tiny import make_hf_model, make_tiny_tokenizer

    target = tmp_path / "target"
    make_hf_model(target, "llama", layers=4, max_position_embeddings=2048)
    make_tiny_tokenizer(target)
    drafter = tmp_path / "drafter"
    save_drafter(random_eagle3(load_model(target, dtype="fp32"), draft_vocab=60), drafter)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    code = load().main(["--model", str(target), "--drafts", f"{drafter},{drafter}+ngram", "--concurrency", "1,2",
                        "--requests", "3", "--max-new-tokens", "6", "--threads", "1", "--profile-prompts", "1",
                        "--profile-shape", "2,2,4", "--max-draft-tokens", "4", "--surface-repeats", "1", "--policy",
                        "--tuned", "--rounds", "2", "--out", str(out), "--plot", str(png)])
    assert code == 0
    r = json.loads(out.read_text())
    assert r["checks"]["every_output_identical_to_generate"] and png.stat().st_size > 5000
    assert set(r["runs"]) == {"plain", str(drafter), f"{drafter}+ngram", f"{drafter} (policy)",
                              f"{drafter}+ngram (policy)", f"{drafter} (tuned)", f"{drafter}+ngram (tuned)"}
    assert all(set(v) == {"1", "2"} and all(x["identical"] == 3 and len(x["rounds_tok_per_s"]) == 2
                                            and x["tok_per_s"] == max(x["rounds_tok_per_s"]) for x in v.values())
               for v in r["runs"].values())
    t = r["summary"][f"{drafter} (tuned)"]
    assert set(t["predicted_speedup"]) == set(t["shapes"]) == {"1", "2"}
    s = r["summary"][f"{drafter}+ngram"]
    assert set(s["speedup"]) == set(s["predicted_speedup"]) == {"1", "2"}
    assert [t["batch"] for t in s["tuned"]] == [1, 2] and s["shape"]["ngram_tokens"] == 6
    assert r["surface"]["batches"] == [1, 2] and r["tables"][str(drafter)]["kind"] == "spec_policy"
    assert "measured crossover" in capsys.readouterr().out
