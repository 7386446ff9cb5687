"""`check-drafter --served`: causes planted into the good pair (the embedded model + the shipped drafter exported to
speculators), each served by a real vLLM on loopback, and check-drafter names each one with its fix. The good pair
and the SGLang layout (aux layer ids vLLM counts from another origin) are checked on test_vllm.py's servers.

One server per planted configuration, each stopped before the next starts."""

from __future__ import annotations

import json
import shutil

from engine_util import planted_copy, served_checks, shuffled_d2t


def test_norm_placement_is_named(request, vllm_python, model_dir, work, exports):
    """A speculators config.json without norm_before_residual: vLLM (and specscope) assume true, the drafter was
    trained with false."""
    bad = planted_copy(exports["speculators"], work / "drafter-no-nbr",
                       edit_config=lambda c: c.pop("norm_before_residual", None))
    rc, c, rep = served_checks(request, vllm_python, model_dir, work, "served-nbr", bad)
    assert rc == 1 and c["served: norm placement"]["status"] == "fail", json.dumps(rep["checks"], indent=1)
    assert "norm_before_residual" in c["served: norm placement"]["detail"]
    assert '"norm_before_residual": false' in c["served: norm placement"]["detail"]


def test_vocabulary_map_is_named(request, vllm_python, model_dir, work, exports):
    """d2t re-aligned after training (a permutation of the same target ids: every static check still passes)."""
    bad = planted_copy(exports["speculators"], work / "drafter-shuffled-map", edit_weights=shuffled_d2t)
    rc, c, rep = served_checks(request, vllm_python, model_dir, work, "served-map", bad)
    assert rc == 1 and c["served: vocabulary map"]["status"] == "fail", json.dumps(rep["checks"], indent=1)
    assert "ascending" in c["served: vocabulary map"]["detail"]
    assert c["token map"]["status"] == "ok"          # invisible to the static check


def test_chat_template_is_named(request, vllm_python, model_dir, work, exports):
    """The good drafter, served with another chat template than the target's (vLLM --chat-template)."""
    tpl = work / "other-template.jinja"
    tpl.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: ")
    rc, c, rep = served_checks(request, vllm_python, model_dir, work, "served-template", exports["speculators"],
                               args=["--chat-template", str(tpl)])
    assert rc == 1 and c["served: chat template"]["status"] == "fail", json.dumps(rep["checks"], indent=1)
    assert c["served: tokenizer"]["status"] == "ok"
    assert "--chat-template" in c["served: chat template"]["detail"]


def test_a_target_served_in_another_dtype_is_named(request, vllm_python, model_dir, work, exports):
    """The good drafter, the target served in bfloat16 (the drafter is predicted on the fp32 target): the served
    greedy answers differ from the target's, and the check names the dtype the launch gives."""
    rc, c, rep = served_checks(request, vllm_python, model_dir, work, "served-bf16", exports["speculators"],
                               args=["--dtype", "bfloat16"], engine_args=True)
    row = c.get("served: target dtype / quantisation")
    assert row and row["status"] in ("warn", "fail"), json.dumps(rep["checks"], indent=1)
    assert "--dtype bfloat16" in row["detail"]
    assert c["served: tokenizer"]["status"] == "ok" and c["served: chat template"]["status"] == "ok"


def test_another_tokenizer_is_named(request, vllm_python, model_dir, work, exports):
    """The target served with another tokenizer revision (vLLM --tokenizer): the target's tokenizer with its first
    2,000 BPE merges dropped, so common words split into other ids; the same vocabulary, nothing fails to load."""
    tok_dir = work / "tokenizer-other-revision"
    tok_dir.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")) and f.is_file():
            shutil.copy(f, tok_dir / f.name)
    tj = json.loads((tok_dir / "tokenizer.json").read_text())
    tj["model"]["merges"] = tj["model"]["merges"][2000:]
    (tok_dir / "tokenizer.json").write_text(json.dumps(tj))
    rc, c, rep = served_checks(request, vllm_python, model_dir, work, "served-tokenizer", exports["speculators"],
                               args=["--tokenizer", str(tok_dir)])
    assert rc == 1 and c["served: tokenizer"]["status"] == "fail", json.dumps(rep["checks"], indent=1)
    assert "token ids differ from the target's" in c["served: tokenizer"]["detail"]
