"""Prompt sets shared by the demo, the tuner, bench-serve and the bench scripts.

The sets the tools default to ship inside the package (assets/prompts/, provenance in its README.md), so an
installed wheel needs no checkout. Anything else is a user's .jsonl / .json / text file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import sys
from pathlib import Path

from specscope.errors import SpecscopeError, require_file
from specscope.fileio import read_text
from specscope.jsonio import loads

PACKAGED = Path(__file__).resolve().parent / "assets" / "prompts"
SPEC_BENCH_FILE = "spec_bench_question.jsonl"
SPEC_BENCH_SHA256 = "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
# Spec-Bench's mt_bench task: the first 80 records, in MT-bench's category order
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
NAMED = ("spec_bench", "mt_bench")


def warn(message: str) -> None:
    """A fallback the user must not miss: on stderr, whatever the output format."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def spec_bench_path() -> Path:
    """$SPECSCOPE_SPEC_BENCH when set (an explicit choice), else the packaged copy. A broken install without it
    falls back to a checkout's shared data directory, with a warning."""
    env = os.environ.get("SPECSCOPE_SPEC_BENCH")
    if env:
        if not Path(env).is_file():
            raise SpecscopeError(f"SPECSCOPE_SPEC_BENCH={env!r} is not a file; unset it to use the packaged copy")
        return Path(env)
    packaged = PACKAGED / SPEC_BENCH_FILE
    if packaged.is_file():
        return packaged
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *here.parents]:
        for cand in (base / "shared" / "data" / SPEC_BENCH_FILE, base.parent / "shared" / "data" / SPEC_BENCH_FILE):
            if cand.is_file():
                warn(f"the packaged Spec-Bench file {packaged} is missing (a broken install?); using {cand}")
                return cand
    raise SpecscopeError(f"the packaged Spec-Bench file {packaged} is missing; reinstall specscope, set "
                         "SPECSCOPE_SPEC_BENCH to a copy, or pass a prompt file (--dataset FILE)")


def _read_jsonl(path: Path) -> list:
    items = []
    for i, line in enumerate(read_text(path, "prompt file").splitlines(), 1):
        if line.strip():
            items.append(loads(line, f"{path}:{i}"))
    return items


def mt_bench_prompts(n: int | None = None, path: str | Path | None = None) -> tuple[list[dict], str]:
    """MT-bench first turns from the Spec-Bench file (or `path`, a file in its format), one category after another
    (writing, roleplay, reasoning, math, coding, ...) rather than the first few writing ones. Returns (rows, prompt
    set name); rows are {"question_id", "category", "prompt"}."""
    path = spec_bench_path() if path is None else _given_file(path)
    by: dict[str, list[dict]] = {}
    for obj in _read_jsonl(path):
        turns = obj.get("turns") if isinstance(obj, dict) else None
        if obj.get("category") in MT_BENCH and isinstance(turns, list) and turns and isinstance(turns[0], str):
            by.setdefault(obj["category"], []).append(
                {"question_id": obj.get("question_id"), "category": obj["category"], "prompt": obj["turns"][0]})
    order = [c for c in MT_BENCH if c in by]
    out = []
    for j in range(max((len(v) for v in by.values()), default=0)):
        out += [by[c][j] for c in order if j < len(by[c])]
    if not out:
        raise SpecscopeError(f"{path} holds no MT-bench questions (categories {', '.join(MT_BENCH)})")
    out = out[:n] if n is not None else out
    return out, f"spec-bench mt_bench first turns ({len(out)})"


def _prompt_of(obj, where: str) -> tuple[str, str | None]:
    """(first user turn, category) from a Spec-Bench / ShareGPT / OpenAI-messages / {"prompt"} row."""
    if isinstance(obj, str):
        return obj, None
    if not isinstance(obj, dict):
        raise SpecscopeError(f"{where}: expected a JSON object or string")
    cat = obj.get("category")
    if isinstance(obj.get("turns"), list) and obj["turns"]:
        return str(obj["turns"][0]), cat
    for key in ("prompt", "text", "question", "instruction"):
        if isinstance(obj.get(key), str):
            return obj[key], cat
    for key, role_k, text_k, user in (("messages", "role", "content", "user"),
                                      ("conversations", "from", "value", "human")):
        msgs = obj.get(key)
        if isinstance(msgs, list):
            for m in msgs:
                if isinstance(m, dict) and m.get(role_k) in (user, "user") and isinstance(m.get(text_k), str):
                    return m[text_k], cat
    raise SpecscopeError(f"{where}: no prompt found (expected 'turns', 'prompt', 'messages' or 'conversations')")


def _given_file(path: str | Path) -> Path:
    p = Path(path).expanduser()
    require_file(p, "dataset file")
    return p


def load_prompts(dataset: str, categories: tuple[str, ...] = (), num_prompts: int | None = None,
                 path: str | Path | None = None) -> dict:
    """{"name", "path", "hash", "prompts": [{"prompt", "category"}]}; categories filter before num_prompts.

    `dataset` is a packaged set ('spec_bench': all 480 Spec-Bench questions, first turns; 'mt_bench': its 80
    MT-bench first turns, one category after another) or a file. `path`: the named set read from this file (in
    Spec-Bench's format) instead of the packaged copy."""
    if dataset == "mt_bench":
        rows, _ = mt_bench_prompts(path=path)
        return _finish("mt_bench", spec_bench_path() if path is None else Path(path).expanduser(), rows, categories,
                       num_prompts)
    if dataset == "spec_bench":
        path = spec_bench_path() if path is None else _given_file(path)
    else:
        path = Path(dataset)
    if not path.suffix and not path.exists():
        raise SpecscopeError(f"dataset file {str(path)!r} does not exist (packaged sets: {', '.join(NAMED)})")
    require_file(path, "dataset file")
    text = read_text(path, "dataset file")        # strict: a bad byte is an error, never a U+FFFD prompt
    rows = []
    if path.suffix in (".jsonl", ".json"):
        items = None
        if path.suffix == ".json":
            items = loads(text, str(path))
            if not isinstance(items, list):
                raise SpecscopeError(f"{path}: expected a JSON list of prompts")
        else:
            items = []
            for i, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    items.append(loads(line, f"{path}:{i}"))
        for i, obj in enumerate(items, 1):
            p, c = _prompt_of(obj, f"{path}:{i}")
            rows.append({"prompt": p, "category": c})
    else:  # plain text: one prompt per non-empty line
        rows = [{"prompt": ln, "category": None} for ln in text.splitlines() if ln.strip()]
    return _finish("spec_bench" if dataset == "spec_bench" else path.name, path, rows, categories, num_prompts)


def _finish(name: str, path: Path, rows: list[dict], categories, num_prompts) -> dict:
    if categories:
        have = sorted({r["category"] for r in rows if r["category"]})
        unknown = [c for c in categories if c not in have]
        if unknown:
            raise SpecscopeError(f"unknown --category {', '.join(unknown)}; {path.name} has: "
                                 f"{', '.join(have) or 'no categories'}")
        rows = [r for r in rows if r["category"] in categories]
    if num_prompts is not None:
        rows = rows[:num_prompts]
    if not rows:
        raise SpecscopeError(f"{path}: no prompts to send")
    h = hashlib.sha256(json.dumps([r["prompt"] for r in rows]).encode()).hexdigest()[:16]
    return {"name": name, "path": str(path), "hash": h, "prompts": rows}


# Common short English words: with a BPE tokenizer most are one token with their leading space, so n words make a
# prompt of about n tokens without the client needing the server's tokenizer. The server's usage counts are what
# the results report (total_input_tokens).
_WORDS = ("the of and to in is was for on are with as his they be at one have this from or had by hot word but "
          "what some we can out other were all there when up use your how said an each she which do their time if "
          "will way about many then them write would like so these her long make thing see him two has look more "
          "day could go come did number sound no most people my over know water than call first who may down side "
          "been now find any new work part take get place made live where after back little only round man year "
          "came show every good me give our under name very through just form great think say help low line "
          "before turn cause same mean differ move right boy old too does tell set three want air well also play "
          "small end put home read hand port large spell add even land here must big high such follow act why ask "
          "men change went light kind off need house picture try us again animal point mother world near build "
          "self earth father head stand own page should country found answer school grow study still learn plant "
          "cover food sun four thought let keep eye never last door between city tree cross since hard start might "
          "story saw far sea draw left late run while press close night real life few stop open seem together next "
          "white children begin got walk example ease paper often always music those both mark book letter until "
          "mile river car feet care second group carry took rain eat room friend began idea fish mountain north "
          "once base hear horse cut sure watch color face wood main enough plain girl usual young ready above ever "
          "red list though feel talk bird soon body dog family direct pose leave song measure state product black "
          "short numeral class wind question happen complete ship area half rock order fire south problem piece "
          "told knew pass farm top whole king size heard best hour better true during hundred am remember step "
          "early hold west ground interest reach fast five sing listen six table travel less morning ten simple "
          "several vowel toward war lay against pattern slow center love person money serve appear road map "
          "science rule govern pull cold notice voice fall power town fine certain fly unit lead cry dark machine "
          "note wait plan figure star box noun field rest correct able pound done beauty drive stood contain front "
          "teach week final gave green oh quick develop sleep warm free minute strong special mind behind clear "
          "tail produce fact street inch lot nothing course stay wheel full force blue object decide surface deep "
          "moon island foot yet busy test record boat common gold possible plane age dry wonder laugh thousand ago "
          "ran check game shape yes miss brought heat snow bed bring sit perhaps fill east weight language among").split()


def random_prompts(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   seed: int = 0) -> list[dict]:
    """vLLM's `--dataset-name random`, tokenizer-free: n prompts of about input_len tokens (random words) and
    output lengths of output_len, each drawn uniformly from [len·(1 - r), len·(1 + r)]. Rows are
    {"prompt", "category": None, "max_tokens", "input_len"}; send them with ignore_eos for exact outputs."""
    if input_len < 1 or output_len < 1:
        raise SpecscopeError(f"--random-input-len and --random-output-len must be >= 1, got {input_len}, "
                             f"{output_len}")
    if not 0.0 <= range_ratio < 1.0:
        raise SpecscopeError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)

    def draw(x):
        return max(1, rng.randint(int(x * (1 - range_ratio)), int(math.ceil(x * (1 + range_ratio)))))

    rows = []
    for _ in range(n):
        k, m = draw(input_len), draw(output_len)
        rows.append({"prompt": " ".join(rng.choice(_WORDS) for _ in range(k)), "category": None, "max_tokens": m,
                     "input_len": k})
    return rows
