"""The standing bad-input suite: hostile or careless input to every command, the server and the registry.

Each CLI case must end in exit 2, exactly one `error:` line that names the problem, no traceback, no trip through
the internal-error handler (exit 70), and a registry file that did not change. Each server case must get the
right 4xx with an OpenAI-style error body naming the field, and leave the server healthy. Cases that can be
refused from flags and files alone must be refused before any model loads (a guard turns a load into exit 70).

The tables are data: add a row when a new way to break things turns up.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import random
import shutil
import struct
import sys
from pathlib import Path

import pytest

from cli_util import cli
from tiny import make_hf_model, make_tiny_tokenizer

# ---------------------------------------------------------------------------------------------------- the world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target with tokenizer, an EAGLE-3 drafter for it, a registry holding two runs, and a few files."""
    from spec_helpers import tiny_target_and_drafter
    from specscope.registry import make_record, store_record

    root = tmp_path_factory.mktemp("bad_input")
    model, drafter, _ = tiny_target_and_drafter(root)
    db = root / "runs.db"
    for i in range(2):
        store_record(make_record("generate", name=f"run {i}", config={"model": str(model), "steps": 3},
                                 results={"tok_per_s": 10.0 + i}, env={"host": "test"}), db)
    files = root / "files"
    files.mkdir()
    return {"root": root, "model": model, "drafter": drafter, "db": db, "files": files}


def db_state(db: Path) -> str:
    """The registry's stored data: the SQLite file's bytes and its rows (a WAL file would hold unflushed writes)."""
    import sqlite3

    h = hashlib.sha256(db.read_bytes())
    wal = Path(str(db) + "-wal")
    if wal.exists():
        h.update(wal.read_bytes())
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        for line in con.iterdump():
            h.update(line.encode())
    finally:
        con.close()
    return h.hexdigest()


def snapshot(root: Path) -> dict:
    """Every regular file under root (the case's inputs, any --db it names) -> its content hash."""
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*"))
            if p.is_file() and "state" not in p.relative_to(root).parts}


def variant(src: Path, dst: Path, config=None, files=None) -> Path:
    """A copy of a checkpoint directory with config.json edited (`config(dict)` mutates it) or files replaced."""
    shutil.copytree(src, dst)
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        config(c)
        (dst / "config.json").write_text(json.dumps(c))
    for name, data in (files or {}).items():
        p = dst / name
        if data is None:
            p.unlink()
        else:
            p.write_bytes(data)
    return dst


def setitem(key, value):
    def f(c):
        c[key] = value
    return f


# ---------------------------------------------------------------------------------------------- generated cases

BAD_VALUES = {"null": None, "string": "many", "negative": -1, "huge": 10**12}
# config.json field -> the variants that must be refused (null is "use the default" for optional fields)
TARGET_FIELDS = {
    "vocab_size": "null string negative huge",
    "hidden_size": "null string negative huge",
    "intermediate_size": "null string negative huge",
    "num_hidden_layers": "null string negative huge",
    "num_attention_heads": "null string negative huge",
    "num_key_value_heads": "string negative huge",
    "head_dim": "string negative huge",
    "max_position_embeddings": "string negative huge",
    "rms_norm_eps": "string negative huge",
    "rope_theta": "string negative huge",
    "tie_word_embeddings": "string negative huge",
    "bos_token_id": "string negative huge",
    "eos_token_id": "string negative huge",
    "hidden_act": "string negative huge",
    "architectures": "string negative huge",
}
DRAFTER_FIELDS = {
    "hidden_size": "null string negative huge",
    "num_attention_heads": "null string negative huge",
    "intermediate_size": "null string negative huge",
    "vocab_size": "null string negative huge",
    "draft_vocab_size": "string negative huge",
    "num_key_value_heads": "string negative huge",
    "max_position_embeddings": "string negative huge",
    "rms_norm_eps": "string negative huge",
    "num_hidden_layers": "string negative huge",
    "rope_theta": "string negative",
}


def _value(field, kind):
    if kind == "huge" and field in ("rope_theta",):
        return float("inf")  # json.dumps writes Infinity, which Python's json reads back
    return BAD_VALUES[kind]


def _config_cases(fields, who):
    out = []
    for field, kinds in fields.items():
        for kind in kinds.split():
            out.append((f"{who} {field}={kind}", field, _value(field, kind)))
    return out


TARGET_CONFIG_CASES = _config_cases(TARGET_FIELDS, "target")
DRAFTER_CONFIG_CASES = _config_cases(DRAFTER_FIELDS, "drafter")


def safetensors_cuts(data: bytes) -> dict[str, bytes]:
    """The file cut at each section boundary of the safetensors layout: u64 header length, JSON header, data."""
    n = struct.unpack("<Q", data[:8])[0]
    rng = random.Random(16)
    return {
        "empty": b"",
        "inside the length prefix": data[:4],
        "after the length prefix": data[:8],
        "inside the JSON header": data[:8 + n // 2],
        "after the JSON header": data[:8 + n],
        "inside the tensor data": data[:8 + n + (len(data) - 8 - n) // 2],
        "last byte missing": data[:-1],
        "header length 2**63": struct.pack("<Q", 2**63) + data[8:],
        "header length past the end": struct.pack("<Q", len(data)) + data[8:],
        "header bytes not UTF-8": data[:8] + b"\xff" * n + data[8 + n:],
        "header JSON a list": struct.pack("<Q", 2) + b"[]",
        "random bytes": bytes(rng.getrandbits(8) for _ in range(4096)),
        "random bytes, plausible length": struct.pack("<Q", 64) + bytes(rng.getrandbits(8) for _ in range(512)),
    }


# ---------------------------------------------------------------------------------------------- the CLI table
# id -> (function(world, tmp) -> argv, substrings the error line must contain, must fail before a model loads)
# A function may return (argv, stdin bytes).

def gen(w, *extra):
    return ["generate", "--model", w["model"], "--prompt", "the quick brown fox", "--no-record", *extra]


def fpath(w, name, data: bytes | str):
    p = w["tmp"] / name
    p.write_bytes(data.encode() if isinstance(data, str) else data)
    return p


DEEP_200K = "[" * 200_000 + "]" * 200_000
SGLANG_URL = "http://127.0.0.1:9"  # nothing listens on the discard port; dataset errors come before any request


def bench(w, dataset, *extra):
    return ["bench-serve", "--base-url", SGLANG_URL, "--dataset", dataset, "--no-record", *extra]


CLI_CASES = {
    # -- the table
    "target rope_parameters linear without factor": (
        lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", setitem(
            "rope_parameters", {"rope_type": "linear", "rope_theta": 100000.0}))], ["factor", "linear"], True),
    "drafter rope_scaling a string": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", setitem("rope_scaling", "linear"))),
        ["rope_scaling", "'linear'"], True),
    "drafter num_hidden_layers 'one'": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", setitem("num_hidden_layers", "one"))),
        ["num_hidden_layers", "'one'"], True),
    "generate --temperature nan": (lambda w: gen(w, "--temperature", "nan"), ["--temperature", "nan"], True),
    "generate --temperature inf": (lambda w: gen(w, "--temperature", "inf"), ["--temperature", "inf"], True),
    "generate --seed 1e20": (lambda w: gen(w, "--seed", "99999999999999999999", "--temperature", "1"),
                             ["--seed", "99999999999999999999"], True),
    "--prompt - with a 0xff byte": (
        lambda w: (["generate", "--model", w["model"], "--prompt", "-", "--no-record"], b"\xff"),
        ["UTF-8", "0xff"], True),
    "dataset line nested 200,000 deep": (lambda w: bench(w, fpath(w, "deep.jsonl", DEEP_200K + "\n")),
                                         ["deep.jsonl:1", "nested too deeply"], True),
    "runs export -o /proc/x.csv": (lambda w: ["runs", "export", "last", "--format", "csv", "-o", "/proc/x.csv"],
                                   ["/proc/x.csv"], True),
    "breakeven τ above steps + 1": (
        lambda w: ["breakeven", "--decode-ms", "10", "--verify-ms", "12", "--draft-ms", "3", "--steps", "2",
                   "--measured-accept-length", "50"], ["τ = 50", "at most 3"], True),
    "draft tokens beyond what steps/topk propose": (
        lambda w: gen(w, "--draft", w["drafter"], "--steps", "2", "--topk", "1", "--draft-tokens", "10"),
        ["--draft-tokens 10"], True),
    "n-gram with --topk 2": (lambda w: gen(w, "--draft", "ngram", "--topk", "2"), ["n-gram", "--topk 1"], True),
    "--ngram-tokens without a hybrid": (lambda w: gen(w, "--draft", "ngram", "--ngram-tokens", "3"),
                                        ["--ngram-tokens", "DRAFTER+ngram"], True),
    "ngram-lookup with --topk 2": (lambda w: gen(w, "--draft", "ngram-lookup", "--topk", "2"),
                                   ["n-gram", "--topk 1"], True),
    "max-new-tokens above the context": (lambda w: gen(w, "--max-new-tokens", "100000"),
                                         ["--max-new-tokens 100000", "256"], True),
    "missing tokenizer": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m",
                                                                 files={"tokenizer.json": None})],
                          ["tokenizer.json"], True),
    "ingest /dev/zero": (lambda w: ["ingest", "/dev/zero"], ["/dev/zero", "not a regular file"], True),
    # -- sampling and decoding flags
    "--temperature -1": (lambda w: gen(w, "--temperature", "-1"), ["--temperature"], True),
    "--temperature 2.5": (lambda w: gen(w, "--temperature", "2.5"), ["--temperature", "2.5"], True),
    "--temperature hot": (lambda w: gen(w, "--temperature", "hot"), ["--temperature", "hot"], True),
    "--seed -1": (lambda w: gen(w, "--seed", "-1"), ["--seed", "-1"], True),
    "--seed 2**63": (lambda w: gen(w, "--seed", str(2**63)), ["--seed", str(2**63)], True),
    "--seed x": (lambda w: gen(w, "--seed", "x"), ["--seed"], True),
    "--top-p 0": (lambda w: gen(w, "--top-p", "0"), ["--top-p"], True),
    "--top-p nan": (lambda w: gen(w, "--top-p", "nan"), ["--top-p", "nan"], True),
    "--top-p 1.5": (lambda w: gen(w, "--top-p", "1.5"), ["--top-p", "1.5"], True),
    "--top-k -2": (lambda w: gen(w, "--top-k", "-2"), ["--top-k", "-2"], True),
    "--max-new-tokens 0": (lambda w: gen(w, "--max-new-tokens", "0"), ["--max-new-tokens"], True),
    "--steps without --draft": (lambda w: gen(w, "--steps", "3"), ["--draft"], True),
    "--threads 0": (lambda w: gen(w, "--threads", "0"), ["--threads"], True),
    "--dtype fp8": (lambda w: gen(w, "--dtype", "fp8"), ["--dtype", "fp8"], True),
    "--draft a missing directory": (lambda w: gen(w, "--draft", w["tmp"] / "nope"), ["nope", "not found"], True),
    "--draft a file": (lambda w: gen(w, "--draft", fpath(w, "x.bin", b"x")), ["x.bin", "not a directory"], True),
    "bench-serve --temperature nan": (lambda w: bench(w, "spec_bench", "--temperature", "nan"),
                                      ["--temperature", "nan"], True),
    "train --seed -1": (lambda w: ["train", "--workdir", w["tmp"] / "wd", "--model", w["model"], "--seed", "-1"],
                        ["--seed", "-1"], True),
    "train --dataset /dev/zero": (
        lambda w: ["train", "--workdir", w["tmp"] / "wd", "--model", w["model"], "--stages", "data",
                   "--dataset", "/dev/zero"], ["/dev/zero", "not a regular file"], True),
    "serve --draft ngram --topk 2": (lambda w: ["serve", "--model", w["model"], "--draft", "ngram", "--topk", "2",
                                                "--port", "0"], ["n-gram", "--topk 1"], True),
    "serve --max-queue 0": (lambda w: ["serve", "--model", w["model"], "--max-queue", "0"], ["--max-queue"], True),
    "serve --port 70000": (lambda w: ["serve", "--model", w["model"], "--port", "70000"], ["--port"], True),
    "breakeven --decode-ms nan": (lambda w: ["breakeven", "--decode-ms", "nan", "--verify-ms", "1", "--draft-ms",
                                             "1", "--steps", "2"], ["--decode-ms", "nan"], True),
    "breakeven --verify-ms inf": (lambda w: ["breakeven", "--decode-ms", "1", "--verify-ms", "inf", "--draft-ms",
                                             "1", "--steps", "2"], ["verify", "inf"], True),
    "tune --max-steps 1e9": (lambda w: ["tune", "--run", "last", "--decode-ms", "10", "--max-steps", "1000000000"],
                             ["--max-steps"], True),
    "breakeven --steps 0": (lambda w: ["breakeven", "--decode-ms", "1", "--verify-ms", "1", "--draft-ms", "1",
                                       "--steps", "0"], ["--steps"], True),
    "breakeven τ nan": (lambda w: ["breakeven", "--decode-ms", "1", "--verify-ms", "2", "--draft-ms", "1",
                                   "--steps", "2", "--measured-accept-length", "nan"], ["τ", "nan"], True),
    "verify-curve --batch 0": (lambda w: ["verify-curve", "--model", w["model"], "--batch", "0", "--no-record"],
                               ["--batch", ">= 1"], True),
    "verify-curve --batch 1e5": (lambda w: ["verify-curve", "--model", w["model"], "--context", "16", "--batch",
                                            "1,100000", "--no-record"], ["--batch", "<= 1024"], True),
    "verify-curve --max-seq-len below the batch context": (
        lambda w: ["verify-curve", "--model", w["model"], "--context", "16", "--batch", "2", "--batch-context", "64",
                   "--max-seq-len", "8", "--no-record"], ["--max-seq-len 8"], True),
    "breakeven --batch 1e9": (lambda w: ["breakeven", "--decode-ms", "1", "--verify-ms", "2", "--draft-ms", "1",
                                         "--steps", "2", "--batch", "1000000000"], ["--batch"], True),
    "tune --max-concurrency 0": (lambda w: ["tune", "--run", "last", "--max-concurrency", "0"],
                                 ["--max-concurrency"], True),
    "tune --save-policy /proc/x.json": (lambda w: ["tune", "--run", "last", "--save-policy", "/proc/x.json"],
                                        ["--save-policy", "/proc/x.json"], True),
    # -- output paths: refused before the work, not after it
    "train --workdir /proc/x": (lambda w: ["train", "--workdir", "/proc/x", "--model", w["model"]],
                                ["--workdir", "/proc/x"], True),
    "train -o /proc/y": (lambda w: ["train", "--workdir", w["tmp"] / "wd", "-o", "/proc/y", "--model",
                                    w["model"]], ["--output", "/proc/y"], True),
    "export -o /proc/x": (lambda w: ["export", w["drafter"], "--format", "speculators", "-o", "/proc/x"],
                          ["--output", "/proc/x"], True),
    "verify-curve -o /proc/x.png": (lambda w: ["verify-curve", "--model", w["model"], "-o", "/proc/x.png",
                                               "--no-record"], ["--output", "/proc/x.png"], True),
    "train for a 2-layer target": (lambda w: ["train", "--workdir", w["tmp"] / "wd", "--model", _two_layers(w),
                                              "--stages", "data", "--synth", "2"], ["2 layers", "at least 4"], False),
    # -- prompts
    "--prompt - invalid UTF-8 mid-text": (
        lambda w: (["generate", "--model", w["model"], "--prompt", "-", "--no-record"], b"the quick \xc3\x28 fox"),
        ["UTF-8", "offset 10"], True),
    "blank prompt": (lambda w: ["generate", "--model", w["model"], "--prompt", "   ", "--no-record"], ["empty"],
                     False),
    "prompt longer than the context": (
        lambda w: ["generate", "--model", w["model"], "--prompt", " ".join(["fox"] * 300), "--no-record"],
        ["300 tokens", "256"], False),
    # -- model directories
    "model directory missing": (lambda w: gen(w) + ["--model", w["tmp"] / "nope"], ["nope"], True),
    "model is a file": (lambda w: gen(w) + ["--model", fpath(w, "f.json", "{}")], ["not a directory"], True),
    "config.json not JSON": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "config.json": b"{not json"})], ["config.json", "not valid JSON"], True),
    "config.json not UTF-8": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "config.json": b'{"a": "\xff"}'})], ["config.json", "UTF-8"], True),
    "config.json nested 200,000 deep": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "config.json": DEEP_200K.encode()})], ["config.json", "nested too deeply"], True),
    "config.json random bytes": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "config.json": bytes(random.Random(11).getrandbits(8) for _ in range(600))})], ["config.json"], True),
    "config.json cut in the middle": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "config.json": (w["model"] / "config.json").read_bytes()[:300]})], ["config.json", "not valid JSON"], True),
    "config.json empty": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "config.json": b""})], ["config.json", "not valid JSON"], True),
    "chat template that does not parse": (
        lambda w: gen(w, "--chat") + ["--model", _with_template(w, "{% for m in messages %}{{ m.content ")],
        ["chat template", "tokenizer_config.json"], False),
    "chat template that raises": (
        lambda w: gen(w, "--chat") + ["--model", _with_template(w, "{{ raise_exception('no user turns here') }}")],
        ["chat template", "no user turns here"], False),
    "tokenizer.json random bytes": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "tokenizer.json": bytes(random.Random(13).getrandbits(8) for _ in range(600))})], ["tokenizer"], False),
    "drafter config.json random bytes": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", files={
            "config.json": bytes(random.Random(17).getrandbits(8) for _ in range(600))})), ["config.json"], True),
    "config.json a list": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "config.json": b"[1]"})], ["config.json", "JSON object"], True),
    "config.json is a directory": (lambda w: gen(w) + ["--model", _config_dir(w)], ["config.json"], True),
    "rope_scaling llama3 high <= low": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", setitem(
        "rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}))],
        ["high_freq_factor"], True),
    "rope_scaling yarn": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", setitem(
        "rope_scaling", {"rope_type": "yarn", "factor": 4.0}))], ["yarn"], True),
    "rope_scaling factor 0": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", setitem(
        "rope_scaling", {"rope_type": "linear", "factor": 0}))], ["factor"], True),
    "index.json weight_map a list": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "model.safetensors.index.json": b'{"weight_map": [1]}'})], ["weight_map"], True),
    "index.json names ../ shards": (lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m", files={
        "model.safetensors.index.json": b'{"weight_map": {"a": "../x.safetensors"}}'})], ["weight_map"], True),
    # -- drafter directories
    "drafter eagle_config a string": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", setitem("eagle_config", "x"))),
        ["eagle_config"], True),
    "drafter aux layer ids two": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", setitem(
            "eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, 2]}))), ["eagle_aux_hidden_state_layer_ids"],
        True),
    "drafter rope_scaling no factor": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", setitem(
            "rope_scaling", {"rope_type": "linear"}))), ["factor"], True),
    "drafter config.json not JSON": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", files={"config.json": b"{"})),
        ["config.json", "not valid JSON"], True),
    "drafter architectures a dict": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", setitem("architectures", {"a": 1}))),
        ["architectures"], True),
    "drafter weights random bytes": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", files={
            "model.safetensors": bytes(random.Random(3).getrandbits(8) for _ in range(2048))})),
        ["model.safetensors", "corrupt or truncated"], False),
    "drafter weights missing": (
        lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d", files={"model.safetensors": None})),
        ["no model.safetensors"], False),
    # -- datasets
    "dataset line not JSON": (lambda w: bench(w, fpath(w, "d.jsonl", '{"prompt": "hi"}\n{oops\n')),
                              ["d.jsonl:2", "not valid JSON"], True),
    "dataset line a list": (lambda w: bench(w, fpath(w, "d.jsonl", "[1, 2]\n")), ["d.jsonl:1", "JSON object"],
                            True),
    "dataset line without a prompt": (lambda w: bench(w, fpath(w, "d.jsonl", '{"x": 1}\n')),
                                      ["d.jsonl:1", "no prompt"], True),
    "dataset .json not a list": (lambda w: bench(w, fpath(w, "d.json", '{"prompt": "hi"}')),
                                 ["d.json", "list"], True),
    "dataset .json nested deep": (lambda w: bench(w, fpath(w, "d.json", DEEP_200K)), ["nested too deeply"], True),
    "dataset random bytes": (lambda w: bench(w, fpath(w, "r.jsonl", bytes(random.Random(5).getrandbits(8)
                                                                           for _ in range(256)) + b"\n")),
                             ["r.jsonl"], True),
    "dataset empty": (lambda w: bench(w, fpath(w, "e.jsonl", "")), ["no prompts"], True),
    "dataset /dev/zero": (lambda w: bench(w, "/dev/zero"), ["/dev/zero", "not a regular file"], True),
    "dataset a directory": (lambda w: bench(w, w["tmp"]), ["is a directory"], True),
    "dataset missing": (lambda w: bench(w, w["tmp"] / "nope.jsonl"), ["nope.jsonl", "does not exist"], True),
    "dataset unknown category": (lambda w: bench(w, fpath(w, "c.jsonl", '{"prompt": "a", "category": "x"}\n'),
                                                 "--category", "y"), ["--category y"], True),
    # -- logs
    "ingest a directory": (lambda w: ["ingest", w["tmp"]], ["directory"], True),
    "ingest a missing file": (lambda w: ["ingest", w["tmp"] / "nope.log"], ["nope.log", "does not exist"], True),
    "ingest random bytes": (lambda w: ["ingest", fpath(w, "r.log", bytes(random.Random(7).getrandbits(8)
                                                                        for _ in range(4096)))],
                            ["r.log", "no recognisable line"], True),
    "ingest an empty file": (lambda w: ["ingest", fpath(w, "e.log", "")], ["e.log", "no recognisable line"], True),
    "ingest a corrupt .gz": (lambda w: ["ingest", fpath(w, "c.log.gz", gzip.compress(b"sglang\n" * 4000)[:-20])],
                             ["c.log.gz", "cannot read"], True),
    "ingest deeply nested JSON lines": (lambda w: ["ingest", fpath(w, "n.log", DEEP_200K[:20000] + "\n")],
                                        ["n.log"], True),
    "ingest --format bogus": (lambda w: ["ingest", "--format", "bogus", fpath(w, "x.log", "x\n")], ["--format"],
                              True),
    # -- registry ids and paths
    "runs show unknown id": (lambda w: ["runs", "show", "nope"], ["'nope'"], True),
    "runs show last~1e20": (lambda w: ["runs", "show", "last~99999999999999999999"], ["fewer runs"], True),
    "runs show last~-1": (lambda w: ["runs", "show", "last~-1"], ["last~N"], True),
    "runs show an id with a control byte": (lambda w: ["runs", "show", "abcd\x01"], ["no run"], True),
    "compare last with last~1e20": (lambda w: ["compare", "last", "last~99999999999999999999"], ["fewer runs"],
                                    True),
    "runs show empty id": (lambda w: ["runs", "show", ""], ["too short"], True),
    "runs export unknown id": (lambda w: ["runs", "export", "zzzz"], ["'zzzz'"], True),
    "runs export -o a directory": (lambda w: ["runs", "export", "last", "-o", w["tmp"]], ["directory"], True),
    "runs export -o in a missing directory": (lambda w: ["runs", "export", "last", "-o", w["tmp"] / "no" / "x.json"],
                                              ["x.json"], True),
    "runs tag unknown id": (lambda w: ["runs", "tag", "zzzz", "t"], ["'zzzz'"], True),
    "runs delete unknown id": (lambda w: ["runs", "delete", "zzzz"], ["'zzzz'"], True),
    "compare unknown ids": (lambda w: ["compare", "zzzz", "yyyy"], ["zzzz"], True),
    "report unknown id": (lambda w: ["report", "zzzz", "-o", w["tmp"] / "r.html"], ["'zzzz'"], True),
    "breakeven --run unknown id": (lambda w: ["breakeven", "--run", "zzzz"], ["'zzzz'"], True),
    "breakeven --run last without timings": (lambda w: ["breakeven", "--run", "last"], ["lacks"], True),
    "--db a directory": (lambda w: ["runs", "list", "--db", w["tmp"]], ["registry"], True),
    "--db random bytes": (lambda w: ["runs", "list", "--db", fpath(w, "g.db", bytes(
        random.Random(9).getrandbits(8) for _ in range(8192)))], ["g.db", "not a usable specscope registry"], True),
}

# -- what specscope keeps or reads around a command: the environment, impossible target configs, data files
SG_LINE = ("[2025-10-22 10:27:57 TP0] Decode batch. #running-req: 1, #token: 186, token usage: 0.00, accept len: "
           "1.95, accept rate: 0.49, cuda graph: True, gen throughput (token/s): 178.86, #queue-req: 0,")


def train(w, *extra, stages="train"):
    return ["train", "--workdir", w["tmp"] / "wd", "--model", w["model"], "--stages", stages, *extra]


def with_env(argv, **env):
    return {"argv": argv, "env": env}


def _parquet(w, cut: bool):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = w["tmp"] / ("cut.parquet" if cut else "bad.parquet")
    if not cut:
        return fpath(w, p.name, b"PAR1 not a parquet file at all")
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": "hi"}]] * 8}), p)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    return p


for _var, _val, _expect in (("LOCAL_RANK", "abc", ["LOCAL_RANK='abc'", "not an integer", "torchrun"]),
                            ("LOCAL_RANK", "-1", ["LOCAL_RANK=-1", "0..0"]),
                            ("LOCAL_RANK", "99", ["LOCAL_RANK=99", "0..0"]),
                            ("WORLD_SIZE", "2", ["WORLD_SIZE=2", "MASTER_ADDR", "torchrun"]),
                            ("WORLD_SIZE", "0", ["WORLD_SIZE=0", ">= 1"]),
                            ("RANK", "1", ["RANK=1", "0..0", "WORLD_SIZE is 1"])):
    CLI_CASES[f"train with {_var}={_val}"] = ((lambda v, x: lambda w: with_env(train(w), **{v: x}))(_var, _val),
                                              _expect, True)
CLI_CASES.update({
    "SPECSCOPE_KERNELS=bogus": (lambda w: with_env(gen(w), SPECSCOPE_KERNELS="bogus"),
                                ["SPECSCOPE_KERNELS='bogus'", "auto, avx512_bf16, avx512, avx2, neon, off"], True),
    "SPECSCOPE_LINEAR_TUNE=yes": (lambda w: with_env(gen(w), SPECSCOPE_LINEAR_TUNE="yes"),
                                  ["SPECSCOPE_LINEAR_TUNE='yes'", "1", "0"], True),
    "SPECSCOPE_CACHE a file": (lambda w: with_env(gen(w), SPECSCOPE_CACHE=str(fpath(w, "cache", "x"))),
                               ["SPECSCOPE_CACHE", "is a file"], True),
    "generate --draft-budget fixed without --draft": (lambda w: gen(w, "--draft-budget", "fixed"),
                                                      ["--draft-budget fixed", "--draft"], True),
    "train --dataset a corrupt Parquet file": (
        lambda w: train(w, "--dataset", _parquet(w, cut=False), stages="data"), ["bad.parquet", "Parquet"], True),
    "train --dataset a truncated Parquet file": (
        lambda w: train(w, "--dataset", _parquet(w, cut=True), stages="data"), ["cut.parquet"], True),
    "ingest a good file and a missing one": (
        lambda w: ["ingest", fpath(w, "good.log", SG_LINE + "\n"), w["tmp"] / "missing.log"],
        ["1 of 2 files", "nothing was stored"], True),
    "runs list --db an empty file": (lambda w: ["runs", "list", "--db", fpath(w, "empty.db", b"")],
                                     ["empty.db", "empty file"], True),
    "runs list --db another program's SQLite file": (
        lambda w: ["runs", "list", "--db", _foreign_sqlite(w)], ["other.db", "not a specscope registry"], True),
})
for _cmd in ("export", "check-drafter"):
    for _field, _val in (("hidden_size", "576"), ("max_position_embeddings", 0), ("num_attention_heads", 0),
                         ("vocab_size", 0), ("num_hidden_layers", "32")):
        CLI_CASES[f"{_cmd} against a target whose {_field} is {_val!r}"] = (
            (lambda c, f, v: lambda w: [c, w["drafter"], "--model", variant(w["model"], w["tmp"] / "m", setitem(f, v)),
                                        *(["--format", "speculators", "-o", w["tmp"] / "out"] if c == "export"
                                          else ["--no-run"])])(_cmd, _field, _val),
            ["target config.json", _field, repr(_val)], True)


def _foreign_sqlite(w):
    import sqlite3

    p = w["tmp"] / "other.db"
    con = sqlite3.connect(p)
    con.execute("CREATE TABLE notes (t TEXT)")
    con.commit()
    con.close()
    return p


def _with_template(w, template):
    d = variant(w["model"], w["tmp"] / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in d.glob("chat_template.j*"):  # newer transformers keep the template in its own file
        extra.write_text(template)
    return d


def _two_layers(w):
    d = w["tmp"] / "two"
    make_hf_model(d, "llama", layers=2, vocab=101)
    make_tiny_tokenizer(d, 101)
    return d


def _config_dir(w):
    d = variant(w["model"], w["tmp"] / "m", files={"config.json": None})
    (d / "config.json").mkdir()
    return d


for _id, _field, _v in TARGET_CONFIG_CASES:
    CLI_CASES[_id] = ((lambda f, v: lambda w: gen(w) + ["--model", variant(w["model"], w["tmp"] / "m",
                                                                           setitem(f, v))])(_field, _v),
                      [_field], True)
for _id, _field, _v in DRAFTER_CONFIG_CASES:
    CLI_CASES[_id] = ((lambda f, v: lambda w: gen(w, "--draft", variant(w["drafter"], w["tmp"] / "d",
                                                                        setitem(f, v))))(_field, _v),
                      [_field], True)


def _cut_case(cut):
    def make(w):
        data = (w["model"] / "model.safetensors").read_bytes()
        return gen(w) + ["--model", variant(w["model"], w["tmp"] / "m",
                                            files={"model.safetensors": safetensors_cuts(data)[cut]})]
    return make


for _cut in ("empty", "inside the length prefix", "after the length prefix", "inside the JSON header",
             "after the JSON header", "inside the tensor data", "last byte missing", "header length 2**63",
             "header length past the end", "header bytes not UTF-8", "header JSON a list", "random bytes",
             "random bytes, plausible length"):
    CLI_CASES[f"safetensors: {_cut}"] = (_cut_case(_cut), ["model.safetensors", "corrupt or truncated"], False)


@pytest.fixture
def guarded(world, tmp_path, monkeypatch, capsys):
    """Run one CLI case against the world registry; returns a runner (argv, stdin, preflight) -> error line."""
    import specscope.session as session

    monkeypatch.setenv("SPECSCOPE_DB", str(world["db"]))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    w = dict(world, tmp=tmp_path)

    def run(make, preflight: bool):
        got = make(w)
        if isinstance(got, dict):           # with_env: the command and the environment it runs in
            for k, v in got["env"].items():
                monkeypatch.setenv(k, v)
            got = got["argv"]
        argv, stdin = got if isinstance(got, tuple) else (got, None)
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin)))
        if preflight:  # these must be refused from flags and files alone: loading a model is a failure
            def no_load(*a, **k):
                raise AssertionError("a model was loaded before the input was refused")
            monkeypatch.setattr(session, "load_target", no_load)
            monkeypatch.setattr("specscope.models.loader.load_model", no_load)
        before = db_state(world["db"])
        files_before = snapshot(tmp_path)
        code, _, err = cli(capsys, *argv)
        assert "internal error" not in err, f"reached the internal-error handler: {err}"
        assert "Traceback" not in err, err
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2, f"exit {code}: {err}"
        assert len(lines) == 1 and lines[0].startswith("error: "), err
        assert db_state(world["db"]) == before, "the registry changed"
        assert snapshot(tmp_path) == files_before, "a refused command left files changed or behind"
        assert not (tmp_path / "state").exists(), "a crash report was written"
        return lines[0]

    return run


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_bad_input(guarded, case):
    make, expect, preflight = CLI_CASES[case]
    line = guarded(make, preflight)
    for s in expect:
        assert s in line, f"{s!r} not in {line!r}"


def test_the_suite_is_big_enough():
    assert len(CLI_CASES) + len(SERVER_CASES) >= 80


# ---------------------------------------------------------------------------------------------- no error at all

def test_breakeven_with_a_billion_steps_is_instant(capsys):
    """The α search evaluates E(α) in closed form: 10^9 steps cost what 2 do (it used to loop 10^9 times)."""
    code, out, err = cli(capsys, "breakeven", "--decode-ms", "10", "--verify-ms", "12", "--draft-ms", "3",
                         "--steps", "1000000000", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["max_accept_length"] == 1e9 + 1 and 0.33 < res["break_even_alpha"] < 0.34


def test_geometric_sum_matches_the_plain_sum():
    from specscope.economics.cost import _geometric_sum

    for a in (0.0, 0.1, 0.5, 0.9, 0.999999, 1 - 1e-12):
        for n in (1, 2, 7, 100):
            assert _geometric_sum(a, n) == pytest.approx(sum(a ** k for k in range(n)), rel=1e-9)


def test_one_sampling_schema_for_cli_server_and_library():
    from specscope.runtime.params import SEED_MAX, TEMPERATURE_MAX, ParamError, check_field
    from specscope.runtime.sampling import SamplingParams
    from specscope.server.protocol import ApiError, _common

    for field, bad in (("temperature", float("nan")), ("temperature", TEMPERATURE_MAX + 0.1), ("seed", SEED_MAX + 1),
                       ("seed", -1), ("top_p", 0.0), ("top_k", -2)):
        for style in ("cli", "api", "lib"):
            with pytest.raises(ParamError):
                check_field(field, bad, style)
        with pytest.raises(ApiError) as e:
            _common({field: bad}, "completion", 16)
        assert e.value.status == 400 and e.value.param == field
        with pytest.raises(ParamError):
            SamplingParams(**{field: bad})
    assert check_field("seed", SEED_MAX) == SEED_MAX and check_field("temperature", 2) == 2.0


# ---------------------------------------------------------------------------------------------- the last line

def test_an_unexpected_exception_is_one_line_and_exit_70(world, tmp_path, monkeypatch, capsys):
    import specscope.session as session

    def boom(*a, **k):
        raise RuntimeError("simulated bug\nsecond line")

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(session, "run_generate", boom)
    code, out, err = cli(capsys, "generate", "--model", world["model"], "--prompt", "hi", "--no-record")
    lines = err.strip().splitlines()
    assert code == 70 and len(lines) == 1 and "Traceback" not in err
    assert lines[0].startswith("internal error: RuntimeError: simulated bug — full traceback in ")
    assert lines[0].endswith("; please report it")
    crash = Path(lines[0].split("full traceback in ")[1].split(";")[0])
    assert crash.parent == tmp_path / "state" / "specscope"
    assert "Traceback" in crash.read_text() and "simulated bug" in crash.read_text()


# ---------------------------------------------------------------------------------------------- the server

@pytest.fixture(scope="module")
def server(world):
    from fastapi.testclient import TestClient

    from specscope.server.app import create_app
    from specscope.server.worker import ServedModel, ServeConfig

    engine = ServedModel(ServeConfig(model=str(world["model"]), device="cpu", dtype="fp32", max_tokens_cap=64,
                                max_body_bytes=1 << 20))
    with TestClient(create_app(engine), raise_server_exceptions=False) as c:
        yield c


OK = {"prompt": "the quick brown fox", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def body(**kw):
    return json.dumps(dict(OK, **kw))


# id -> (path, raw body, status, substring of the message, param)
SERVER_CASES = {
    "temperature NaN": ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', 400, "'temperature'",
                        "temperature"),
    "temperature Infinity": ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', 400, "'temperature'",
                             "temperature"),
    "top_p NaN": ("/v1/completions", '{"prompt": "hi", "top_p": NaN}', 400, "'top_p'", "top_p"),
    "seed NaN": ("/v1/completions", '{"prompt": "hi", "seed": NaN}', 400, "'seed'", "seed"),
    "max_tokens NaN": ("/v1/completions", '{"prompt": "hi", "max_tokens": NaN}', 400, "'max_tokens'", "max_tokens"),
    "temperature -1": ("/v1/completions", body(temperature=-1), 400, "'temperature'", "temperature"),
    "temperature 3": ("/v1/completions", body(temperature=3), 400, "'temperature'", "temperature"),
    "temperature a string": ("/v1/completions", body(temperature="hot"), 400, "'temperature'", "temperature"),
    "temperature true": ("/v1/completions", body(temperature=True), 400, "'temperature'", "temperature"),
    "temperature a 400-digit integer": ("/v1/completions", '{"prompt": "hi", "temperature": 1%s}' % ("0" * 400),
                                        400, "'temperature'", "temperature"),
    "max_tokens a 400-digit integer": ("/v1/completions", '{"prompt": "hi", "max_tokens": 1%s}' % ("0" * 400), 400,
                                       "'max_tokens'", "max_tokens"),
    "n a 400-digit integer": ("/v1/completions", '{"prompt": "hi", "n": 1%s}' % ("0" * 400), 400, "'n'", "n"),
    "seed a 5000-digit integer": ("/v1/completions", '{"prompt": "hi", "seed": 1%s}' % ("0" * 5000), 400,
                                  "not valid JSON", None),
    "seed 1e30": ("/v1/completions", body(seed=1e30), 400, "'seed'", "seed"),
    "seed 2**64": ("/v1/completions", body(seed=2**64), 400, "'seed'", "seed"),
    "seed -1": ("/v1/completions", body(seed=-1), 400, "'seed'", "seed"),
    "seed 1.5": ("/v1/completions", body(seed=1.5), 400, "'seed'", "seed"),
    "top_p 0": ("/v1/completions", body(top_p=0), 400, "'top_p'", "top_p"),
    "top_p 2": ("/v1/completions", body(top_p=2), 400, "'top_p'", "top_p"),
    "top_k -5": ("/v1/completions", body(top_k=-5), 400, "'top_k'", "top_k"),
    "top_k 1.5": ("/v1/completions", body(top_k=1.5), 400, "'top_k'", "top_k"),
    "max_tokens 0": ("/v1/completions", body(max_tokens=0), 400, "'max_tokens'", "max_tokens"),
    "max_tokens 1e9": ("/v1/completions", body(max_tokens=10**9), 400, "'max_tokens'", "max_tokens"),
    "max_tokens a string": ("/v1/completions", body(max_tokens="x"), 400, "'max_tokens'", "max_tokens"),
    "body nested 100,000 deep": ("/v1/completions", "[" * 100_000 + "]" * 100_000, 400, "nested too deeply", None),
    "body object nested deep": ("/v1/completions", '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", 400,
                                "nested too deeply", None),
    "body not JSON": ("/v1/completions", "{oops", 400, "not valid JSON", None),
    "body not UTF-8": ("/v1/completions", b'{"prompt": "\xff"}', 400, "not valid JSON", None),
    "body a list": ("/v1/completions", "[1]", 400, "JSON object", None),
    "body empty": ("/v1/completions", "", 400, "not valid JSON", None),
    "prompt missing": ("/v1/completions", '{"max_tokens": 2}', 400, "'prompt'", "prompt"),
    "prompt empty": ("/v1/completions", body(prompt=""), 400, "'prompt'", "prompt"),
    "prompt ids out of vocab": ("/v1/completions", body(prompt=[5, 10**6]), 400, "token ids", "prompt"),
    "prompt ids negative": ("/v1/completions", body(prompt=[-1]), 400, "token ids", "prompt"),
    "prompt a number": ("/v1/completions", body(prompt=7), 400, "'prompt'", "prompt"),
    "prompt longer than the context": ("/v1/completions", body(prompt=[5] * 300), 400, "at most", "prompt"),
    "prompt + max_tokens past the context": ("/v1/completions", body(prompt=[5] * 250, max_tokens=20), 400,
                                             "context length", "max_tokens"),
    "messages empty": ("/v1/chat/completions", json.dumps(dict(CHAT, messages=[])), 400, "'messages'", "messages"),
    "messages bad role": ("/v1/chat/completions", json.dumps(dict(CHAT, messages=[{"role": "x", "content": "a"}])),
                          400, "role", "messages"),
    "messages content a number": ("/v1/chat/completions", json.dumps(dict(CHAT, messages=[
        {"role": "user", "content": 5}])), 400, "content", "messages"),
    "stream a string": ("/v1/completions", body(stream="yes"), 400, "'stream'", "stream"),
    "stream_options a list": ("/v1/completions", body(stream_options=[1]), 400, "'stream_options'",
                              "stream_options"),
    "stop a number": ("/v1/completions", body(stop=[1]), 400, "'stop'", "stop"),
    "n 0": ("/v1/completions", body(n=0), 400, "'n'", "n"),
    "logprobs 50": ("/v1/completions", body(logprobs=50), 400, "'logprobs'", "logprobs"),
    "unknown model": ("/v1/completions", body(model="gpt-5"), 404, "gpt-5", "model"),
    "unknown route": ("/v1/embeddings", body(), 404, "no route", None),
    "body too large": ("/v1/completions", body(prompt="x" * (1 << 21)), 413, "over", None),
}


@pytest.mark.parametrize("case", list(SERVER_CASES))
def test_server_bad_request(server, case):
    path, raw, status, expect, param = SERVER_CASES[case]
    r = server.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert expect in err["message"] and err["code"] == status
    if param is not None:
        assert err["param"] == param
    assert server.get("/health").status_code == 200


def test_server_get_on_a_post_route_is_405(server):
    r = server.get("/v1/completions")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_server_bug_is_a_500_with_a_request_id_and_a_logged_traceback(server, caplog, monkeypatch):
    engine = server.app.state.served

    def boom(p):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(engine, "encode", boom)
    with caplog.at_level("ERROR", logger="specscope.server"):
        r = server.post("/v1/completions", json=OK)
    assert r.status_code == 500
    rid = r.headers["x-request-id"]
    assert rid in r.json()["error"]["message"] and "simulated" not in r.json()["error"]["message"]
    rec = [x for x in caplog.records if rid in x.getMessage()]
    assert rec and rec[0].exc_info and "simulated bug" in str(rec[0].exc_info[1])
    monkeypatch.undo()
    assert server.post("/v1/completions", json=OK).status_code == 200  # still serving


def test_server_bug_during_generation_names_the_request(server, caplog, monkeypatch):
    engine = server.app.state.served

    def boom(job, new_ids):   # inside the request's streaming callback, on the worker thread
        raise RuntimeError("simulated decode bug")

    monkeypatch.setattr(engine, "_emit", boom)
    with caplog.at_level("ERROR", logger="specscope.server"):
        r = server.post("/v1/completions", json=OK)
    assert r.status_code == 500
    msg = r.json()["error"]["message"]
    rid = msg.split("request id ")[1].split(")")[0]
    assert rid.startswith("cmpl-") and any(rid in x.getMessage() and x.exc_info for x in caplog.records)
