"""A stand-in serving engine for the sweep tests of the plugin path: an OpenAI-style chat server on loopback whose
"engine steps" go through specscope's real step recorder (plugins/steps.py, what the vLLM plugin drives), written
to SPECSCOPE_PHASES as vLLM's plugin writes them. A step verifies --steps drafts (plain decoding without it) and
costs a declared verify time that grows with the tokens verified and a declared draft time that grows with the
steps. The recorder reads those costs from the stand-in's own clock (`DeclaredClock`), not the machine's: the
phases the sweep finds are exactly the declared ones however loaded the machine is (the stand-in still sleeps them,
so a client's wall times follow). Only the engines suite runs vLLM itself.

    python tests/sweep_engine.py --port P [--steps K | --speculative-config JSON] [--verify-ms 2] [--fail]
                                 [--die-after N] [--fail-every K] [--requests-file F] [--gather-ms 30]
                                 [--slow-from K [--slow-env BUILD] [--slow-factor 3]] [--drift-from J --drift-factor F]
                                 [--placement-file F]
                                 [--fail-value V ... [--fail-env BUILD]] [--pid-file F]

--die-after N: the process exits on its (N+1)-th request (an engine that crashes mid-workload); --fail-every K:
every K-th request is answered 500 (an engine failing some requests); --slow-from K: a regression planted from
build K on (verify --slow-factor times dearer where $BUILD >= K), for `specscope bisect` to find, and --drift-from J
a smaller step before it (--drift-factor times dearer where J <= $BUILD < K); --fail-value V:
fails to start, as --fail, where $BUILD is V (a build that does not start, for bisect to skip); --pid-file F: its pid
appended to F at start (a test checks none is left running). --speculative-config JSON: vLLM's spelling, its
num_speculative_tokens sets --steps. Steps batch the requests in flight (B of them: verify costs 1 + 0.5 (B - 1) times
one sequence's), so concurrency makes steps of several batch sizes; --requests-file F: "launch" at start, then per
request as it arrives the requests in flight."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import specscope.profile.cycle as cycle
from specscope.plugins.steps import StepRecorder

ACCEPT = (2, 0, 1, 2, 1)        # accepted drafts per step, cycled (clipped to --steps)
DRAFT_MS_PER_STEP = 0.5


def verify_ms(verify: float, steps: int, batch: int = 1) -> float:
    """The declared cost of one target forward over `batch` sequences of 1 + steps tokens each."""
    return verify * (1 + 0.25 * steps) * (1 + 0.5 * (batch - 1))


class DeclaredClock:
    """The time the step recorder's profiler reads: advanced by exactly the cost the stand-in declares for each
    phase (and slept for real), so the recorded phases are the declared costs, not the machine's load."""

    def __init__(self):
        self.ns = 0

    def perf_counter_ns(self) -> int:
        return self.ns

    def spend(self, ms: float) -> None:
        self.ns += round(ms * 1e6)
        time.sleep(ms / 1e3)


def planted_factor(a) -> float:
    """The verify's planted cost factor at this build: --slow-factor from --slow-from on, --drift-factor from
    --drift-from on before that, 1 elsewhere."""
    build = int(os.environ.get(a.slow_env, "0"))
    if a.slow_from is not None and build >= a.slow_from:
        return a.slow_factor
    return a.drift_factor if a.drift_from is not None and build >= a.drift_from else 1.0


def _args():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--speculative-config", default=None,
                   help="vLLM's JSON spelling: its num_speculative_tokens sets --steps")
    p.add_argument("--gather-ms", type=float, default=30.0,
                   help="an idle engine waits this long before its first step, so requests sent together batch")
    p.add_argument("--requests-file", default=None,
                   help="append, per request as it arrives, the requests in flight (itself included)")
    p.add_argument("--verify-ms", type=float, default=2.0, help="below 0: exit at once, as --fail")
    p.add_argument("--fail", action="store_true", help="exit at once, as an engine with a bad flag does")
    p.add_argument("--die-after", type=int, default=None, help="exit on the request after this many")
    p.add_argument("--fail-every", type=int, default=None, help="answer every K-th request with 500")
    p.add_argument("--slow-from", type=int, default=None,
                   help="a planted regression: verify costs --slow-factor times more when the environment variable "
                        "--slow-env holds an integer at least this (a bisection test's builds)")
    p.add_argument("--slow-env", default="BUILD")
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--drift-from", type=int, default=None,
                   help="a smaller step before the regression: verify --drift-factor times dearer from this build on")
    p.add_argument("--drift-factor", type=float, default=1.5)
    p.add_argument("--fail-value", action="append", default=[],
                   help="exit at once, as --fail, when the environment variable --fail-env holds this value")
    p.add_argument("--fail-env", default="BUILD")
    p.add_argument("--pid-file", default=None, help="append this process's pid to this file at start")
    p.add_argument("--placement-file", default=None,
                   help="write the cores this process may run on and VLLM_CPU_OMP_THREADS_BIND here at start")
    a = p.parse_args()
    if a.speculative_config is not None:
        a.steps = int(json.loads(a.speculative_config).get("num_speculative_tokens") or 0)
    return a


class Request:
    def __init__(self, want: int):
        self.want, self.done, self.chunks, self.finished = want, 0, [], False


class Engine:
    """The stand-in's steps, timed by the step recorder when SPECSCOPE_PHASES is set: one loop over the requests in
    flight, each step verifying (or decoding) all of them at once, as an engine's continuous batching does."""

    def __init__(self, a):
        self.a, self.n, self.requests = a, 0, 0
        self.verify_ms = a.verify_ms * planted_factor(a)
        self.lock = threading.Lock()            # the request count
        self.cond = threading.Condition()       # the requests in flight and their tokens
        self.active: list[Request] = []
        self.clock = DeclaredClock()
        cycle.time = self.clock                 # the profiler's timer is the declared clock
        path = os.environ.get("SPECSCOPE_PHASES")
        cfg = {"engine": "stand-in", "model": "stand-in", "steps": a.steps or None,
               "num_speculative_tokens": a.steps or None, "method": "eagle3" if a.steps else None}
        self.rec = StepRecorder(path, "stand-in", "0", {k: v for k, v in cfg.items() if v is not None},
                                every_s=3600, out=open(os.devnull, "w")) if path else None
        threading.Thread(target=self.loop, daemon=True).start()

    def _scope(self, phase):
        return self.rec.scope(phase) if self.rec else _null()

    def submit(self, want: int) -> Request:
        r = Request(want)
        with self.cond:
            self.active.append(r)
            in_flight = len(self.active)
            self.cond.notify_all()
        if self.a.requests_file:
            with open(self.a.requests_file, "a") as f:
                f.write(f"{in_flight}\n")
        return r

    def loop(self):
        while True:
            with self.cond:
                idle = not self.active
                while not self.active:
                    self.cond.wait()
            if idle:
                time.sleep(self.a.gather_ms / 1e3)
            with self.cond:
                batch = list(self.active)
            acc = self.step(len(batch))
            with self.cond:
                for r in batch:
                    k = min(acc + 1, r.want - r.done)
                    r.done += k
                    r.chunks.append(k)
                    if r.done >= r.want:
                        r.finished = True
                        self.active.remove(r)
                self.cond.notify_all()

    def step(self, batch: int) -> int:
        """One engine step over `batch` requests: verify (or decode) and draft; returns the drafts accepted."""
        a = self.a
        acc = min(ACCEPT[self.n % len(ACCEPT)], a.steps)
        self.n += 1
        if self.rec:
            self.rec.begin_step("verify" if a.steps else "decode")
        with self._scope("forward"):
            self.clock.spend(verify_ms(self.verify_ms, a.steps, batch))
        if a.steps:
            with self._scope("draft"):
                self.clock.spend(DRAFT_MS_PER_STEP * a.steps)
        if self.rec:
            self.rec.end_step([a.steps] * batch, [acc if a.steps else 0] * batch)
        return acc


def handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *x):
            pass

        def _send(self, code, body):
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"{}")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"data": [{"id": "stand-in"}]}).encode())
            else:
                self._send(404, b"{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            want = int(body.get("max_tokens") or 16)
            a = engine.a
            with engine.lock:
                engine.requests += 1
                n = engine.requests
            if a.die_after is not None and n > a.die_after:
                print(f"RuntimeError: the engine died on request {n} (stand-in failure)", flush=True)
                os._exit(4)
            if a.fail_every and n % a.fail_every == 0:
                self._send(500, json.dumps({"error": {"message": f"request {n} failed (stand-in)"}}).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            req = engine.submit(want)
            while True:
                with engine.cond:
                    while not req.chunks and not req.finished:
                        engine.cond.wait()
                    chunks, req.chunks, last = req.chunks, [], req.finished and not req.chunks
                if last:
                    break
                for k in chunks:
                    chunk = {"choices": [{"delta": {"content": " w" * k}, "finish_reason": None}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": req.done}}
            self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return Handler


def main():
    a = _args()
    if a.pid_file:
        with open(a.pid_file, "a") as f:
            f.write(f"{os.getpid()}\n")
    if a.fail or a.verify_ms < 0 or os.environ.get(a.fail_env) in a.fail_value:
        print("loading weights ...", flush=True)
        print("ValueError: the model does not fit (stand-in failure)", flush=True)
        raise SystemExit(3)
    if a.placement_file:        # what a launch inherited from the sweep: its cores and the engine's binding
        with open(a.placement_file, "w") as f:
            json.dump({"affinity": sorted(os.sched_getaffinity(0)),
                       "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}, f)
    if a.requests_file:         # each launch's requests after its own line
        with open(a.requests_file, "a") as f:
            f.write("launch\n")
    engine = Engine(a)
    srv = ThreadingHTTPServer((a.host, a.port), handler(engine))
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        if engine.rec:
            engine.rec.close()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *e):
        return False


if __name__ == "__main__":
    main()
