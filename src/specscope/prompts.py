"""Prompts for bench-serve: the shared Spec-Bench question file, or a user's jsonl / text file."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from specscope.errors import SpecscopeError, require_file
from specscope.jsonio import loads

SPEC_BENCH_FILE = "spec_bench_question.jsonl"


def spec_bench_path() -> Path:
    """$SPECSCOPE_SPEC_BENCH, else the project's shared data directory next to the checkout."""
    env = os.environ.get("SPECSCOPE_SPEC_BENCH")
    if env:
        return Path(env)
    here = Path(__file__).resolve()
    for base in [Path.cwd(), *here.parents]:
        for cand in (base / "shared" / "data" / SPEC_BENCH_FILE, base.parent / "shared" / "data" / SPEC_BENCH_FILE,
                     base / "data" / SPEC_BENCH_FILE):
            if cand.is_file():
                return cand
    raise SpecscopeError(f"cannot find {SPEC_BENCH_FILE}; set SPECSCOPE_SPEC_BENCH to its path or pass "
                         "--dataset FILE")


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


def load_prompts(dataset: str, categories: tuple[str, ...] = (), num_prompts: int | None = None) -> dict:
    """{"name", "path", "hash", "prompts": [{"prompt", "category"}]}; categories filter before num_prompts."""
    path = spec_bench_path() if dataset == "spec_bench" else Path(dataset)
    require_file(path, "dataset file")
    raw = path.read_bytes()
    rows = []
    if path.suffix in (".jsonl", ".json"):
        text = raw.decode("utf-8", errors="replace")
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
        rows = [{"prompt": ln, "category": None} for ln in raw.decode("utf-8", errors="replace").splitlines()
                if ln.strip()]
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
    return {"name": "spec_bench" if dataset == "spec_bench" else path.name, "path": str(path), "hash": h,
            "prompts": rows}
