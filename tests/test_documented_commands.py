"""Every `specscope ...` command README.md and docs/*.md show, checked so none rots, and every "Try next" line the
demo prints, run verbatim.

Three levels, all in the default suite:
- every command line of a code block parses against the click command tree in-process (options exist, values have
  the right type, required ones are there, no stray argument), every inline `specscope ...` span names only
  options its command has, and `--help` of every command and subcommand shown succeeds;
- the commands run for real, in order — README first, then the docs pages — against a tiny random stand-in cached
  under the demo model's name (SPECSCOPE_CACHE and SPECSCOPE_DB in a temporary directory), so `--model
  smollm2-135m` and the default model resolve without the real weights. Placeholders (RUN_A, ID, DRAFTER,
  SURFACE, sglang.log, ...) are filled with the runs and files the commands before them made. A command stays at
  the parse and --help checks only when the real one takes minutes, needs the Hugging Face Hub or another
  engine's server, or the real SmolLM2 (the shipped EAGLE-3 drafter is sized for it): `why_not_run` says which.
  The slow suite runs the whole set against the real model;
- the README stays a front door: at most 150 lines, the two commands verbatim, every relative link resolving; and
  the benchmarks' reproduce commands (`python bench/X.py ...`, minutes each) name scripts and flags that exist.

`make demo` / `make test` are not run here: they install a virtual environment and wrap `specscope demo` and
pytest, which the tests below and the suite itself cover.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path

import click
import pytest

from cli_util import cli
from specscope.errors import SpecscopeError
from serve_util import Background
from tiny import make_hf_model, make_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "engine_logs"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_OPS = ";&|<>"
ENV_ASSIGN = re.compile(r"^[A-Za-z_]\w*=")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(\.\.\.)?$")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w.-]+)?$")


# ------------------------------------------------------------------------------------------------ what the pages show

@dataclass(frozen=True)
class Shown:
    """One `specscope` command a page shows: argv after `specscope`, where, and whether it is a whole command line
    (a code block) or an inline span (possibly a fragment: `specscope train ... --stages train`)."""
    page: str
    line: int
    argv: tuple[str, ...]
    block: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def text(self) -> str:
        return "specscope " + shlex.join(self.argv)


def _split_page(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(code lines, prose paragraphs) of a Markdown page, each with its first line number: fenced blocks, and
    indented blocks (4+ spaces after a blank line); backslash continuations joined; paragraphs joined into one
    line so an inline span broken across lines stays whole."""
    code, prose, para = [], [], []
    fenced = indented = False
    prev_blank = True

    def end_paragraph():
        if para:
            prose.append((para[0][0], " ".join(p for _, p in para)))
            para.clear()

    for i, line in enumerate(text.splitlines(), 1):
        blank = not line.strip()
        if line.lstrip().startswith(("```", "~~~")):
            fenced, indented = not fenced, False
            end_paragraph()
        elif fenced or (line.startswith("    ") and (indented or prev_blank)):
            indented = not fenced
            end_paragraph()
            if code and code[-1][1].endswith("\\"):
                code[-1] = (code[-1][0], code[-1][1][:-1] + " " + line.strip())
            else:
                code.append((i, line.strip()))
        elif blank:
            end_paragraph()
        else:
            indented = False
            para.append((i, line.strip()))
        prev_blank = blank
    end_paragraph()
    return code, prose


def invocations(line: str) -> list[list[str]]:
    """argv after `specscope` of each command on a shell line: `specscope`, `.../bin/specscope`, `python -m
    specscope` or `torchrun ... -m specscope`, after any VAR=value; split at ; && | and redirections."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=SHELL_OPS)
    lex.whitespace_split = True
    try:
        tokens = list(lex)
    except ValueError:      # an unbalanced quote: prose, not a command
        return []
    out, seg = [], []
    for t in [*tokens, ";"]:
        if t and set(t) <= set(SHELL_OPS):
            argv = _after_specscope(seg)
            if argv:
                out.append(argv)
            seg = []
        else:
            seg.append(t)
    return out


def _after_specscope(seg: list[str]) -> list[str] | None:
    for i, t in enumerate(seg):
        if t == "-m" and seg[i + 1:i + 2] == ["specscope"]:
            return seg[i + 2:]
        if t == "specscope" or t.endswith("/specscope"):
            return seg[i + 1:] if all(ENV_ASSIGN.match(x) for x in seg[:i]) else None
    return None


def shown_commands(pages=PAGES) -> list[Shown]:
    out = []
    for page in pages:
        rel = str(page.relative_to(ROOT))
        code, prose = _split_page(page.read_text())
        for no, line in code:
            out += [Shown(rel, no, tuple(a), True) for a in invocations(line)]
        for no, para in prose:
            for span in re.findall(r"`([^`]+)`", para):
                out += [Shown(rel, no, tuple(a), False) for a in invocations(span)]
    return out


# ------------------------------------------------------------------------------------------------ against the CLI

def resolve(argv) -> tuple[list[str], click.Command, list[str]]:
    """(command path, the click command, its own arguments) of `specscope ARGV`."""
    from specscope.cli import cli as root

    cmd, path, rest = root, [], list(argv)
    while isinstance(cmd, click.Group) and rest and not rest[0].startswith("-"):
        sub = cmd.get_command(None, rest[0])
        if sub is None:
            raise click.UsageError(f"`specscope {' '.join([*path, rest[0]])}` is not a command")
        cmd, path, rest = sub, [*path, rest[0]], rest[1:]
    return path, cmd, rest


def option_names(cmd: click.Command) -> set[str]:
    names = {"--help", "-h"}
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts, p.secondary_opts)
    return names


def problem(shown: Shown) -> str | None:
    """Why the command as shown would not parse (None when it does). A code-block line is parsed by click itself,
    types and required options included; an inline span only has its flags checked."""
    try:
        path, cmd, rest = resolve(shown.argv)
        known = option_names(cmd)
        for tok in rest:
            if tok == "--":         # the end of specscope's options: what follows is the engine's command line
                break
            flag = tok.strip("[]),").split("=", 1)[0]
            if flag.startswith("-") and len(flag) > 1 and not re.match(r"^-\d", flag) and flag not in known:
                return f"`specscope {' '.join(path)}` has no option {flag}"
        if shown.block and not ({"--help", "-h"} & set(rest)):
            cmd.make_context(f"specscope {' '.join(path)}", list(rest))
    except click.ClickException as e:
        return e.format_message()
    except SpecscopeError as e:           # a value the sampling schema refuses, as the CLI would
        return str(e)
    return None


def test_pages_show_the_commands_we_check():
    shown = shown_commands()
    pages = {s.page for s in shown}
    assert {"README.md", "docs/cli.md", "docs/serving.md", "docs/vllm-plugin.md", "docs/economics.md",
            "docs/coming-from-specforge.md", "docs/profiling-and-registry.md", "docs/demo-and-report.md"} <= pages
    readme = [s.text for s in shown if s.page == "README.md" and s.block]
    for needle in ("specscope generate", "specscope compare", "specscope breakeven", "specscope tune --run",
                   "specscope report", "specscope ingest", "specscope serve", "specscope bench-serve",
                   "specscope export smollm2-135m-eagle3", "specscope check-drafter"):
        assert any(c.startswith(needle) for c in readme), needle
    # the parser reads the shapes the pages use: continuations, `-m specscope`, env prefixes, inline fragments
    assert invocations("A=1 specscope runs list; specscope compare X Y | head") == [["runs", "list"],
                                                                                   ["compare", "X", "Y"]]
    assert invocations("torchrun --nproc-per-node 8 -m specscope train --stages train  # why") == [
        ["train", "--stages", "train"]]
    assert invocations(".venv/bin/python bench/tune.py --threads 2") == []


def test_every_documented_command_parses():
    bad = [f"{s.where}: `{s.text}`: {why}" for s in shown_commands() if (why := problem(s))]
    assert not bad, "documented commands the CLI does not accept:\n" + "\n".join(bad)


def test_the_parse_check_catches_rot():
    for argv, block, needle in ((("generate", "--prompt", "x", "--no-such-flag"), True, "--no-such-flag"),
                                (("runs", "list", "--tagg", "demo"), False, "--tagg"),
                                (("export", "d", "--format", "onnx", "-o", "x"), True, "onnx"),
                                (("export", "d", "-o", "x"), True, "--format"),
                                (("frobnicate",), False, "not a command")):
        why = problem(Shown("t.md", 1, argv, block))
        assert why and needle in why, (argv, why)


def _bench_invocations(line: str) -> list[tuple[str, list[str]]]:
    """(script, its arguments) of each `python bench/X.py ...` on a shell line."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=SHELL_OPS)
    lex.whitespace_split = True
    out, cur = [], None
    try:
        tokens = list(lex)
    except ValueError:      # an unbalanced quote: prose, not a command
        return []
    for t in tokens:
        if set(t) <= set(SHELL_OPS):
            cur = None
        elif re.fullmatch(r"bench/\w+\.py", t):
            cur = (t, [])
            out.append(cur)
        elif cur is not None:
            cur[1].append(t)
    return out


def test_documented_bench_commands_name_real_flags():
    """The reproduce commands of docs/benchmarks.md and the others: each `bench/X.py` exists and defines every flag
    given to it (in itself or in the bench module it takes its flags from); their runs take minutes, so this is
    a text check of the argparse definitions."""
    bad, seen = [], 0
    for page in PAGES:
        code, prose = _split_page(page.read_text())
        spans = [(no, span) for no, para in prose for span in re.findall(r"`([^`]+)`", para)]
        for no, line in code + spans:
            for script, args in _bench_invocations(line):
                seen += 1
                src = ROOT / script
                if not src.exists():
                    bad.append(f"{page.name}:{no}: {script} does not exist")
                    continue
                text = src.read_text() + "".join((ROOT / "bench" / f"{m}.py").read_text() for m in
                                                 re.findall(r"^from (\w+) import", src.read_text(), re.M)
                                                 if (ROOT / "bench" / f"{m}.py").exists())
                for flag in {a.split("=", 1)[0] for a in args if a.startswith("--")}:
                    if f'"{flag}"' not in text:
                        bad.append(f"{page.name}:{no}: {script} has no {flag}")
    assert seen >= 20 and not bad, "\n".join(bad)


def test_help_of_every_documented_command(capsys):
    paths = sorted({tuple(resolve(s.argv)[0]) for s in shown_commands()})
    assert len(paths) >= 14
    for path in paths:
        code, out, err = cli(capsys, *path, "--help")
        assert code == 0 and out.startswith(f"Usage: specscope {' '.join(path)} "), (path, err)


# ------------------------------------------------------------------------------------------------ the front door

def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    lines = text.splitlines()
    assert "    make demo" in lines and "    make test" in lines      # the two commands, verbatim
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo: ", makefile, re.M) and re.search(r"^test: ", makefile, re.M)
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)     # CI runs the README's command
    for page in ("benchmarks", "serving", "vllm-plugin", "cli", "coming-from-specforge", "economics",
                 "engine-metrics", "profiling-and-registry", "demo-and-report"):
        assert f"(docs/{page}.md)" in text, page


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        for no, line in enumerate(page.read_text().splitlines(), 1):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    bad.append(f"{page.relative_to(ROOT)}:{no}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    bad.append(f"{page.relative_to(ROOT)}:{no}: {target} (no such heading)")
    assert not bad, "\n".join(bad)


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

# the options that name a model, drafter or dataset (engines' spellings included)
NAMED = {"--model", "--target-model-path", "--target", "--draft", "--speculative-draft-model-path", "--dataset",
         "--train-data-path", "--init"}


def why_not_run(argv, real_model: bool) -> str | None:
    """Why a documented command only gets its parse and --help checks here (None: it runs for real)."""
    if "--help" in argv:
        return None
    if argv[0] in ("train", "demo") or list(argv[:2]) == ["models", "pull"] or "--profile" in argv:
        return "minutes of work"
    if argv[0] in ("sweep", "bisect"):
        return "launches an engine per cell (minutes; vLLM's is tests/engines/test_sweep.py, test_bisect.py)"
    named = [argv[i + 1] for i in range(len(argv) - 1) if argv[i] in NAMED]
    if argv[0] in ("export", "check-drafter") and len(argv) > 1:
        named.append(argv[1])
    if any(HUB_ID.match(v) and not Path(v).exists() for v in named):
        return "needs the Hugging Face Hub"
    if not real_model and argv[0] != "export" and any(v.startswith("smollm2-135m-eagle3") for v in named):
        return "needs the real SmolLM2 (the shipped drafter's target)"
    if argv[0] == "bench-serve" and any(a.startswith("--base-url") for a in argv):
        return "needs that server"
    return None


class Session:
    """Runs documented commands in order, filling placeholders from what the earlier ones made."""

    def __init__(self, capsys, cwd: Path, env: dict, drafter: Path | None, real_model: bool):
        self.capsys, self.cwd, self.env, self.real_model = capsys, cwd, env, real_model
        self.drafter = drafter                  # DRAFTER: the shipped one unless a stand-in is given
        self.generated: list[str] = []          # run ids of `specscope generate`
        self.ingested: list[str] = []
        self.by_file: dict[str, str] = {}       # ingested file name -> run id (RUN_K1 ... come from vLLM's)
        self.server: Background | None = None
        self.ran: list[Shown] = []
        self.skipped: list[tuple[Shown, str]] = []
        self.done: set[str] = set()

    def _subs(self) -> dict[str, list[str]]:
        from specscope.registry import open_registry
        from specscope.speculative.decode import ASSETS, DEFAULT_DRAFTER

        with open_registry() as reg:
            spec = [r for r in self.generated if (reg.get_run(r, samples=False).get("config") or {}).get("draft")]
            curves = [r["id"] for r in reg.list_runs(kind="verify_curve")]
        subs = {"RUN_A": self.generated[:1], "RUN_B": self.generated[-1:], "RUNS...": self.generated,
                "RUN...": self.generated, "RUN": spec[-1:], "ID": spec[-1:], "SURFACE": curves[:1],
                "INGESTED_A": self.ingested[:1], "INGESTED_B": self.ingested[-1:],
                "DRAFTER": [str(self.drafter or ASSETS / DEFAULT_DRAFTER)]}
        for k in ("plain", "k1", "k3"):
            subs[f"RUN_{k.upper()}"] = [self.by_file[f"vllm-{k}.jsonl"]] if f"vllm-{k}.jsonl" in self.by_file else []
        return subs

    def fill(self, argv) -> list[str]:
        subs, out = self._subs(), []
        for a in argv:
            if a in subs and subs[a]:
                out += subs[a]
            elif a.startswith("/tmp/"):         # the pages' scratch paths, kept inside this test's directory
                out.append(str(self.cwd / a[1:]))
            else:
                out.append(a)
        return out

    def run(self, shown: Shown) -> None:
        if shown.text in self.done:
            return
        argv = self.fill(shown.argv)
        why = why_not_run(argv, self.real_model)
        left = [a for a in argv if PLACEHOLDER.match(a)]
        if why is None and left:
            why = f"nothing made {left[0]} earlier"
        if why is None and argv[0] == "bench-serve" and self.server is None:
            why = "no server started earlier"
        if why:
            self.skipped.append((shown, why))
            return
        self.done.add(shown.text)
        self.ran.append(shown)
        if argv[0] == "serve":
            self._serve(argv)
            return
        if argv[0] == "bench-serve":
            argv += ["--base-url", self.server.url]
        code, out, err = cli(self.capsys, *argv)
        assert code == 0, f"{shown.where}: `{shlex.join(['specscope', *argv])}` failed ({code}):\n{err[-3000:]}"
        self._note(argv, out, err)

    def _serve(self, argv):
        if self.server is not None:
            self.server.stop()
        if "--port" not in argv and not _port_free(8000):    # somebody else holds 8000: same command, a free port
            argv = [*argv, "--port", "0"]
        self.server = Background(argv, self.env, self.cwd)

    def _note(self, argv, out, err):
        """What a command made that later placeholders name."""
        if argv[0] == "generate" and "--no-record" not in argv:
            rid = json.loads(out)["run_id"] if "--json" in argv else re.search(r"Run stored: (\w+)", err).group(1)
            self.generated.append(rid)
        if argv[:2] == ["runs", "delete"]:
            self.generated = [r for r in self.generated if r not in argv[2:]]
        if argv[0] == "ingest":
            from specscope.registry import open_registry

            files = [a for a in argv[1:] if not a.startswith("-")]
            with open_registry() as reg:
                self.ingested = [r["id"] for r in reversed(reg.list_runs(kind="ingest"))]
            self.by_file.update(zip((Path(f).name for f in files), self.ingested[-len(files):]))

    def close(self):
        if self.server is not None:
            self.server.stop()


def _run_pages(tmp_path, monkeypatch, capsys, drafter=None, real_model=False) -> tuple[Session, Path]:
    work = tmp_path / "work"
    (work / "tmp").mkdir(parents=True)
    (work / "sglang.log").write_text(SGLANG_LOG)
    (work / "vllm.log").write_text(VLLM_LOG)
    (work / "metrics.prom").write_text(PROM)
    for k in ("plain", "k1", "k3"):             # recorded by the vLLM plugin in a real vLLM 0.32.0 (make test-engines)
        (work / f"vllm-{k}.jsonl").write_bytes((DATA / f"vllm_plugin_{k}.jsonl").read_bytes())
    monkeypatch.chdir(work)
    env = dict(os.environ)
    env.pop("SPECSCOPE_API_KEY", None)
    s = Session(capsys, work, env, drafter, real_model)
    try:
        for shown in shown_commands():
            if shown.block:
                s.run(shown)
    finally:
        s.close()
    return s, work


def test_every_documented_command_runs(tmp_path, monkeypatch, capsys):
    from specscope.models import load_model
    from specscope.models.hub import KNOWN_MODELS
    from specscope.speculative.formats import save_drafter
    from spec_helpers import random_eagle3

    cache = tmp_path / "cache"
    standin = make_standin_cache(cache)
    monkeypatch.setenv("SPECSCOPE_CACHE", str(cache))
    drafter = tmp_path / "drafter"      # DRAFTER for the stand-in (the shipped one fits only the real SmolLM2)
    save_drafter(random_eagle3(load_model(standin, dtype="fp32"), draft_vocab=60), drafter)
    s, work = _run_pages(tmp_path, monkeypatch, capsys, drafter=drafter)
    readme = [c for c in shown_commands() if c.page == "README.md" and c.block]
    skipped = {c.text: why for c, why in s.skipped}
    # in the README only the shipped drafter's generate needs the real model; everything else ran as shown
    assert [c.text for c in readme if c.text in skipped] == [c.text for c in readme if "smollm2-135m-eagle3+" in c.text]
    assert len(s.ran) >= 25 and {c.page for c in s.ran} >= {
        "README.md", "docs/cli.md", "docs/vllm-plugin.md", "docs/economics.md", "docs/profiling-and-registry.md",
        "docs/serving.md"}
    assert all(why for why in skipped.values())
    # what the commands were to write is there
    assert (work / "report.html").stat().st_size > 10_000 and (work / "runs.csv").read_text().startswith("id,")
    assert list(work.glob("verify-curve-*.png")) and (work / "tmp" / "drafter" / "config.json").exists()
    saved = list(work.glob("openai-4.0qps-*.json"))     # vLLM's name: backend-rate-model-time
    assert len(saved) == 1 and "mean_ttft_ms" in json.loads(saved[0].read_text())
    # the shipped drafter, exported without --model, names the embedded model it was trained for
    verifier = json.loads((work / "out" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": KNOWN_MODELS["smollm2-135m"].hf_repo, "architectures": ["LlamaForCausalLM"]}


@pytest.mark.slow
def test_every_documented_command_runs_on_the_real_model(tmp_path, monkeypatch, capsys):
    """The same, the shipped drafter included, against the real SmolLM2 (pulled into the usual cache)."""
    s, _ = _run_pages(tmp_path, monkeypatch, capsys, real_model=True)
    readme = [c for c in shown_commands() if c.page == "README.md" and c.block]
    assert not [c for c, _ in s.skipped if c.page == "README.md"] and len(s.ran) >= len({c.text for c in readme})


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
