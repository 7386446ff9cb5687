"""The real demo model: greedy decoding equals transformers `generate` token for token (slow)."""

import json
from pathlib import Path

import pytest
import torch

from specscope.errors import SpecscopeError

pytestmark = pytest.mark.slow
QUESTIONS = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench_question.jsonl"


@pytest.fixture(scope="module")
def smollm2():
    from specscope.models.hub import resolve_model

    try:
        return resolve_model("smollm2-135m")
    except SpecscopeError as e:
        pytest.skip(f"SmolLM2 is unavailable: {e}")


def writing_prompts(n=3):
    if not QUESTIONS.exists():
        pytest.skip(f"{QUESTIONS} not found")
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows if r["category"] == "writing"][:n]


def test_greedy_64_tokens_equal_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    from specscope.generate import generate
    from specscope.session import stop_ids_for
    from specscope.runtime.tokenizer import Tokenizer
    from specscope.models import load_model

    ours = load_model(smollm2, dtype="fp32")
    tok = Tokenizer(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2), dtype=torch.float32).eval()
    stop = stop_ids_for(ours, tok)
    for prompt in writing_prompts():
        ids = tok.encode(prompt, chat=True)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=64, do_sample=False, eos_token_id=stop,
                              pad_token_id=stop[0])[0, len(ids):].tolist()
        cut = next((i for i, t in enumerate(ref) if t in stop), None)
        ref = ref[:cut + 1] if cut is not None else ref
        got = generate(ours, ids, 64, stop_ids=stop).token_ids
        assert got == ref, (prompt[:40], got, ref)
