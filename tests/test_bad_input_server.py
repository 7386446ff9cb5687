"""Hostile input, second half: OS-refused paths, the server's slow and vanishing clients and unsupported request
fields, bench-serve against servers that answer nothing useful, non-finite and huge numbers, and message wording.

Bad CLI input ends in exit 2 and one `error:` line (never the exit-70 internal-error path); servers run for real on
loopback (a `specscope serve` subprocess, tiny http.server fakes in threads).
"""

from __future__ import annotations

import json
import math
import os
import socket
import time

import httpx
import pytest

from cli_util import cli, one_error_line
from serve_util import Background, LoopbackThread, QuietHandler


LONG = "a" * 300   # one path component past NAME_MAX (255): every OS call on it fails with ENAMETOOLONG


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny target with tokenizer, an EAGLE-3 drafter for it, and a registry with one run."""
    from spec_helpers import tiny_world

    return tiny_world(tmp_path_factory.mktemp("bad_input_server"))


@pytest.fixture
def run_cli(world, tmp_path, monkeypatch, capsys):
    """`specscope ARGS` in-process against the world registry, with no model load allowed when `no_load`;
    returns (exit code, stdout, stderr) and checks that nothing crashed (no exit 70, no crash report)."""
    import specscope.session as session

    monkeypatch.setenv("SPECSCOPE_DB", str(world["db"]))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("SPECSCOPE_API_KEY", raising=False)

    def run(*args, no_load=True):
        if no_load:
            def refuse(*a, **k):
                raise AssertionError("a model was loaded before the input was refused")
            monkeypatch.setattr(session, "load_target", refuse)
            monkeypatch.setattr("specscope.models.loader.load_model", refuse)
        code, out, err = cli(capsys, *args)
        assert code != 70 and "internal error" not in err and "Traceback" not in err, err
        assert not (tmp_path / "state").exists(), "a crash report was written"
        return code, out, err

    return run


# ---------------------------------------------------------------------------------------------- item 4: paths

PATH_CASES = {
    "generate --model": (lambda w, t: ["generate", "--model", t / LONG, "--prompt", "hi", "--no-record"], "--model"),
    "generate --draft": (lambda w, t: ["generate", "--model", w["model"], "--draft", t / LONG, "--prompt", "hi",
                                       "--no-record"], "--draft"),
    "runs export -o": (lambda w, t: ["runs", "export", "last", "--format", "csv", "-o", t / LONG / "x.csv"], "-o"),
    "runs export --output=": (lambda w, t: ["runs", "export", "last", f"--output={t / LONG}"], "--output"),
    "check-drafter DRAFTER": (lambda w, t: ["check-drafter", "--no-run", t / LONG, "--model", w["model"]], None),
    "check-drafter --model": (lambda w, t: ["check-drafter", w["drafter"], "--model", t / LONG / "config.json",
                                            "--no-run"], "--model"),
    "train --workdir": (lambda w, t: ["train", "--workdir", t / LONG, "--model", w["model"]], "--workdir"),
    "verify-curve -o": (lambda w, t: ["verify-curve", "--model", w["model"], "-o", t / (LONG + ".png"),
                                      "--no-record"], "-o"),
}


@pytest.mark.parametrize("case", list(PATH_CASES))
def test_a_300_character_path_component_is_one_error_line(world, tmp_path, run_cli, case):
    make, flag = PATH_CASES[case]
    line = one_error_line(*run_cli(*make(world, tmp_path))[::2])
    assert "longer than the file system allows" in line and "aaaa" in line
    # the flag is named, and a flag taking no value (--no-run before the positional DRAFTER) is not
    # (either spelling of -o/--output; early checks name the long one)
    names = {"-o": ("-o", "--output")}.get(flag, (flag,))
    assert any(f"{n} '" in line for n in names) if flag else line.startswith("error: '")


def test_an_os_error_on_a_path_the_user_did_not_give_is_still_a_bug(world, tmp_path, monkeypatch, capsys):
    import specscope.session as session

    def broken(*a, **k):
        raise FileNotFoundError(2, "No such file or directory", "/nonexistent/specscope/internal.json")

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(session, "run_generate", broken)
    code, _, err = cli(capsys, "generate", "--model", world["model"], "--prompt", "hi", "--no-record")
    assert code == 70 and err.startswith("internal error: FileNotFoundError")


# ---------------------------------------------------------------------------------------------- item 10: messages

def test_export_of_a_directory_without_config_json_names_the_file(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    line = one_error_line(*run_cli("export", tmp_path / "empty", "--format", "speculators", "-o",
                                   tmp_path / "out")[::2])
    assert "config.json" in line and "checkpoints" in line


def test_export_without_format_is_one_line_listing_the_choices(world, tmp_path, run_cli):
    line = one_error_line(*run_cli("export", world["drafter"], "-o", tmp_path / "out")[::2])
    assert "--format" in line and "sglang" in line and "speculators" in line


def test_empty_model_and_draft_names_are_refused_as_empty(world, run_cli):
    line = one_error_line(*run_cli("generate", "--model", "", "--prompt", "hi", "--no-record")[::2])
    assert "model name is empty" in line and "'.'" not in line
    line = one_error_line(*run_cli("generate", "--model", world["model"], "--draft", "", "--prompt", "hi",
                                   "--no-record")[::2])
    assert "--draft is empty" in line and "assets" not in line
    line = one_error_line(*run_cli("check-drafter", "", "--model", world["model"], "--no-run")[::2])
    assert "empty" in line


def test_draft_dot_dot_is_a_path_not_the_shipped_drafters_parent(world, tmp_path, monkeypatch, run_cli):
    from specscope.speculative.decode import shipped_drafter

    assert shipped_drafter("..") is None and shipped_drafter("") is None and shipped_drafter("a/b") is None
    monkeypatch.chdir(tmp_path)
    line = one_error_line(*run_cli("generate", "--model", world["model"], "--draft", "..", "--prompt", "hi",
                                   "--no-record")[::2])
    assert "'..'" in line and "config.json" in line


def test_serve_with_an_invalid_host_says_the_host_is_invalid(world, run_cli):
    line = one_error_line(*run_cli("serve", "--model", world["model"], "--host", "999.999.999.999",
                                   "--port", "0")[::2])
    assert "--host '999.999.999.999'" in line and "--port" not in line


def test_serve_on_a_busy_port_says_pick_another_port(world, run_cli):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        line = one_error_line(*run_cli("serve", "--model", world["model"], "--port",
                                       taken.getsockname()[1])[::2])
    assert "pick another --port" in line


def _check(run_cli, world, engine_args):
    code, out, err = run_cli("check-drafter", world["drafter"], "--model", world["model"], "--no-run", "--json",
                             "--engine-args", engine_args)
    rep = json.loads(out)
    return code, {c["check"]: (c["status"], c["detail"]) for c in rep["checks"]}


def test_check_drafter_engine_args_faults(world, tmp_path, run_cli):
    base = "python -m sglang.launch_server --model-path m --speculative-algorithm EAGLE3 "
    # the launch loads another drafter than the one checked
    other = tmp_path / "other-drafter"
    other.mkdir()
    code, s = _check(run_cli, world, base + f"--speculative-draft-model-path {other}")
    assert code == 1 and s["engine: draft model"][0] == "fail" and str(other) in s["engine: draft model"][1]
    code, s = _check(run_cli, world, base + "--speculative-draft-model-path org/some-other-eagle3")
    assert code == 1 and s["engine: draft model"][0] == "fail"
    # the drafter checked, by path and (a hub id or a path on the serving machine) by name
    for same in (world["drafter"], f"/srv/models/{world['drafter'].name}"):
        code, s = _check(run_cli, world, base + f"--speculative-draft-model-path {same}")
        assert code == 0 and s["engine: draft model"][0] == "ok", s
    d = f"--speculative-draft-model-path {world['drafter']} "
    code, s = _check(run_cli, world, base + d + "--speculative-eagle-topk 0")
    assert code == 1 and s["engine: --speculative-eagle-topk"][0] == "fail"
    assert "at least 1" in s["engine: --speculative-eagle-topk"][1]
    code, s = _check(run_cli, world, base + d + "--speculative-num-steps 99 --speculative-eagle-topk 1 "
                                                "--speculative-num-draft-tokens 100")
    assert code == 1 and s["engine: --speculative-num-steps"][0] == "fail"
    code, s = _check(run_cli, world, base + d + "--speculative-num-steps x")
    assert code == 1 and "not an integer" in s["engine: --speculative-num-steps"][1]
    spec = json.dumps({"method": "eagle3", "model": str(world["drafter"]), "num_speculative_tokens": 0})
    code, s = _check(run_cli, world, f"vllm serve m --speculative-config '{spec}'")
    assert code == 1 and s["engine: num_speculative_tokens"][0] == "fail"


# ---------------------------------------------------------------------------------------------- item 9: numbers

def test_compare_min_effect_must_be_finite(run_cli):
    for v in ("nan", "inf", "-inf"):
        line = one_error_line(*run_cli("compare", "last", "last", "--min-effect", v, "--json")[::2])
        assert "--min-effect" in line and v in line


def test_breakeven_that_would_overflow_is_refused_and_json_is_strict(run_cli):
    line = one_error_line(*run_cli("breakeven", "--decode-ms", "1e308", "--verify-ms", "1e308", "--draft-ms",
                                   "1e308", "--steps", "2", "--json")[::2])
    assert "overflow" in line and "cycle_ms" in line
    line = one_error_line(*run_cli("breakeven", "--decode-ms", "10", "--verify-ms", "12", "--draft-ms", "3",
                                   "--steps", "2", "--measured-tok-s", "1e308", "--json")[::2])
    assert "overflow" in line
    line = one_error_line(*run_cli("breakeven", "--decode-ms", "10", "--verify-ms", "12", "--draft-ms", "3",
                                   "--steps", str(10**12))[::2])
    assert "--steps" in line
    code, out, err = run_cli("breakeven", "--decode-ms", "1e-300", "--verify-ms", "12", "--draft-ms", "3",
                             "--steps", "2", "--json")
    assert code == 0, err
    json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output"))


def test_json_output_writes_non_finite_numbers_as_null(capsys):
    from specscope.cli.common import emit_json

    emit_json({"x": math.nan, "y": [math.inf, -math.inf, 1.5]})     # strict JSON, never bare NaN (docs/cli.md)
    out = capsys.readouterr().out
    assert json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON output")) == \
        {"x": None, "y": [None, None, 1.5]}


def test_float_and_thread_flags_are_bounded_before_work(world, run_cli):
    line = one_error_line(*run_cli("serve", "--model", world["model"], "--shutdown-timeout", "nan")[::2])
    assert "--shutdown-timeout" in line
    line = one_error_line(*run_cli("serve", "--model", world["model"], "--body-timeout", "inf")[::2])
    assert "--body-timeout" in line
    line = one_error_line(*run_cli("generate", "--model", world["model"], "--prompt", "hi", "--no-record",
                                   "--threads", str(10**9))[::2])
    assert "--threads" in line and "1024" in line


def test_setup_runtime_bounds_threads_for_every_command():
    from specscope.cli.common import setup_runtime
    from specscope.errors import SpecscopeError

    with pytest.raises(SpecscopeError, match="--threads"):
        setup_runtime(10**9, "cpu")


# ---------------------------------------------------------------------------------------------- item 6: the server

def _serve(world, *extra, preexec_fn=None) -> Background:
    env = dict(os.environ, SPECSCOPE_DB=str(world["root"] / "serve.db"))
    env.pop("SPECSCOPE_API_KEY", None)
    return Background(["serve", "--model", str(world["model"]), "--port", "0", "--device", "cpu", "--dtype", "fp32",
                       "--threads", "1", "--log-level", "info", *extra], env, start_timeout=120, preexec_fn=preexec_fn)


def _address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _get_at_once(url: str) -> bytes:
    """GET /health on a fresh connection, read to the end; what a client does the moment it reads 'listening'."""
    try:
        with socket.create_connection(_address(url), timeout=30) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            return got
    except OSError as e:
        return repr(e).encode()


@pytest.fixture(scope="module")
def server(world):
    """`specscope serve` on loopback with 1 s body and header timeouts; its stderr is checked for tracebacks.
    `first_answer`: what a GET sent the moment 'listening' was printed got."""
    s = _serve(world, "--body-timeout", "1", "--header-timeout", "1")
    s.first_answer = _get_at_once(s.url)
    yield s
    s.stop()


def _stderr(server) -> str:
    server.err.flush()
    server.err.seek(0)
    return server.err.read()


def _partial_request(url: str) -> socket.socket:
    """Headers announcing a 100-byte JSON body, then only the first 11 bytes of it."""
    s = socket.create_connection(_address(url))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    return s


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(server):
    before = _stderr(server)
    for _ in range(3):
        s = _partial_request(server.url)
        time.sleep(0.2)
        s.close()
    time.sleep(0.5)
    log = _stderr(server)[len(before):]
    assert "Traceback" not in log and "ClientDisconnect" not in log and "internal error" not in log, log
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_slow_body_gets_408_and_the_connection_closed(server):
    s = _partial_request(server.url)
    s.settimeout(10)
    got = _read_to_end(s)              # closed by the server (a client left waiting would time out here)
    assert got.startswith(b"HTTP/1.1 408"), got[:200]
    body = json.loads(got.split(b"\r\n\r\n", 1)[1])
    assert body["error"]["code"] == 408 and "1 s" in body["error"]["message"]
    assert "Traceback" not in _stderr(server)


def _read_to_end(s: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := s.recv(4096):   # b"" = the server closed the connection
            got += chunk
    finally:
        s.close()
    return got


def test_listening_is_printed_once_the_socket_accepts(server):
    """(issue 53) 'listening on' was printed before the socket listened: a client that connected on it was
    refused."""
    assert server.first_answer.startswith(b"HTTP/1.1 200"), server.first_answer[:200]


def test_a_half_sent_or_trickled_head_is_dropped_after_the_header_timeout(server):
    """(issue 53) Half a request head held its connection forever (300 of 300 still open after 35 s). With
    --header-timeout 1: half a head gets 408 and the connection closed, a head sent a byte at a time too (the
    deadline runs from its first byte), and a connection that sends nothing is closed."""
    half = socket.create_connection(_address(server.url))
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    idle = socket.create_connection(_address(server.url))
    trickle = socket.create_connection(_address(server.url))
    trickle.settimeout(0.2)
    got = b""
    for byte in b"GET /health HTTP/1.1\r\n" + b"X-Pad: " + b"x" * 200:   # ~40 s of bytes at 5 a second
        try:
            trickle.sendall(bytes([byte]))
            got = trickle.recv(4096)
            break                        # an answer, or b"": closed
        except TimeoutError:
            continue
        except OSError:                  # closed while we sent
            break
    for s in (half, idle, trickle):
        s.settimeout(15)
    try:
        trickled = got + _read_to_end(trickle)
    except OSError:   # reset after the close it already saw
        trickled = got
    answers = {"half": _read_to_end(half), "idle": _read_to_end(idle), "trickled": trickled}
    for name in ("half", "trickled"):
        assert answers[name].startswith(b"HTTP/1.1 408"), (name, answers[name][:200])
        body = json.loads(answers[name].split(b"\r\n\r\n", 1)[1])
        assert body["error"]["code"] == 408 and "request head" in body["error"]["message"]
    assert answers["idle"] == b""
    assert "Traceback" not in _stderr(server)


def test_idle_connections_past_the_open_file_limit_do_not_starve_a_request(world):
    """(issue 53) 300 connections that send half a header, against a server with 256 file descriptors: a request
    then got no answer ("Too many open files" in the log). Now the connection cap (fitted to the limit) answers it
    503 with Retry-After, or it is served; once the idle ones are gone it is served."""
    import resource

    def fd_limit_256():
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    srv = _serve(world, "--header-timeout", "300", preexec_fn=fd_limit_256)
    idle = []
    try:
        first = _get_at_once(srv.url)
        for _ in range(300):
            c = socket.create_connection(_address(srv.url), timeout=10)
            c.sendall(b"GET /health HTTP/1.1\r\nHo")
            idle.append(c)
        r = httpx.get(srv.url + "/health", timeout=60)
        for c in idle:
            c.close()
        after = None
        for _ in range(60):              # served again once they are gone (retrying as Retry-After says)
            after = httpx.get(srv.url + "/health", timeout=60)
            if after.status_code == 200:
                break
            time.sleep(int(after.headers.get("retry-after", 1)))
    finally:
        for c in idle:
            c.close()
        srv.stop()
    assert first.startswith(b"HTTP/1.1 200"), first[:200]
    assert r.status_code in (200, 503), r.text
    if r.status_code == 503:
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == 503, (r.headers, r.text)
    assert after.status_code == 200, after.text
    log = _stderr(srv)
    assert "Too many open files" not in log and "Traceback" not in log, log[-3000:]


OK = {"prompt": "the quick brown fox", "max_tokens": 2}


@pytest.mark.parametrize("field,value", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
    ("response_format", {"type": "json_object"}),
    ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("presence_penalty", 0.5),
    ("frequency_penalty", -1),
    ("logit_bias", {"5": 100}),
    ("min_p", 0.1),
    ("top_logprobs", 3),   # chat's field; completions take "logprobs": k
    ("suffix", "!"),
])
def test_unsupported_features_are_400_naming_the_field(server, field, value):
    r = httpx.post(server.url + "/v1/completions", json=dict(OK, **{field: value}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and f"'{field}'" in err["message"] and "not supported" in err["message"]


@pytest.mark.parametrize("raw,param", [
    ('{"prompt": "hi", "presence_penalty": NaN}', "presence_penalty"),
    ('{"prompt": "hi", "frequency_penalty": -Infinity}', "frequency_penalty"),
    ('{"prompt": "hi", "metadata": {"a": [1, Infinity]}}', "metadata"),
    ('{"prompt": "hi", "user": NaN}', "user"),
])
def test_non_finite_numbers_anywhere_are_400(server, raw, param):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "finite" in err["message"]


def test_harmless_settings_of_unsupported_fields_are_accepted(server):
    body = dict(OK, response_format={"type": "text"}, tool_choice="none", presence_penalty=0, logprobs=None,
                logit_bias={}, tools=[], parallel_tool_calls=False)
    r = httpx.post(server.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "response_format": {"type": "text"},
            "tool_choice": "none"}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat).status_code == 200


def test_serve_refuses_an_empty_api_key(world, run_cli, monkeypatch):
    line = one_error_line(*run_cli("serve", "--model", world["model"], "--api-key", "", "--port", "0")[::2])
    assert "--api-key" in line and "empty" in line
    monkeypatch.setenv("SPECSCOPE_API_KEY", "  ")
    line = one_error_line(*run_cli("serve", "--model", world["model"], "--port", "0")[::2])
    assert "SPECSCOPE_API_KEY" in line


# ---------------------------------------------------------------------------------------------- item 7: bench-serve

class Fake:
    """A tiny HTTP server on loopback in a thread: /v1/models names a model, POSTs answer per `mode`."""

    def __init__(self, mode: str):
        self.posts = 0
        fake = self

        class Handler(QuietHandler):
            def do_GET(self):
                if self.path == "/v1/models":
                    self._send(200, b'{"data": [{"id": 5}]}' if mode == "bogus models" else b'{"data": [{"id": "m"}]}')
                else:
                    self._send(200, b"\xff\x00 not prometheus {{{\n", "text/plain")

            def do_POST(self):
                fake.posts += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if mode == "501":
                    self._send(501, b"Not Implemented\n<html>\n", "text/html")
                elif mode == "garbage":
                    self.wfile.write(b"\x00\xff not HTTP at all\r\n\r\n")
                elif mode == "silent":
                    time.sleep(3)
                else:
                    body = {"json list": b"data: [1, 2]\n\ndata: [DONE]\n\n",
                            "not json": b"data: {oops\n\ndata: [DONE]\n\n",
                            "odd chunk": b'data: {"choices": "x", "error": "boom", "usage": {"completion_tokens": '
                                         b'"many"}}\n\ndata: [DONE]\n\n'}[mode]
                    self._send(200, body, "text/event-stream")

        self.loop = LoopbackThread(Handler)
        self.url = self.loop.url

    def close(self):
        self.loop.close()


@pytest.fixture
def prompts(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("hello there\n")
    return p


@pytest.mark.parametrize("mode", ["501", "garbage", "json list", "not json", "odd chunk", "silent"])
def test_bench_serve_fails_when_no_request_succeeds(mode, prompts, tmp_path, run_cli):
    fake = Fake(mode)
    try:
        code, out, err = run_cli("bench-serve", "--base-url", fake.url, "--dataset", prompts, "--timeout", "1",
                                 "--save-result", "--result-dir", tmp_path / "res")
    finally:
        fake.close()
    assert code == 1, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "no request succeeded (1 of 1 failed" in lines[0], err
    assert fake.posts == 1 and not (tmp_path / "res").exists() and "stored run" not in err


def test_bench_serve_with_a_bogus_model_list_is_one_line(prompts, run_cli):
    fake = Fake("bogus models")
    try:
        line = one_error_line(*run_cli("bench-serve", "--base-url", fake.url, "--dataset", prompts)[::2])
    finally:
        fake.close()
    assert "/v1/models" in line and "--model" in line and fake.posts == 0


@pytest.mark.parametrize("args,needle", [
    (["--base-url", "http://127.0.0.1:99999"], "port 99999"),
    (["--base-url", "http://[::1"], "--base-url"),
    (["--base-url", "http://:8000"], "no host"),
    (["--timeout", "nan"], "--timeout"),
    (["--timeout", "1e308"], "--timeout"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate"),
    (["--burstiness", "nan"], "--burstiness"),
    (["--burstiness", "inf"], "--burstiness"),
    (["--random-range-ratio", "nan"], "--random-range-ratio"),
    (["--num-prompts", str(10**9)], "--num-prompts"),
])
def test_bench_serve_bad_numbers_and_urls_are_one_line(args, needle, prompts, run_cli):
    line = one_error_line(*run_cli("bench-serve", "--dataset", prompts, "--base-url", "http://127.0.0.1:9",
                                   *args)[::2])
    assert needle in line


@pytest.mark.parametrize("args,needle", [
    (["--save-result", "--result-dir", "/proc/x"], "--result-dir"),
    (["--save-result", "--result-filename", "../../escaped.json"], "--result-filename"),
    (["--save-result", "--result-filename", "sub/x.json"], "--result-filename"),
])
def test_bench_serve_result_paths_are_refused_before_the_run(args, needle, prompts, tmp_path, run_cli,
                                                             monkeypatch):
    fake = Fake("501")
    monkeypatch.chdir(tmp_path)
    try:
        line = one_error_line(*run_cli("bench-serve", "--base-url", fake.url, "--dataset", prompts, *args)[::2])
    finally:
        fake.close()
    assert needle in line and fake.posts == 0
    assert not (tmp_path.parent / "escaped.json").exists()
