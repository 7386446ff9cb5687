"""`specscope train` end to end: the stages data -> vocab -> train -> select, each resumable, with everything flags
and files decide checked before the target loads (`plan_stages`), then run in order (`run_stages`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from specscope.errors import SpecscopeError
from specscope.fileio import check_writable, refuse_overlap
from specscope.speculative.eagle3 import DrafterConfig
from specscope.speculative.eagle3_export import WRITES
from specscope.train import pipeline
from specscope.train.trainer import TrainConfig, dist_info, train


@dataclass
class DataOptions:
    """The data stage: where the conversations come from, how their answers are made, how much of each."""
    dataset: str | None = None
    dataset_split: str = "train"
    dataset_config: str | None = None
    dataset_streaming: bool = False
    prompt_files: list[str] = field(default_factory=list)
    answering: pipeline.Answering = field(default_factory=pipeline.Answering)   # answers and synthesis
    capture_batch: int = 4
    gen_dtype: str = "fp32"


@dataclass
class CaptureOptions:
    """--capture: the hidden states computed in vLLM, started here (mode "vllm") or reached at a URL."""
    mode: str | None = None
    capture_dir: str | None = None
    engine_args: str | None = None


@dataclass
class AnswerServer:
    """--answers-from: the OpenAI-compatible server that answers the data stage's prompts."""
    url: str | None = None
    model: str | None = None
    api_key: str | None = None
    concurrency: int = 8
    timeout_s: float = 600.0


@dataclass
class TrainJob:
    """One `specscope train` call. `train` is the trainer's configuration; its seed and max_len serve every stage."""
    workdir: str
    target_name: str
    stages: list[str]
    train: TrainConfig
    data: DataOptions = field(default_factory=DataOptions)
    capture: CaptureOptions = field(default_factory=CaptureOptions)
    answers: AnswerServer = field(default_factory=AnswerServer)
    draft_vocab: int = 8192
    init_from: str | None = None
    resume: bool = False
    report_to: str = "none"
    select_prompts: int = 12
    select_steps: int = 3
    export_format: str = "sglang"
    export_dtype: str = "bf16"
    output: str | None = None
    progress: bool = True

    @property
    def work(self) -> Path:
        return Path(self.workdir)


@dataclass
class Plan:
    """What flags and files decided before the target loads."""
    rank: int
    world: int
    log: Callable[[str], None]          # rank 0's messages; the other processes say nothing
    tpath: Path
    tcfg: object
    aux: list[int]                      # the target layers the drafter reads
    runs_forward: bool                  # the target's forward runs here (a local data stage, select)
    init: object | None = None          # the --init drafter
    cap_mode: str | None = None
    cap_argv: list[str] | None = None
    sources: object | None = None       # the data stage's conversations and prompts, read
    endpoint: object | None = None      # the --answers-from server, connected


@dataclass
class LoadedTarget:
    """The target as far as this run's stages need it: the whole model (its forward runs here), its embedding and LM
    head alone, or (--capture) its config and tokenizer alone."""
    model: object
    tok: object | None
    path: Path
    info: dict
    dev: torch.device


def plan_stages(job: TrainJob, echo: Callable[[str], None]) -> Plan:
    """Everything flags and files decide is decided before the target loads, not after minutes of loading and
    capturing: output paths, the target's files, --init, the data sources, the vocabulary size. `echo` prints a
    message (rank 0 alone uses it)."""
    from specscope.speculative.formats import resolve_target
    from specscope.train.capture import check_flags
    from specscope.train.tracking import check_tracker

    todo, d = job.stages, job.data
    check_writable(job.workdir, "--workdir", is_dir=True)
    if job.output is not None:
        check_writable(job.output, "--output", is_dir=True)
    if "train" in todo:
        check_tracker(job.report_to)
    rank, world = dist_info()
    say = echo if rank == 0 else (lambda m: None)
    if world > 1 and ("data" in todo or "vocab" in todo or "select" in todo):
        raise SpecscopeError("run the data, vocab and select stages in one process; torchrun only --stages train")
    cap_mode, cap_argv = check_flags(job.capture.mode, job.capture.capture_dir, job.capture.engine_args, todo,
                                     d.answering.synth)
    # the target's forward runs here only for a local data stage and for select
    runs_forward = ("data" in todo and cap_mode is None) or "select" in todo
    tpath, tcfg = _preflight(job.target_name, runs_forward)
    if "train" in todo or "select" in todo:
        check_output(job, tpath)
    init = pipeline.init_drafter(job.init_from, resolve_target(str(tpath), job.target_name)) \
        if job.init_from else None
    aux = aux_layers(tcfg, init)
    sources = (pipeline.read_data_sources(d.dataset, list(d.prompt_files), d.answering.synth, log=say,
                                          dataset_split=d.dataset_split, dataset_config=d.dataset_config,
                                          dataset_streaming=d.dataset_streaming)
               if "data" in todo else None)
    endpoint = connect_answers(job, job.answers.url, job.answers.model, say) \
        if job.answers.url and "data" in todo else None
    if "vocab" in todo and init is None and job.draft_vocab > tcfg.vocab_size:
        raise SpecscopeError(f"--draft-vocab {job.draft_vocab} is larger than the target's vocabulary of "
                             f"{tcfg.vocab_size} tokens; use at most {tcfg.vocab_size}")
    return Plan(rank, world, say, tpath, tcfg, aux, runs_forward, init=init, cap_mode=cap_mode, cap_argv=cap_argv,
                sources=sources, endpoint=endpoint)


def run_stages(job: TrainJob, plan: Plan, dev: torch.device) -> dict | None:
    """The planned stages on `dev`, in order; the JSON summary (on rank 0; None on the other processes)."""
    todo, work, say = job.stages, job.work, plan.log
    data = None
    if "data" not in todo and ("vocab" in todo or "train" in todo or "select" in todo):
        data = captured(work, plan.aux, dev, plan.tcfg.hidden_size)  # checked before the target loads
    if "train" in todo and "vocab" not in todo and plan.init is None and not (work / "vocab.pt").exists():
        raise SpecscopeError(f"{work / 'vocab.pt'} does not exist; run the vocab stage first (--stages vocab,train)")
    if "select" in todo and "train" not in todo and not any((work / "train" / "snapshots").glob("step-*.pt")):
        raise SpecscopeError(f"no snapshots in {work / 'train' / 'snapshots'}; run the train stage first")
    target = load_stage_target(job, plan, dev)
    summary = {"workdir": str(work), "target": target.info, "stages": todo}
    if "data" in todo:
        summary["data"] = data_stage(job, plan, target)
    if data is None and ("vocab" in todo or "train" in todo or "select" in todo):
        data = captured(work, plan.aux, dev, plan.tcfg.hidden_size)  # the shards this run's data stage just wrote
    if "vocab" in todo:
        if plan.init is not None:
            say("--init: keeping the initial drafter's own draft vocabulary")
        else:
            summary["vocab"] = pipeline.vocab_stage(work, data, target.model.config.vocab_size, job.draft_vocab,
                                                    log=say)
    if "train" in todo:
        summary.update(train_stage(job, plan, target, data))
    if "select" in todo and plan.rank == 0:
        sel = pipeline.select_stage(work, target.model, target.tok, data, job.train.eval_fraction, job.train.seed,
                                    n_prompts=job.select_prompts, steps=job.select_steps, log=say)
        summary["select"] = {k: sel[k] for k in ("selected_step", "shape")}
        summary["drafter"] = export_drafter(job, work / "train" / "selected.pt", target.info, say,
                                            f"drafter (selected step {sel['selected_step']})")
    if plan.world > 1:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    return summary if plan.rank == 0 else None


def aux_layers(tcfg, init) -> list[int]:
    """The target layers whose hidden states the drafter reads: --init's own, else EAGLE-3's default."""
    L = tcfg.num_hidden_layers
    aux = list(init.aux_layers) if init is not None else DrafterConfig.default_aux_layers(L)
    if not all(0 <= i <= L for i in aux):
        raise SpecscopeError(f"the target has {L} layers, so EAGLE-3's aux layers {aux} (2, L//2, L-3 by default) "
                             f"fall outside 0..{L}; train for a target with at least 4 layers")
    if init is not None and any(b <= a for a, b in zip(aux, aux[1:])):
        raise SpecscopeError(f"--init's drafter reads aux layers {aux}, which must be distinct and increasing (three "
                             f"different target layers in order, as vLLM and SGLang collect them); fix its "
                             f"config's aux layer ids, or train a fresh drafter without --init")
    return aux


def _preflight(target_name: str, runs_forward: bool):
    """(path, config) of the target, checked before anything loads: its config, weight files and tokenizer. Stages
    that never run its forward read any architecture's config (an MoE served by vLLM) and need no weights but the
    few the train stage reads."""
    from specscope.models.hub import resolve_model
    from specscope.models.loader import load_config, weight_files
    from specscope.runtime.tokenizer import check_tokenizer_files

    tpath = resolve_model(target_name)
    tcfg, _ = load_config(tpath, any_architecture=not runs_forward)
    if runs_forward:
        weight_files(tpath)
    check_tokenizer_files(tpath)
    return tpath, tcfg


def check_output(job: TrainJob, tpath: Path) -> None:
    """The drafter's directory (-o, else WORKDIR/drafter) is none of the files this run reads, nor inside one."""
    dest = job.output or job.work / "drafter"
    inputs = {"--model": tpath, "--init": job.init_from, "--dataset": job.data.dataset,
              "--capture-dir": job.capture.capture_dir}
    refuse_overlap(dest, inputs, writes=WRITES)
    for f in job.data.prompt_files:         # repeatable
        refuse_overlap(dest, {"--prompt-file": f}, writes=WRITES)


def connect_answers(job: TrainJob, url: str, model: str | None, say):
    """--answers-from (or the --capture server's own answers): the server checked, and its model id found, before
    the target loads."""
    from specscope.train.endpoint import Endpoint

    d, a = job.data, job.answers
    if not d.prompt_files and not d.dataset:
        raise SpecscopeError("--answers-from answers --prompt-file prompts or regenerates a --dataset's assistant "
                             "turns; --synth conversations are written by the local target, so drop --answers-from "
                             "or add one of those")
    sampled = d.answering.regenerate == "sample"
    ep = Endpoint(url, model=model, api_key=a.api_key, max_tokens=d.answering.response_tokens,
                  temperature=0.8 if sampled else 0.0, top_p=0.95 if sampled else 1.0, seed=job.train.seed,
                  concurrency=a.concurrency, timeout_s=a.timeout_s)
    ep.connect(say)
    say(f"answers from {ep.url}, which serves {ep.model!r}")
    return ep


def load_stage_target(job: TrainJob, plan: Plan, dev: torch.device) -> LoadedTarget:
    """As much of the target as the planned stages need, on `dev`."""
    if plan.runs_forward:                                    # these run the target
        model, tok, tpath = pipeline.load_target(job.target_name, dev, "fp32")
    elif "data" in job.stages:                               # --capture: its config and tokenizer only
        from types import SimpleNamespace

        from specscope.runtime.tokenizer import Tokenizer

        tpath = plan.tpath
        model, tok = SimpleNamespace(config=plan.tcfg, source_path=str(tpath)), Tokenizer(tpath)
    else:                                                    # vocab / train: its config, embedding and LM head
        (model, tpath), tok = pipeline.load_target_head(job.target_name, dev), None
    return LoadedTarget(model, tok, tpath, pipeline.target_info(job.target_name, tpath, model), dev)


def data_stage(job: TrainJob, plan: Plan, target: LoadedTarget) -> dict:
    """Capture the training data, its features from vLLM (--capture) or from the target here; the manifest's
    summary."""
    d = job.data
    if plan.cap_mode is not None:
        man = capture_data(job, plan, target)
        if "train" in job.stages and not plan.runs_forward:      # now its embedding and LM head, read alone
            target.model, _ = pipeline.load_target_head(job.target_name, target.dev)
        return {k: man.get(k) for k in ("sequences", "tokens", "loss_tokens", "skipped", "answers", "captured_by")}
    # the local target generates unless an endpoint answers everything (it still synthesises --synth)
    local_gen = plan.endpoint is None or d.answering.synth > 0
    gen = pipeline.load_target(job.target_name, target.dev, d.gen_dtype)[0] \
        if d.gen_dtype != "fp32" and local_gen else target.model
    how = replace(d.answering, seed=job.train.seed, endpoint=plan.endpoint)
    man = pipeline.data_stage(job.work, target.model, target.tok, target.info, dataset=d.dataset, how=how,
                              aux_layers=plan.aux, max_len=job.train.max_len, gen_model=gen, log=plan.log,
                              prompt_files=list(d.prompt_files), capture_batch=d.capture_batch, sources=plan.sources)
    return {k: man.get(k) for k in ("sequences", "tokens", "loss_tokens", "skipped", "answers")}


def capture_data(job: TrainJob, plan: Plan, target: LoadedTarget) -> dict:
    """The data stage with its features from vLLM (--capture): the server started here or reached at a URL, its
    own answers for --prompt-file / --regenerate unless --answers-from names another, always stopped."""
    from specscope.train.capture import CaptureSession

    d, say, endpoint = job.data, plan.log, plan.endpoint
    with CaptureSession(plan.cap_mode, plan.cap_argv, target.path, job.work, plan.aux,
                        capture_dir=job.capture.capture_dir, max_len=job.train.max_len,
                        timeout_s=job.answers.timeout_s, model=job.answers.model,
                        hidden_size=plan.tcfg.hidden_size, target_names=(job.target_name,)) as cs:
        feats = cs.open(target.tok.encode_messages([{"role": "user", "content": "Hello"}]), say)
        src = plan.sources
        needs_answers = bool(src.items) or (src.convs is not None and d.answering.regenerate != "none")
        if endpoint is None and needs_answers:
            endpoint = connect_answers(job, feats.url, feats.model, say)
            if cs.engine is not None:       # its port changes per run: its answers are cached under its launch
                endpoint.key_as = "vllm started by specscope: " + " ".join([str(target.path), *plan.cap_argv])
        how = replace(d.answering, seed=job.train.seed, endpoint=endpoint)
        return pipeline.data_stage(job.work, target.model, target.tok, target.info, aux_layers=plan.aux, how=how,
                                   features=feats, captured_by=dict(feats.info), dataset=d.dataset,
                                   max_len=job.train.max_len, log=say, prompt_files=list(d.prompt_files),
                                   capture_batch=d.capture_batch, sources=plan.sources)


def train_stage(job: TrainJob, plan: Plan, target: LoadedTarget, data) -> dict:
    """Train the drafter (--init's, or a fresh one over the vocab stage's vocabulary) and, unless the select stage
    picks a snapshot, export its last weights; the summary's train (and drafter) entries."""
    if plan.init is not None:
        drafter = plan.init
    else:
        v = torch.load(str(job.work / "vocab.pt"), weights_only=True)
        drafter = pipeline.fresh_drafter(target.model, v["d2t"], v["t2d"], plan.aux, seed=job.train.seed)
    last = train(drafter, target.model.embed_tokens.weight.detach(), target.model.lm_head.weight.detach(), data,
                 job.work / "train", job.train, target.dev, resume=job.resume, progress=job.progress, log=plan.log,
                 meta=train_meta(target.info, data), report_to=job.report_to)
    out = {"train": last}
    if plan.rank == 0 and "select" not in job.stages:
        out["drafter"] = export_drafter(job, job.work, target.info, plan.log, "drafter")
    return out


def export_drafter(job: TrainJob, source: Path, tinfo: dict, say, what: str) -> str:
    """Write the drafter (a work directory's last weights, or a chosen snapshot) to -o or WORKDIR/drafter."""
    from specscope.models.loader import DTYPES

    dest = Path(job.output) if job.output else job.work / "drafter"
    pipeline.export(source, dest, job.export_format, DTYPES[job.export_dtype], tinfo)
    say(f"{what} written to {dest} ({job.export_format}, {job.export_dtype})")
    return str(dest)


def train_meta(tinfo: dict, data) -> dict:
    """What checkpoints record: the target, and where the training answers came from (the data manifest says)."""
    meta = {"target": tinfo}
    answers = getattr(data, "manifest", {}).get("answers")
    if answers:
        meta["answers"] = answers
    return meta


def captured(work: Path, aux: list[int], dev, hidden_size: int):
    """The captured features the later stages read (in GPU memory on CUDA), checked against the drafter's aux
    layers and the target's hidden size."""
    from specscope.train.data import CapturedData

    data = CapturedData(work / "data", device=dev if dev.type == "cuda" else "cpu")
    if data.aux_layers != aux:
        raise SpecscopeError(f"the data in {work / 'data'} was captured at aux layers {data.aux_layers} but the "
                             f"drafter reads {aux}; capture again into a new --workdir")
    if data.manifest["hidden_size"] != hidden_size:
        raise SpecscopeError(f"the data in {work / 'data'} holds hidden states {data.manifest['hidden_size']} wide "
                             f"but --model's hidden size is {hidden_size}: it was captured from another model; "
                             f"capture again into a new --workdir")
    return data
