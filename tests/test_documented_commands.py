"""Every command the README shows, and every "Try next" line the demo prints, run verbatim and succeeding.

The default suite runs them against a tiny random stand-in cached under the demo model's name (SPECSCOPE_CACHE and
SPECSCOPE_DB in a temporary directory), so `--model smollm2-135m` and the default model resolve without the real
weights. Placeholders in the README (RUN_A, ID, DRAFTER, sglang.log, ...) are filled with the runs and files made
by the commands before them. Commands that need the real SmolLM2 (the shipped EAGLE-3 drafter is sized for it) run
in the slow suite, which runs the whole README against the real model.

`make demo` / `make test` are not run here: they install a virtual environment and wrap `specscope demo` and
pytest, which the tests below and the suite itself cover.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
from pathlib import Path

import pytest

from cli_util import cli
from serve_util import Background
from tiny import make_hf_model, make_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "engine_logs"
NEEDS_REAL_MODEL = ("smollm2-135m-eagle3",)     # the shipped drafter only fits the real SmolLM2


def readme_commands() -> list[str]:
    """`specscope ...` commands of the README's indented code blocks, split at ';', comments dropped."""
    out = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if not line.startswith("    ") or line.startswith("     "):
            continue
        for part in line.strip().split(";"):
            cmd = re.sub(r"\s+#.*$", "", part).strip()
            if cmd.startswith("specscope "):
                out.append(cmd)
    return out


def test_readme_lists_the_commands_we_run():
    cmds = readme_commands()
    for needle in ("specscope generate", "specscope compare", "specscope breakeven", "specscope tune --run",
                   "specscope report", "specscope ingest", "specscope serve", "specscope bench-serve",
                   "specscope export"):
        assert any(c.startswith(needle) for c in cmds), needle


# ------------------------------------------------------------------------------------------------ stand-ins

def make_standin_cache(cache: Path) -> Path:
    """A tiny random Llama saved where `smollm2-135m` is looked up, with a manifest that passes `is_pulled`."""
    from specscope.models.hub import MANIFEST

    d = cache / "models" / "smollm2-135m"
    d.mkdir(parents=True)
    make_hf_model(d, "llama", layers=4, max_position_embeddings=2048)
    make_tiny_tokenizer(d)
    files = {f.name: {"sha256": "test-stand-in", "size": f.stat().st_size} for f in d.iterdir() if f.is_file()}
    (d / MANIFEST).write_text(json.dumps({"name": "smollm2-135m", "source": "test stand-in", "files": files}))
    return d


SGLANG_LOG = """[2025-10-22 10:27:50] server_args=ServerArgs(model_path='meta-llama/Llama-3.1-8B-Instruct', \
dtype='auto', tp_size=1, speculative_algorithm='EAGLE3', speculative_draft_model_path='org/eagle3', \
speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4, decode_log_interval=40)
[2025-10-22 10:27:57 TP0] Decode batch. #running-req: 1, #token: 186, token usage: 0.00, accept len: 1.95, \
accept rate: 0.49, cuda graph: True, gen throughput (token/s): 178.86, #queue-req: 0,
[2025-10-22 10:27:59 TP0] Decode batch. #running-req: 1, #token: 226, token usage: 0.00, accept len: 2.15, \
accept rate: 0.54, cuda graph: True, gen throughput (token/s): 190.02, #queue-req: 0,
"""
VLLM_LOG = """INFO 10-22 10:27:01 [metrics.py:100] SpecDecoding metrics: Mean acceptance length: 2.20, \
Accepted throughput: 8.90 tokens/s, Drafted throughput: 97.50 tokens/s, Accepted: 120 tokens, Drafted: 300 tokens, \
Per-position acceptance rate: 0.600, 0.400, 0.200, Avg Draft acceptance rate: 40.0%
INFO 10-22 10:27:02 [loggers.py:123] Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: \
95.0 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.1%, Prefix cache hit rate: 0.0%
"""
PROM = """# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 1000
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 2000
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 1500
vllm:generation_tokens_total{model_name="m"} 9000
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 1100
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 2200
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 1650
vllm:generation_tokens_total{model_name="m"} 9300
"""


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


# ------------------------------------------------------------------------------------------------ the runner

class Session:
    """Runs README commands in order, filling placeholders from what the earlier ones made."""

    def __init__(self, capsys, cwd: Path, env: dict, drafter: Path | None = None):
        self.capsys, self.cwd, self.env = capsys, cwd, env
        self.drafter = drafter                  # DRAFTER: the shipped one unless a stand-in is given
        self.generated: list[str] = []          # run ids of `specscope generate`
        self.ingested: list[str] = []
        self.by_file: dict[str, str] = {}       # ingested file name -> run id (RUN_K1 ... come from vLLM's)
        self.server: Background | None = None
        self.ran: list[str] = []

    def fill(self, cmd: str) -> str:
        from specscope.speculative.decode import ASSETS, DEFAULT_DRAFTER

        runs = " ".join(self.generated)
        first, last = (self.generated[0], self.generated[-1]) if self.generated else ("?", "?")
        subs = [("RUN_A", first), ("RUN_B", last), ("RUNS...", runs), ("RUN...", runs),
                ("INGESTED_A", self.ingested[0] if self.ingested else "?"),
                ("INGESTED_B", self.ingested[-1] if self.ingested else "?"),
                ("DRAFTER", str(self.drafter or ASSETS / DEFAULT_DRAFTER))]
        subs += [(f"RUN_{k.upper()}", self.by_file.get(f"vllm-{k}.jsonl", "?")) for k in ("plain", "k1", "k3")]
        spec = next((r for r in reversed(self.generated) if self._is_spec(r)), "?")
        subs.append(("--run ID", f"--run {spec}"))
        for a, b in subs:
            cmd = re.sub(rf"(?<![\w-]){re.escape(a)}(?![\w.-])", b, cmd) if a != "--run ID" else cmd.replace(a, b)
        return cmd

    def _is_spec(self, rid: str) -> bool:
        from specscope.registry import open_registry

        with open_registry() as reg:
            return bool((reg.get_run(rid, samples=False).get("config") or {}).get("draft"))

    def run(self, readme_cmd: str) -> str:
        cmd = self.fill(readme_cmd)
        argv = shlex.split(cmd)[1:]
        if argv[0] == "serve":
            url_port = 8000
            if not _port_free(url_port):           # somebody else holds 8000: same command on a free port
                argv += ["--port", "0"]
            self.server = Background(argv, self.env, self.cwd)
            self.ran.append(cmd)
            return ""
        if argv[0] == "bench-serve" and self.server is not None:
            argv = [a.replace("http://127.0.0.1:8000", self.server.url) for a in argv]
            if not any(a.startswith("--base-url") or a == "--url" for a in argv):
                argv += ["--base-url", self.server.url]
        code, out, err = cli(self.capsys, *argv)
        assert code == 0, f"`{cmd}` failed ({code}):\n{err[-3000:]}"
        self.ran.append(cmd)
        if argv[0] == "generate":
            rid = json.loads(out)["run_id"] if "--json" in argv else re.search(r"Run stored: (\w+)", err).group(1)
            self.generated.append(rid)
        if argv[0] == "ingest":
            from specscope.registry import open_registry

            with open_registry() as reg:
                self.ingested = [r["id"] for r in reversed(reg.list_runs(kind="ingest"))]
            self.by_file[Path(argv[1]).name] = self.ingested[-1]
        return out

    def close(self):
        if self.server is not None:
            self.server.stop()


def _run_readme(tmp_path, monkeypatch, capsys, skip=(), drafter=None):
    work = tmp_path / "work"
    work.mkdir()
    (work / "sglang.log").write_text(SGLANG_LOG)
    (work / "vllm.log").write_text(VLLM_LOG)
    (work / "metrics.prom").write_text(PROM)
    for k in ("plain", "k1", "k3"):             # recorded by the vLLM plugin in a real vLLM 0.32.0 (make test-engines)
        (work / f"vllm-{k}.jsonl").write_bytes((DATA / f"vllm_plugin_{k}.jsonl").read_bytes())
    monkeypatch.chdir(work)
    env = dict(os.environ)
    env.pop("SPECSCOPE_API_KEY", None)
    s = Session(capsys, work, env, drafter)
    skipped = []
    try:
        for cmd in readme_commands():
            if any(k in cmd for k in skip):
                skipped.append(cmd)
                continue
            s.run(cmd)
    finally:
        s.close()
    return s, skipped, work


def test_every_readme_command_runs(tmp_path, monkeypatch, capsys):
    from specscope.models import load_model
    from specscope.speculative.formats import save_drafter
    from spec_helpers import random_eagle3

    cache = tmp_path / "cache"
    standin = make_standin_cache(cache)
    monkeypatch.setenv("SPECSCOPE_CACHE", str(cache))
    drafter = tmp_path / "drafter"      # DRAFTER for the stand-in (the shipped one fits only the real SmolLM2)
    save_drafter(random_eagle3(load_model(standin, dtype="fp32"), draft_vocab=60), drafter)
    s, skipped, work = _run_readme(tmp_path, monkeypatch, capsys, skip=NEEDS_REAL_MODEL, drafter=drafter)
    assert skipped == [c for c in readme_commands() if "smollm2-135m-eagle3" in c] and len(skipped) == 2
    assert len(s.ran) == len(readme_commands()) - 2
    # what the commands were to write is there
    assert (work / "report.html").stat().st_size > 10_000 and (work / "runs.csv").read_text().startswith("id,")
    assert list(work.glob("verify-curve-*.png")) and (work / "out" / "config.json").exists()
    saved = list(work.glob("openai-4.0qps-*.json"))     # vLLM's name: backend-rate-model-time
    assert len(saved) == 1 and "mean_ttft_ms" in json.loads(saved[0].read_text())


@pytest.mark.slow
def test_every_readme_command_runs_on_the_real_model(tmp_path, monkeypatch, capsys):
    """The whole README, the shipped drafter included, against the real SmolLM2 (pulled into the usual cache)."""
    s, skipped, _ = _run_readme(tmp_path, monkeypatch, capsys)
    assert not skipped and len(s.ran) == len(readme_commands())


# ------------------------------------------------------------------------------------------------ the demo

def try_next(stdout: str) -> list[str]:
    """The commands under the demo's "Try next" heading."""
    tail = stdout.split("Try next", 1)[1]
    return [re.sub(r"\s+#.*$", "", ln).strip() for ln in tail.splitlines() if ln.strip().startswith("specscope ")]


def _run_try_next(stdout, capsys):
    cmds = try_next(stdout)
    assert len(cmds) == 4 and any(c.startswith("specscope tune --run") for c in cmds)
    for cmd in cmds:
        code, _, err = cli(capsys, *shlex.split(cmd)[1:])
        assert code == 0, f"`{cmd}` failed ({code}):\n{err[-3000:]}"
    return cmds


def test_demo_try_next_commands_run(tmp_path, monkeypatch, capsys):
    """A tree-shaped demo run on a tiny target and random EAGLE-3 drafter; every suggested command succeeds,
    `tune --run` included (the run carries acceptance by sibling rank)."""
    from specscope.models import load_model
    from specscope.speculative.formats import save_drafter
    from spec_helpers import random_eagle3

    target = tmp_path / "target"
    make_hf_model(target, "llama", layers=4)
    make_tiny_tokenizer(target)
    drafter = tmp_path / "drafter"
    save_drafter(random_eagle3(load_model(target, dtype="fp32"), draft_vocab=60), drafter)
    monkeypatch.chdir(tmp_path)
    code, stdout, err = cli(capsys, "demo", "--model", target, "--draft", drafter, "--num-prompts", 1,
                            "--max-new-tokens", 12, "--steps", 2, "--topk", 2, "--draft-tokens", 5, "-o",
                            tmp_path / "demo", "--threads", 1, "--no-verify-curve")
    assert code == 0, err
    _run_try_next(stdout, capsys)
    assert (tmp_path / "report.html").exists()
    from specscope.registry import open_registry

    with open_registry() as reg:
        spec = reg.get_run(json.loads((tmp_path / "demo" / "summary.json").read_text())["runs"]["speculative"])
    counts = spec["results"]["acceptance_by_depth_rank"]
    assert len(counts["offered"]) == 2 and len(counts["offered"][0]) == 2 and counts["offered"][0][0] > 0
    assert spec["name"].endswith("(1 prompt)")           # not "(1 prompts)"


@pytest.mark.slow
def test_demo_try_next_commands_run_on_the_real_model(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, stdout, err = cli(capsys, "demo", "--num-prompts", 2, "--max-new-tokens", 32, "-o", tmp_path / "demo",
                            "--threads", 2)
    assert code == 0, err
    _run_try_next(stdout, capsys)
