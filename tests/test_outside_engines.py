"""What specscope knows about an outside engine (vLLM, SGLang) lives in that engine's module under
src/specscope/engines/: adding an engine is one module. Read from the source with `ast`, as tests/test_layers.py."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from specscope.engines import parse_engine_args
from specscope.engines.vllm import capture_flags, launch_checks
from specscope.errors import SpecscopeError

ROOT = Path(__file__).resolve().parent.parent / "src" / "specscope"
# SGLang's launch flags, server args, launch module, config line and server-info answer
SGLANG_MARKERS = ("--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
                  "--speculative-num-draft-tokens", "--speculative-draft-model-path", "--speculative-token-map",
                  "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                  "speculative_num_draft_tokens", "speculative_draft_model_path", "speculative_token_map",
                  "sglang.launch_server", "ServerArgs", "get_server_info", "avg_spec_accept_length")


def _code_strings(path: Path):
    """(line, text) of every string constant in the file's code: docstrings (prose) left out."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def test_sglang_knowledge_lives_in_its_engine_module():
    """No code outside engines/sglang.py spells SGLang's flags, server args or endpoints. The CLI is left out: its
    own flags take SGLang's spellings as aliases by design (docs/cli.md, "Flags spelled as the engines spell them")."""
    home = ROOT / "engines" / "sglang.py"
    found = [f"{p.relative_to(ROOT.parent)}:{line} {m!r}" for p in sorted(ROOT.rglob("*.py"))
             if p != home and "cli" not in p.relative_to(ROOT).parts
             for line, text in _code_strings(p) for m in SGLANG_MARKERS if m in text]
    assert not found, "SGLang knowledge outside engines/sglang.py:\n" + "\n".join(found)


def test_check_drafter_and_the_capture_read_engine_args_one_way():
    """One parse of vLLM's flags: a launch command line (check-drafter) and the capture's flags alone agree."""
    flags = "--tensor-parallel-size 2 --speculative-config '{\"method\": \"eagle3\", \"num_speculative_tokens\": 3}'"
    cmd, cap = parse_engine_args("vllm serve m " + flags), capture_flags(flags)
    assert (cmd.engine, cmd.algorithm, cmd.knobs) == (cap.engine, cap.algorithm, cap.knobs) == \
        ("vllm", "eagle3", {"num_speculative_tokens": 3})
    assert cmd.model == "m" and cap.argv[:2] == ("--tensor-parallel-size", "2")


def test_the_vllm_plugin_imports_no_heavy_library():
    """The plugin runs in every vLLM process: what it imports of specscope (engines/vllm.py's tables) is stdlib."""
    code = ("import sys, specscope.plugins.vllm; "
            "print(sorted(m for m in ('torch', 'numpy', 'httpx', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("read", [lambda f: parse_engine_args("vllm serve m " + f), capture_flags])
def test_a_speculative_config_that_is_not_an_object_is_one_line(read):
    """JSON, but not an object: refused in one line (it was a traceback: exit 70)."""
    with pytest.raises(SpecscopeError, match="must be a JSON object"):
        read("--speculative-config 3")


# vLLM's `non-default args:` log line (vllm serve, v0.10+), its speculative_config spelled as given
VLLM_ARGS = ("(APIServer pid=1) INFO 08-04 20:40:11 [utils.py:326] non-default args: {'model': 'm', "
             "'speculative_config': ")


@pytest.mark.parametrize("spec", ["{'eagle3'}", "{1, 2}", "{[3]}", "{('method', 'eagle3')}"])
def test_a_vllm_log_line_whose_speculative_config_is_a_set_is_one_line(spec):
    """A set where vLLM logs a dict: one line naming it (it was a TypeError, exit 70; "no speculative_config"; or,
    a set of pairs, read as a dict)."""
    with pytest.raises(SpecscopeError, match=r"speculative_config is \{.*\}, not a dict .* command line instead"):
        parse_engine_args(VLLM_ARGS + spec + "}")


def test_sets_inside_a_vllm_log_lines_speculative_config_are_read_or_reported():
    """Nested sets and dicts in the logged dict are read past (it was "holds no speculative_config"); a method given
    as a set or list is reported as its text and warned about, as the SpeculativeConfig repr's text is (it was a
    set or list for the checks to call .upper() on: a traceback)."""
    a = parse_engine_args(VLLM_ARGS + "{'method': 'eagle3', 'x': {1, 2}, 'model': 'd}', 'y': {'z': {'a'}}, "
                                      "'num_speculative_tokens': 3}, 'seed': 0}")
    assert (a.engine, a.algorithm, a.draft, a.knobs) == ("vllm", "eagle3", "d}", {"num_speculative_tokens": 3})
    b = parse_engine_args(VLLM_ARGS + "{'method': {'eagle3'}, 'num_speculative_tokens': {3}}}")
    c = parse_engine_args("INFO [core.py:74] Initializing a V1 LLM engine with config: model='m', "
                          "speculative_config=SpeculativeConfig(method={'eagle3'}, num_spec_tokens={3})")
    assert (b.algorithm, b.knobs) == (c.algorithm, c.knobs) == ("{'eagle3'}", {"num_speculative_tokens": "{3}"})
    d = parse_engine_args("vllm serve m --speculative-config '{\"method\": [\"eagle3\"]}'")
    for args in (b, d):
        [method] = launch_checks(args, None, True)
        assert method.status == "warn" and "is not eagle3" in method.detail
