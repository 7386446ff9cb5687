"""The capture mode of specscope's vLLM plugin: a target's hidden states for drafter training, computed by vLLM.

Enable it in the server's environment (the plugin must be installed in vLLM's venv, as for SPECSCOPE_PHASES):

    SPECSCOPE_CAPTURE=/shared/capture python -m vllm.entrypoints.openai.api_server --model M --enforce-eager \\
        --no-enable-prefix-caching --tensor-parallel-size 8 ...

`specscope train --stages data --capture URL --capture-dir /shared/capture` (or `--capture vllm`, which starts such
a server itself) then sends each training conversation's exact token ids to /v1/completions with max_tokens 1 and
`vllm_xargs {"specscope_capture": KEY, "specscope_layers": [2, 30, 58]}`. Only requests marked so are captured. In
each worker, forward hooks on the decoder layers keep, for those requests' prompt positions, the hidden state
entering each named layer (index i = after layer i-1, hidden + residual: what vLLM's own EAGLE-3 path reads; 0 =
the embeddings), the final normed hidden state and the target's argmax (vLLM's own compute_logits, which gathers a
tensor-parallel LM head). When every prompt position is in (chunked prefill spans steps), tensor-parallel rank 0
writes DIR/KEY.safetensors atomically (aux [T, k, H], hidden [T, H] in the model's dtype, argmax, input_ids) or
DIR/KEY.error (one line) when the request cannot be captured. With tensor parallelism each decoder layer's output is
all-reduced, so rank 0 holds the full states; pipeline parallelism is refused.

Python hooks do not run inside compiled graphs or CUDA graphs: the server needs --enforce-eager (a capture that
saw no hook writes an error saying so). Prefix caching would skip the shared positions' forward: requests that hit it
are refused with an error naming --no-enable-prefix-caching. The hooks are written for vLLM's V1 model runner (the
CPU build's, and the GPU fallback): capture mode sets VLLM_USE_V2_MODEL_RUNNER=0 unless it is set, and refuses
marked requests under the V2 runner.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from specscope.train.capture_files import ENV_DIR, XARG_LAYERS, capture_key, write_capture, write_error

LOGITS_CHUNK = 256          # rows per compute_logits call: a 163,840-token vocabulary is 168 MB of fp32 per chunk

log = logging.getLogger("specscope.plugins.capture")
_state: dict = {"installed": False}


def register(supported_version) -> None:
    """Called by specscope's vLLM entry point in every vLLM process (with plugins/vllm.py's version gate);
    inert unless SPECSCOPE_CAPTURE is set."""
    out = os.environ.get(ENV_DIR)
    if not out or _state["installed"]:
        return
    version = supported_version("capture")
    if version is None:
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    # the hooks are written for the V1 model runner; vLLM reads this when it builds its config, after plugins load,
    # and its engine and worker processes inherit it (an explicit VLLM_USE_V2_MODEL_RUNNER=1 is refused per request)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    _install(Path(out), version)
    _refuse_v2(Path(out))


def _install(out: Path, version: str) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    execute_model = GPUModelRunner.execute_model

    def execute_model_captured(self, scheduler_output, *args, **kwargs):
        cap = self.__dict__.get("_specscope_capture")
        if cap is None:
            cap = self._specscope_capture = Capturer(self, out, version)
        cap.begin(scheduler_output)
        try:
            result = execute_model(self, scheduler_output, *args, **kwargs)
        except BaseException:
            cap.step = cap.so = None
            raise
        cap.end()
        return result

    execute_model_captured.__wrapped__ = execute_model
    GPUModelRunner.execute_model = execute_model_captured
    _state["installed"] = True


def _refuse_v2(out: Path) -> None:
    """Under Model Runner V2 the hooks never run: each marked request gets an error saying so."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as RunnerV2
    except Exception:       # not importable on this platform (no Triton): V2 cannot run here either
        return
    execute_model = RunnerV2.execute_model

    def execute_model_refused(self, scheduler_output, *args, **kwargs):
        for req in getattr(scheduler_output, "scheduled_new_reqs", None) or ():
            extra = getattr(getattr(req, "sampling_params", None), "extra_args", None) or {}
            key = capture_key(extra)
            if key is not None:
                write_error(out, key, "specscope's capture hooks run in vLLM's V1 model runner; start vLLM "
                                       "without VLLM_USE_V2_MODEL_RUNNER=1")
        return execute_model(self, scheduler_output, *args, **kwargs)

    execute_model_refused.__wrapped__ = execute_model
    RunnerV2.execute_model = execute_model_refused


@dataclass
class Segment:
    """One captured request's rows in a step's flattened batch."""
    req_id: str
    key: str
    layers: list[int]
    start: int          # first row in the batch
    n: int              # rows this step
    offset: int         # its first row among the step's captured rows


@dataclass
class Step:
    segments: list[Segment]
    rows: object                        # LongTensor: the batch rows of captured requests
    wanted: set[int]
    positions: object = None
    input_ids: object = None
    saved: dict = field(default_factory=dict)   # layer index -> [rows, H]
    final: object = None                        # [rows, H] final normed hidden


@dataclass
class Pending:
    """A request's prompt features, filled as its prefill steps run."""
    key: str
    layers: list[int]
    prompt: list[int]
    aux: object = None
    hidden: object = None
    argmax: object = None
    filled: object = None


class Capturer:
    """Hooks on one model runner's model, and the requests being captured."""

    def __init__(self, runner, out: Path, version: str, ranks: tuple[int, int] | None = None):
        """ranks: (pipeline-parallel size, tensor-parallel rank), read from vLLM when not given (tests give them)."""
        if ranks is None:
            from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

            ranks = (get_pp_group().world_size, get_tensor_model_parallel_rank())
        self.runner, self.out, self.version = runner, Path(out), version
        self.model = runner.get_model()
        self.layers = decoder_layers(self.model, runner)
        self.pp, self.tp_rank = ranks
        self.writer = self.tp_rank == 0
        self.pending: dict[str, Pending] = {}
        self.written: set[str] = set()      # requests whose file is out: their decode steps (max_tokens > 1) are not
        self.so = self.step = None
        self._hook()

    def _hook(self) -> None:
        self.model.register_forward_pre_hook(self._top_pre, with_kwargs=True)
        self.model.register_forward_hook(self._top_post)
        if self.layers:
            self.layers[0].register_forward_pre_hook(self._embed_pre, with_kwargs=True)
            for i, layer in enumerate(self.layers):
                layer.register_forward_hook(lambda m, a, o, idx=i + 1: self._after_layer(idx, o))

    # -- per step ---------------------------------------------------------------------------------------------
    def begin(self, so) -> None:
        self.so, self.step = so, None
        for r in getattr(so, "finished_req_ids", ()) or ():
            self.written.discard(r)
            p = self.pending.pop(r, None)
            if p is not None and self.writer:
                self._error(p.key, "the request ended before all its prompt positions were computed")

    def _top_pre(self, module, args, kwargs):
        self.step = None
        if self.so is None:
            return
        marked = self._marked()
        if not marked:
            return
        import torch

        segs, rows, start, off = [], [], 0, 0
        counts = self.so.num_scheduled_tokens
        for r in list(self.runner.input_batch.req_ids):
            n = int(counts.get(r, 0))
            if r in marked:
                key, layers = marked[r]
                segs.append(Segment(r, key, layers, start, n, off))
                rows.append(torch.arange(start, start + n))
                off += n
            start += n
        if not segs:
            return
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        dev = positions.device if positions is not None else None
        L = len(self.layers)
        wanted = {i for s in segs for i in s.layers if isinstance(i, int) and 0 <= i <= L}
        self.step = Step(segs, torch.cat(rows).to(dev), wanted, positions=positions, input_ids=input_ids)

    def _marked(self) -> dict[str, tuple[str, list]]:
        """{request id: (key, layers as sent)} of this step's requests that asked to be captured."""
        out = {}
        for r in self.so.num_scheduled_tokens:
            st = self.runner.requests.get(r)
            extra = getattr(getattr(st, "sampling_params", None), "extra_args", None) or {}
            key = capture_key(extra)
            # never a path we did not make (traversal): no file, and the client says it saw none
            if key is not None:
                layers = extra.get(XARG_LAYERS)
                out[r] = (key, layers if isinstance(layers, list) else [layers])
        return out

    def _embed_pre(self, module, args, kwargs):
        if self.step is not None and 0 in self.step.wanted:
            h = kwargs.get("hidden_states", args[1] if len(args) > 1 else None)
            self.step.saved[0] = h.index_select(0, self.step.rows)

    def _after_layer(self, idx: int, out) -> None:
        if self.step is None or idx not in self.step.wanted:
            return
        h, r = (out[0], out[1]) if isinstance(out, tuple) else (out, None)
        # the residual stream entering the next layer (vLLM's own EAGLE-3 aux state): hidden + residual
        v = h if r is None else h + r
        self.step.saved[idx] = v.index_select(0, self.step.rows)

    def _top_post(self, module, args, out):
        if self.step is None:
            return
        h = out[0] if isinstance(out, tuple) else out
        if hasattr(h, "index_select"):
            self.step.final = h.index_select(0, self.step.rows)

    def end(self) -> None:
        step, self.step, self.so = self.step, None, None     # a dummy run between steps captures nothing
        if step is None:
            return
        try:
            self._finish(step)
        except Exception as e:      # a capture must never take the engine down: the client gets the reason
            log.exception("specscope capture failed")
            for s in step.segments:
                self.pending.pop(s.req_id, None)
                if self.writer:
                    self._error(s.key, f"capture failed in vLLM's worker: {type(e).__name__}: {e}")

    def _finish(self, step: Step) -> None:
        why = self._refuse(step)
        argmax = self._argmax(step.final) if why is None else None     # every rank: the TP gather is collective
        if not self.writer:
            return
        for s in step.segments:
            if why is not None:
                self.pending.pop(s.req_id, None)
                self._error(s.key, why)
                continue
            self._take(step, s, argmax)

    def _refuse(self, step: Step) -> str | None:
        if self.pp > 1:
            return ("capture does not support pipeline parallelism (the layers are split across ranks); use "
                    "--tensor-parallel-size instead of --pipeline-parallel-size")
        if step.final is None or any(i not in step.saved for i in step.wanted):
            return ("vLLM ran this request without specscope's forward hooks (a compiled or CUDA-graph model): "
                    "start vLLM with --enforce-eager")
        return None

    def _argmax(self, final):
        parts = []
        for chunk in final.split(LOGITS_CHUNK):
            logits = self.model.compute_logits(chunk)
            if logits is not None:
                parts.append(logits.argmax(-1))
        import torch

        return torch.cat(parts) if parts else None

    def _take(self, step: Step, s: Segment, argmax) -> None:
        import torch

        L = len(self.layers)
        if not s.layers or not all(isinstance(i, int) and 0 <= i <= L for i in s.layers):
            self._error(s.key, f"aux layers {s.layers} are not hidden-state indices 0..{L} of this {L}-layer model")
            return
        if s.req_id in self.written:
            return
        p = self.pending.get(s.req_id)
        pos = step.positions.index_select(0, step.rows[s.offset:s.offset + s.n]).long().cpu()
        if p is None:
            prompt = list(self.runner.requests[s.req_id].prompt_token_ids or [])
            if int(pos[0]) != 0:
                self._error(s.key, f"positions 0..{int(pos[0]) - 1} came from vLLM's prefix cache, not a forward; "
                                   f"start vLLM with --no-enable-prefix-caching")
                return
            p = self.pending[s.req_id] = _pending(s, prompt, step, self.version)
        keep = pos < len(p.prompt)             # decode positions (max_tokens > 1) are not the prompt's
        sl = slice(s.offset, s.offset + s.n)
        idx = pos[keep]
        ids = step.input_ids.index_select(0, step.rows[sl]).cpu()[keep] if step.input_ids is not None else None
        if ids is not None and ids.tolist() != [p.prompt[i] for i in idx.tolist()]:
            self.pending.pop(s.req_id, None)
            self._error(s.key, "the batch layout specscope read does not match this request's tokens")
            return
        p.aux[idx] = torch.stack([step.saved[i][sl][keep] for i in s.layers], dim=1).cpu()
        p.hidden[idx] = step.final[sl][keep].cpu()
        p.argmax[idx] = argmax[sl][keep].cpu().to(torch.int64)
        p.filled[idx] = True
        if bool(p.filled.all()):
            del self.pending[s.req_id]
            self.written.add(s.req_id)
            self._write(p)

    # -- files ------------------------------------------------------------------------------------------------
    def _write(self, p: Pending) -> None:
        meta = {"layers": json.dumps(p.layers), "engine": "vllm", "engine_version": self.version,
                "tensor_parallel_size": str(self.runner.parallel_config.tensor_parallel_size)}
        write_capture(self.out, p.key, p.aux, p.hidden, p.argmax, p.prompt, meta)

    def _error(self, key: str, why: str) -> None:
        write_error(self.out, key, why)


def _pending(s: Segment, prompt: list[int], step: Step, version: str) -> Pending:
    import torch

    T, H, dt = len(prompt), step.final.shape[-1], step.final.dtype
    return Pending(s.key, s.layers, prompt, aux=torch.zeros(T, len(s.layers), H, dtype=dt),
                   hidden=torch.zeros(T, H, dtype=dt), argmax=torch.zeros(T, dtype=torch.int64),
                   filled=torch.zeros(T, dtype=torch.bool))


def decoder_layers(model, runner) -> list:
    """The model's decoder layers in order: `model.model.layers` (Llama, Qwen, DeepSeek, Mixtral, ...), else the one
    ModuleList as long as the config's num_hidden_layers (a multimodal wrapper's language model)."""
    import torch.nn as nn

    inner = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(inner, nn.ModuleList):
        return list(inner)
    cfg = runner.model_config.hf_text_config
    n = getattr(cfg, "num_hidden_layers", None)
    for name, mod in model.named_modules():
        if name.endswith("layers") and isinstance(mod, nn.ModuleList) and len(mod) == n:
            return list(mod)
    return []
