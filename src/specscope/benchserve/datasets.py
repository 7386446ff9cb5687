"""bench-serve's requests: `vllm bench serve`'s --dataset-name / --dataset-path semantics over specscope's prompt
sets, and the optional --tokenizer that counts prompt tokens (and shapes random prompts) the way vLLM does.

Names: spec_bench and mt_bench (packaged, or a Spec-Bench-format --dataset-path), random (no file), custom (a
JSONL / JSON / text file of prompts) and sharegpt (a JSON list of {"conversations": [...]}). As in vLLM, the file
datasets are shuffled with --seed and oversampled (random repeats) up to --num-prompts unless --disable-shuffle /
--no-oversample; with a tokenizer, custom / spec_bench / mt_bench prompts get the chat template client-side
whatever the backend, as vLLM 0.32's custom and spec_bench datasets do (through a chat endpoint the server then
templates them a second time: the same requests, so the same token counts as `vllm bench serve`);
--skip-chat-template sends them raw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from specscope.errors import SpecscopeError

SUPPORTED = ("spec_bench", "mt_bench", "random", "custom", "sharegpt")
# vLLM 0.32's other --dataset-name values: named in the error rather than "not one of ..."
VLLM_ONLY = ("burstgpt", "random-mm", "random-rerank", "hf", "custom_audio", "custom_image", "prefix_repetition",
             "speed_bench", "timed_trace")
NEEDS_PATH = ("custom", "sharegpt")


@dataclass
class Request:
    prompt: str
    prompt_len: int | None       # tokens, when a tokenizer counted them (the server's usage wins when it reports)
    output_len: int              # max_tokens of the request


def check_dataset(name: str, path: str | None) -> None:
    if name in VLLM_ONLY:
        raise SpecscopeError(f"--dataset-name {name} is vLLM's but not supported by specscope bench-serve; use one "
                             f"of {', '.join(SUPPORTED)}")
    if name not in SUPPORTED:
        raise SpecscopeError(f"--dataset-name must be one of {', '.join(SUPPORTED)}, got {name!r}")
    if name == "random" and path is not None:
        raise SpecscopeError(f"--dataset-name random makes its own prompts and takes no --dataset-path (got "
                             f"{path!r}); for a file of prompts use --dataset-name custom or sharegpt")
    if name in NEEDS_PATH and path is None:
        raise SpecscopeError(f"--dataset-name {name} needs --dataset-path FILE")
    if path is not None and not Path(path).expanduser().exists():
        hint = (" (Hugging Face dataset ids are not supported: download the file)"
                if "/" in path and not path.startswith((".", "/", "~")) else "")
        raise SpecscopeError(f"--dataset-path {path!r} does not exist{hint}")


def load_tokenizer(spec: str):
    """--tokenizer: a local directory, a known model name, or a Hugging Face id (only its tokenizer files are
    fetched)."""
    from specscope.runtime.tokenizer import Tokenizer
    from specscope.models.hub import KNOWN_MODELS, hub_snapshot, parse_hub_id, resolve_model

    p = Path(spec).expanduser()
    if p.is_dir():
        return Tokenizer(p)
    if spec in KNOWN_MODELS:
        return Tokenizer(resolve_model(spec))
    if parse_hub_id(spec):
        return Tokenizer(hub_snapshot(spec, "tokenizer"))
    raise SpecscopeError(f"--tokenizer {spec!r} is neither a directory nor a Hugging Face id (org/name)")


def _count(tok, prompt: str, chat: bool) -> int:
    """Prompt tokens as the server will count them: the chat template for chat requests, else the text with the
    tokenizer's special tokens (vLLM's len(tokenizer(prompt).input_ids))."""
    if chat:
        return len(tok.encode_messages([{"role": "user", "content": prompt}]))
    return len(tok.tok(prompt).input_ids)


def _template(tok, prompt: str) -> str:
    try:
        return tok.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           tokenize=False)
    except Exception as e:
        raise SpecscopeError(f"the --tokenizer's chat template failed ({type(e).__name__}: {e}); pass "
                             f"--skip-chat-template to send the prompts as they are") from None


def _fit_tokens(tok, text: str, n: int) -> str:
    """`text` (random words) cut or repeated to exactly n tokens of the tokenizer, as text."""
    ids = tok.tok.encode(text, add_special_tokens=False)
    while len(ids) < n:
        text = text + " " + text
        ids = tok.tok.encode(text, add_special_tokens=False)
    return tok.tok.decode(ids[:n])


def _sharegpt_rows(path: Path) -> list[tuple[str, str]]:
    from specscope.fileio import read_text
    from specscope.jsonio import loads

    data = loads(read_text(path, "dataset file"), str(path))
    if not isinstance(data, list):
        raise SpecscopeError(f"{path}: a ShareGPT file is a JSON list of {{\"conversations\": [...]}} records")
    rows = []
    for entry in data:
        conv = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(conv, list) and len(conv) >= 2 and all(isinstance(c, dict) for c in conv[:2]):
            q, a = conv[0].get("value"), conv[1].get("value")
            if isinstance(q, str) and isinstance(a, str):
                rows.append((q, a))
    if not rows:
        raise SpecscopeError(f"{path}: no record with two conversation turns (conversations[0..1].value)")
    return rows


def build_requests(name: str, path: str | None, num_prompts: int, *, chat: bool, tokenizer=None, seed: int = 0,
                   categories: tuple[str, ...] = (), output_len: int | None = None, input_len: int | None = None,
                   random_input_len: int = 1024, random_output_len: int = 128, random_range_ratio: float = 0.0,
                   spec_bench_output_len: int = 256, custom_output_len: int = 256,
                   sharegpt_output_len: int | None = None, shuffle: bool = True, oversample: bool = True,
                   skip_chat_template: bool = False) -> dict:
    """{"name", "path", "hash", "requests": [Request]} for --dataset-name `name` (checked by check_dataset).

    output_len: vLLM's general --output-len (overrides each dataset's default); input_len: --input-len (random)."""
    from specscope.prompts import load_prompts, random_prompts

    if name == "random":
        if categories:
            raise SpecscopeError("--category does not apply to --dataset-name random")
        rows = random_prompts(num_prompts, input_len or random_input_len, output_len or random_output_len,
                              random_range_ratio, seed)
        reqs = _random_requests(rows, tokenizer, chat)
        return {"name": "random", "path": None, "hash": _hash(reqs), "requests": reqs}

    if name == "sharegpt":
        if categories:
            raise SpecscopeError("--category does not apply to --dataset-name sharegpt")
        p = Path(path).expanduser()
        pairs = _sharegpt_rows(p)
        if output_len is None and sharegpt_output_len is None and tokenizer is None:
            raise SpecscopeError("--dataset-name sharegpt takes each output length from the reply's tokens: pass "
                                 "--tokenizer (or --sharegpt-output-len N / --output-len N)")
        if shuffle:
            random.Random(seed).shuffle(pairs)
        reqs = _sharegpt_requests(pairs, num_prompts, output_len or sharegpt_output_len, tokenizer, chat)
        if not reqs:
            raise SpecscopeError(f"{p}: no conversation passes vLLM's length limits (prompt and reply >= 4 tokens, "
                                 f"prompt <= 1024, both <= 2048)")
        ds_name, ds_path = "sharegpt", str(p)
    else:
        # spec_bench / mt_bench (packaged, or the file given) and custom files: first user turns
        ds = (load_prompts(path, tuple(categories)) if name == "custom" else
              load_prompts(name, tuple(categories), path=path))
        rows = [r["prompt"] for r in ds["prompts"]]
        if shuffle:
            random.Random(seed).shuffle(rows)
        n_out = output_len or (custom_output_len if name == "custom" else spec_bench_output_len)
        reqs = _prompt_requests(rows[:num_prompts], n_out, tokenizer, chat, skip_chat_template)
        ds_name, ds_path = (ds["name"] if name == "custom" else name), ds["path"]
    if oversample and len(reqs) < num_prompts:
        reqs = _oversample(reqs, num_prompts, seed)
    return {"name": ds_name, "path": ds_path, "hash": _hash(reqs), "requests": reqs}


def _random_requests(rows: list[dict], tokenizer, chat: bool) -> list[Request]:
    """random_prompts' rows as requests; with a tokenizer each prompt is cut to its exact token length."""
    reqs = []
    for r in rows:
        prompt, plen = r["prompt"], None
        if tokenizer is not None:
            # vLLM's random prompts are exactly input_len tokens once the server adds its special tokens
            want = max(1, r["input_len"] - tokenizer.tok.num_special_tokens_to_add())
            prompt = _fit_tokens(tokenizer, prompt, want)
            plen = _count(tokenizer, prompt, chat)
        reqs.append(Request(prompt, plen, r["max_tokens"]))
    return reqs


def _sharegpt_requests(pairs: list[tuple[str, str]], num_prompts: int, fixed: int | None, tokenizer,
                       chat: bool) -> list[Request]:
    """Up to num_prompts (question, reply) pairs as requests of `fixed` output tokens, else the reply's length;
    with a tokenizer, pairs outside vLLM's length limits are left out."""
    reqs = []
    for q, a in pairs:
        if len(reqs) >= num_prompts:
            break
        plen = out = None
        if tokenizer is not None:
            plen = len(tokenizer.tok(q).input_ids)
            out = fixed or len(tokenizer.tok(a).input_ids)
            # vLLM's pruning: prompt and reply of 4+ tokens, prompt <= 1024, both <= 2048
            if plen < 4 or (fixed is None and out < 4) or plen > 1024 or plen + out > 2048:
                continue
            if chat:
                plen = _count(tokenizer, q, True)
        reqs.append(Request(q, plen, out or fixed))
    return reqs


def _prompt_requests(prompts: list[str], n_out: int, tokenizer, chat: bool,
                     skip_chat_template: bool) -> list[Request]:
    """First user turns as requests of n_out tokens; with a tokenizer, templated client-side (unless skipped) and
    counted."""
    reqs = []
    for prompt in prompts:
        plen = None
        if tokenizer is not None:
            if not skip_chat_template:
                prompt = _template(tokenizer, prompt)
            plen = _count(tokenizer, prompt, chat)
        reqs.append(Request(prompt, plen, n_out))
    return reqs


def _oversample(reqs: list[Request], num_prompts: int, seed: int) -> list[Request]:
    """vLLM's oversampling: random repeats of the sampled requests up to --num-prompts."""
    rng, base = random.Random(seed), list(reqs)
    return reqs + [rng.choice(base) for _ in range(num_prompts - len(base))]


def _hash(reqs: list[Request]) -> str:
    from specscope.registry import prompt_set_hash

    return prompt_set_hash([q.prompt for q in reqs])[7:23]
