"""The data stage's features computed by a vLLM instead of specscope's own forward (`train --capture`).

specscope sends each training sequence's exact token ids to the server's /v1/completions (max_tokens 1: the prefill
computes every position) marked for capture; specscope's vLLM plugin (plugins/capture.py, SPECSCOPE_CAPTURE=DIR in
the server's environment) writes that request's aux hidden states, final normed hidden state and argmax to
DIR/KEY.safetensors, which this side reads, checks (the token ids must be the ones sent) and deletes. The shards the
vocab and train stages read are then written exactly as the local capture writes them (train/data.py: capture).

`--capture vllm` starts such a server here (`python -m vllm.entrypoints.openai.api_server` with this interpreter,
--enforce-eager, no prefix caching, the user's --engine-args) and stops it at the end; `--capture URL --capture-dir
DIR` uses one already running with SPECSCOPE_CAPTURE=DIR (a directory both can reach). Nothing of the target's
weights is loaded in specscope's process.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import socket
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specscope.engines import vllm
from specscope.engines.base import flag_value
from specscope.errors import SpecscopeError
from specscope.serverproc import ServerFailed, ServerProcess, free_port, log_cause
from specscope.train.capture_files import ENV_DIR, RUN_PREFIX, XARG_KEY, XARG_LAYERS, XARG_RUN, read_capture


class CaptureFailed(SpecscopeError):
    """The capture ran and the engine failed under it (exit 1; a launch that never starts is bad input, exit 2)."""

    exit_code = 1


CAPTURE_TAKES = "vllm (start one here) or the URL of a vLLM running specscope's capture plugin, e.g. " \
                "http://127.0.0.1:8000"
FILE_WAIT_S = 60.0          # after the response: the file is written before it, except across TP ranks' timing


class VLLMLaunch:
    """A vLLM OpenAI server started here for the capture, in its own process group; `stop` ends it, children
    included. Its output goes to `log`; failures are one line naming the log."""

    def __init__(self, model_path: Path, engine_args: list[str], capture_dir: Path, log: Path, max_len: int,
                 python: str | None = None):
        self.python = python or sys.executable
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        args = list(engine_args)
        if flag_value(args, "--max-model-len") is None:
            args += ["--max-model-len", str(max_len + 1)]     # the sequence and the one token it samples
        self.argv = vllm.server_argv(self.python, model_path, self.port, [*vllm.CAPTURE_FLAGS, *args])
        env = vllm.server_env({ENV_DIR: str(capture_dir)})
        if env.get("VLLM_PLUGINS") and vllm.PLUGIN_ENTRY not in env["VLLM_PLUGINS"].split(","):
            env["VLLM_PLUGINS"] += "," + vllm.PLUGIN_ENTRY     # the entry point that holds the capture mode
        # no startup limit: a sharded 1T target can take many minutes to load; its progress is logged
        self.env, self.server = env, ServerProcess(self.argv, env, self.log, self.url, startup_s=float("inf"),
                                                   leftovers=vllm.shm_leftovers)

    @property
    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)

    def start(self, log=print) -> str:
        if self.python == sys.executable:
            check_vllm_here()
        self.server.start()
        log(f"starting vLLM for the capture (log: {self.log})")
        try:
            secs = self.server.wait_healthy(on_wait=lambda t: log(f"waiting for vLLM to load the target ({t:.0f} s; "
                                                                  f"log: {self.log})"))
        except ServerFailed:
            raise SpecscopeError(f"vLLM exited with status {self.proc.returncode} while starting: "
                                 f"{self.why()} (log: {self.log})") from None
        log(f"vLLM is up after {secs:.0f} s at {self.url}")
        return self.url

    @property
    def proc(self):
        return self.server.proc

    def alive(self) -> bool:
        return self.server.alive()

    def failure(self) -> str:
        """The line of vLLM's log that says why it stopped: its root-cause error line (an exception, argparse's
        `error:`, pydantic's `Value error,`; not the wrappers that point to it), else its last line."""
        return log_cause(self.log)

    def why(self) -> str:
        """Why the server ended: the signal that killed it (an OOM killer's SIGKILL), else its log's error line."""
        rc = self.proc.returncode if self.proc is not None else None
        return self.server.exit_words() if rc is not None and rc < 0 else self.failure()

    def stop(self, timeout: float = 30.0) -> None:
        self.server.stop_s = timeout
        self.server.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


class VLLMFeatures:
    """Features of token-id sequences from a vLLM running the capture plugin: `features(seqs)` -> per sequence
    (aux [T, k, H], hidden [T, H], argmax [T]) as the local `capture_batch` returns them. `engine`: the VLLMLaunch
    when specscope started the server (a dead one is named in the error). `hidden_size`: the target's, which every
    capture file must have; `target_names`: what --model is called (the served model is checked against it)."""

    def __init__(self, url: str, capture_dir: Path, layers: list[int], *, model: str | None = None,
                 timeout_s: float = 600.0, engine: VLLMLaunch | None = None, file_wait_s: float = FILE_WAIT_S,
                 transport: httpx.BaseTransport | None = None, hidden_size: int | None = None,
                 target_names: tuple[str, ...] = ()):
        from specscope.train.endpoint import base_url

        self.url, self.dir, self.layers = base_url(url), Path(capture_dir), list(layers)
        self.model, self.timeout_s, self.engine, self.file_wait_s = model, timeout_s, engine, file_wait_s
        self.hidden_size, self.target_names, self.run_dir = hidden_size, tuple(target_names), None
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0), transport=transport)
        self.info: dict = {"engine": "vllm", "url": self.url}

    def connect(self, probe_ids: list[int], log=print) -> "VLLMFeatures":
        """The served model's id (checked against --model), then one tiny capture that must come back: the plugin is
        on and the directory is the one the server writes to."""
        from specscope.train.endpoint import Endpoint

        ep = Endpoint(self.url, model=self.model, timeout_s=min(self.timeout_s, 30.0))
        ep.connect(log=lambda m: None, client=self.client)      # every case it notes is decided here
        self.model, warning = served_model(ep.listed, self.model, self.target_names, f"{self.url}/v1/models")
        if warning:
            log(f"warning: {warning}")
        self.run_dir = open_run_dir(self.dir)
        meta = self._one(list(probe_ids))[3]
        self.info.update(engine_version=meta.get("engine_version"), served_model=self.model,
                         tensor_parallel_size=int(meta.get("tensor_parallel_size") or 1))
        log(f"capturing through vLLM {meta.get('engine_version')} at {self.url} (tensor parallel "
            f"{self.info['tensor_parallel_size']}; aux layers {self.layers})")
        return self

    def __call__(self, seqs: list[list[int]]) -> list[tuple]:
        with ThreadPoolExecutor(max_workers=max(1, len(seqs))) as pool:
            return [r[:3] for r in pool.map(self._one, seqs)]

    def close(self) -> None:
        self.client.close()
        if self.run_dir is not None:        # what a server writes after this is dropped (plugins/capture.py)
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- one request ------------------------------------------------------------------------------------------
    def _one(self, ids: list[int]):
        key = uuid.uuid4().hex[:24]
        self._post(ids, key)
        path = self._wait(key)
        try:
            got = read_capture(path, ids, self.layers, self.hidden_size, server=self.url)
        finally:
            path.unlink(missing_ok=True)
        return got.aux, got.hidden, got.argmax, got.meta

    def _post(self, ids: list[int], key: str) -> None:
        xargs = {XARG_KEY: key, XARG_LAYERS: self.layers}
        if self.run_dir is not None:
            xargs[XARG_RUN] = self.run_dir.name
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "vllm_xargs": xargs}
        for attempt in (1, 2):
            try:
                r = self.client.post(self.url + "/v1/completions", json=body)
                break
            except httpx.TimeoutException:
                raise CaptureFailed(f"vLLM at {self.url} did not answer a capture request within "
                                    f"{self.timeout_s:g} s; raise --timeout or lower --capture-batch (the shards so far "
                                    f"are kept: rerun to resume)") from None
            except httpx.TransportError as e:
                # the server closing an idle keep-alive connection as a request goes out on it (uvicorn's 5 s
                # timeout) looks like this: sent again once, under the same key, unless the server is gone
                if attempt == 2 or (self.engine is not None and not self.engine.alive()):
                    raise self._died(f"{type(e).__name__}: {e}") from None
        if r.status_code != 200:
            from specscope.train.endpoint import _server_message

            hint = ("the sequence is longer than the server's --max-model-len: raise it or lower --max-len"
                    if r.status_code == 400 else "is the server healthy?")
            raise SpecscopeError(f"vLLM at {self.url} refused a capture request of {len(ids)} tokens (HTTP "
                                 f"{r.status_code}: {_server_message(r)}); {hint}")

    def _died(self, what: str) -> CaptureFailed:
        if self.engine is not None:
            for _ in range(50):          # the process may take a moment to be reaped after its socket closed
                if not self.engine.alive():
                    break
                time.sleep(0.1)
            if not self.engine.alive():
                return CaptureFailed(f"vLLM exited with status {self.engine.proc.returncode} during the capture: "
                                      f"{self.engine.why()} (log: {self.engine.log}); the shards captured so far are "
                                      f"kept: rerun to resume")
        return CaptureFailed(f"lost the connection to vLLM at {self.url} during the capture ({what}); the shards "
                              f"captured so far are kept: rerun to resume")

    def _wait(self, key: str) -> Path:
        # in this run's directory; DIR itself from a plugin older than the run directories
        dirs = [d for d in (self.run_dir, self.dir) if d is not None]
        deadline = time.monotonic() + self.file_wait_s
        while True:
            for d in dirs:
                path, err = d / f"{key}.safetensors", d / f"{key}.error"
                if path.exists():
                    return path
                if err.exists():
                    why = err.read_text(errors="replace").strip()
                    err.unlink(missing_ok=True)
                    raise SpecscopeError(f"vLLM could not capture a request: {why}")
            if self.engine is not None and not self.engine.alive():
                raise self._died("the server exited")
            if time.monotonic() > deadline:
                raise SpecscopeError(f"vLLM at {self.url} answered but wrote no capture file to {self.dir} within "
                                     f"{self.file_wait_s:g} s: start it with {ENV_DIR}={self.dir} (specscope installed "
                                     f"in vLLM's environment) and pass that directory as --capture-dir")
            time.sleep(0.01)


def served_model(listed: list[dict], asked: str | None, target_names: tuple[str, ...],
                 where: str) -> tuple[str, str | None]:
    """(the model id to capture from, a warning or None), from the server's /v1/models entries: the id the user
    asked for (--served-model-name) must be listed; else the one whose id or root is --model's name, else the only
    one, with a warning (vLLM's --served-model-name may rename --model's checkpoint; the hidden size is checked)."""
    ids = [m["id"] for m in listed]
    if asked is not None:
        if ids and asked not in ids:
            raise SpecscopeError(f"{where} serves {ids[:5]}, not --served-model-name {asked!r}; pass the id it serves "
                                 f"--model under, or point --capture at the server of --model")
        return asked, None
    mine = {n for name in target_names for n in (name, Path(name).name) if n}
    match = [m["id"] for m in listed if any(isinstance(v, str) and (v in mine or Path(v).name in mine)
                                            for v in (m["id"], m.get("root")))]
    if match:
        return match[0], None
    target = target_names[0] if target_names else "--model"
    if len(ids) == 1:
        return ids[0], (f"{where} serves {ids[0]!r}, not --model {target!r}; capturing from it as --model (pass "
                        f"--served-model-name {ids[0]!r} if that is --model's served name)")
    raise SpecscopeError(f"{where} serves {ids[:5]}, none of them --model {target!r}; pass --served-model-name with "
                         f"the id it serves --model under")


def check_vllm_here() -> None:
    """--capture vllm starts vLLM with this Python: it must have vllm (a find_spec, not an import: fast)."""
    if importlib.util.find_spec("vllm", None) is None:
        raise SpecscopeError(f"--capture vllm starts vLLM with this Python ({sys.executable}), which has no vllm; "
                             f"run specscope from vLLM's environment, or start a server there with "
                             f"{ENV_DIR}=DIR and pass --capture URL --capture-dir DIR")


def check_flags(capture: str | None, capture_dir: str | None, engine_args: str | None, stages: list[str],
                synth: int) -> tuple[str | None, list[str]]:
    """--capture / --capture-dir / --engine-args checked before anything runs -> (mode: None | "vllm" | base URL,
    vLLM argv)."""
    from specscope.train.endpoint import base_url

    if capture in (None, "local"):
        for flag, v in (("--engine-args", engine_args), ("--capture-dir", capture_dir)):
            if v:
                raise SpecscopeError(f"{flag} needs --capture vllm or --capture URL")
        return None, []
    url = None if capture == "vllm" else base_url(capture, "--capture", CAPTURE_TAKES)
    if capture_dir is not None and not capture_dir.strip():
        raise SpecscopeError("--capture-dir is empty; pass the directory the server's "
                             f"{ENV_DIR} names")
    if "data" not in stages:
        raise SpecscopeError("--capture computes the data stage's features; add data to --stages")
    if synth > 0:
        raise SpecscopeError("--synth writes conversations with specscope's own forward of the target, which "
                             "--capture never runs; use --prompt-file or --dataset (answered by the server)")
    if capture == "vllm":
        argv = list(vllm.capture_flags(engine_args).argv)
        check_vllm_here()
        return "vllm", argv
    if engine_args:
        raise SpecscopeError("--engine-args is for --capture vllm (specscope starts that server); a running server "
                             "was started with its own flags")
    if not capture_dir:
        raise SpecscopeError(f"--capture URL needs --capture-dir DIR: the directory the server's {ENV_DIR} names "
                             f"(reachable from here)")
    return url, []


class CaptureSession:
    """The server (started here for `--capture vllm`) and its VLLMFeatures for one data stage: `with` stops it.
    `hidden_size`, `target_names`: the target's, that the server's model and files are checked against."""

    def __init__(self, mode: str, argv: list[str], model_path: Path, workdir: Path, layers: list[int], *,
                 capture_dir: str | None, max_len: int, timeout_s: float, model: str | None = None,
                 hidden_size: int | None = None, target_names: tuple[str, ...] = ()):
        self.engine = None
        if mode == "vllm":
            cdir = Path(capture_dir) if capture_dir else Path(workdir) / "data" / ".incoming"
            self.engine = VLLMLaunch(model_path, argv, cdir, Path(workdir) / "vllm-capture.log", max_len)
            url = self.engine.url
        else:
            cdir, url = Path(capture_dir), mode
        self.features = VLLMFeatures(url, cdir, layers, model=model, timeout_s=timeout_s, engine=self.engine,
                                     hidden_size=hidden_size, target_names=(*target_names, str(model_path)))

    def open(self, probe_ids: list[int], log=print) -> VLLMFeatures:
        try:
            if self.engine is not None:
                self.engine.start(log)
                self.features.info["engine_args"] = self.engine.command
            return self.features.connect(probe_ids, log)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.features.close()
        if self.engine is not None:
            self.engine.stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:40] or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True             # another user's process (or a name we did not make): never ours to clean
    return True


def open_run_dir(capture_dir: Path) -> Path:
    """This run's own directory under the capture directory (the server writes this run's files there, and it is
    removed at the end), after removing those of this host's runs whose process is gone (killed mid-capture): the
    user's directory keeps nothing of ours, and nothing of anyone else's is touched."""
    capture_dir.mkdir(parents=True, exist_ok=True)
    host = _host()
    for d in capture_dir.glob(RUN_PREFIX + "*"):
        parts = d.name[len(RUN_PREFIX):].rsplit("-", 2)
        if len(parts) == 3 and parts[0] == host and re.fullmatch(r"[0-9]{1,10}", parts[1]) \
                and not _alive(int(parts[1])):
            shutil.rmtree(d, ignore_errors=True)
    d = capture_dir / f"{RUN_PREFIX}{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    d.mkdir()
    return d
