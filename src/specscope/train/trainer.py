"""The training loop: TTT loss, AdamW with warmup + cosine decay, grad clipping, fp32/bf16 autocast, held-out eval,
atomic checkpoints (model, optimizer, scheduler, RNG) and exact resume, DDP through torchrun (gloo/NCCL).

Determinism is by construction: the batch of optimizer step s is a function of (seed, s) only, so a run resumed
from step s continues the very same curve, and N processes split each global batch into N slices.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass, asdict
from pathlib import Path
from typing import Callable

import torch

from specscope.errors import SpecscopeError
from specscope.fileio import atomic_output, write_atomic
from specscope.speculative.eagle3 import DrafterConfig, Eagle3Drafter
from specscope.train.tracking import Rate, Tracker
from specscope.train.ttt import TTTLoss, count_positions, heldout_warning, heldout_words, summarise


@dataclass
class TrainConfig:
    ttt_steps: int = 7               # K unrolled steps
    decay: float = 0.8               # step weight decay^k
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup: int = 20                 # optimizer steps
    total_steps: int | None = 1000   # None with num_epochs: as many steps as the epochs take
    num_epochs: float | None = None  # passes over the training split; with total_steps too, whichever ends first
    min_lr_ratio: float = 0.1
    batch_size: int = 8              # sequences per optimizer step (global, over all processes)
    grad_clip: float = 0.5
    dtype: str = "fp32"              # autocast dtype: fp32 | bf16
    seed: int = 0
    eval_every: int = 100
    ckpt_every: int = 100
    eval_fraction: float = 0.05
    max_len: int = 1024
    max_minutes: float | None = None   # stop (with a checkpoint) after this much training time in this call

    def to_dict(self):
        return asdict(self)

    def validate(self):
        """The library's own guard (the CLI's flag types refuse the same before anything loads): a NaN or negative
        rate reaches the optimizer as an exception or, worse, as NaN weights."""
        for name, v, lo in (("lr", self.lr, 0.0), ("grad_clip", self.grad_clip, 0.0)):
            if not (math.isfinite(v) and v > lo):
                raise SpecscopeError(f"{name} must be a finite number > 0, got {v}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise SpecscopeError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if self.max_minutes is not None and not (math.isfinite(self.max_minutes) and self.max_minutes > 0):
            raise SpecscopeError(f"max_minutes must be a finite number > 0, got {self.max_minutes}")


def divergence(step: int, what: str, value: float, cfg: TrainConfig, first: bool) -> str:
    """Why training stopped at a non-finite loss or gradient, with the likely cause. `first`: no weight update had
    happened yet in this run, so the learning rate cannot be to blame."""
    if first:
        cause = ("it happened before any weight update, so not the learning rate: the captured data or the "
                 "initial drafter (--init) hold non-finite values")
    elif cfg.lr > 1e-2:
        cause = f"the learning rate --lr {cfg.lr:g} is far too high (EAGLE-3 drafters train at 1e-4 to 1e-3)"
    else:
        cause = (f"the learning rate --lr {cfg.lr:g} is too high for this data (or --grad-clip {cfg.grad_clip:g} "
                 f"too loose); lower it")
    return (f"training diverged at step {step}: the {what} became {value}; likely cause: {cause}. No drafter was "
            f"written; train again without --resume")


# ---------------------------------------------------------------- distributed

TORCHRUN = "start the processes with torchrun (torchrun --nproc-per-node N -m specscope train ...), " \
           "or unset it for one process"


def _env_int(name: str, lo: int, hi: int | None = None, bound: str = "") -> int | None:
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        return None
    try:
        n = int(v.strip())
    except ValueError:
        raise SpecscopeError(f"{name}={v!r} is not an integer; {TORCHRUN}") from None
    if n < lo or (hi is not None and n > hi):
        span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise SpecscopeError(f"{name}={n} must be in {span}{bound}; {TORCHRUN}")
    return n


def dist_env() -> dict:
    """torchrun's variables, checked like flags (a process that reads a bad one would train alone, or hang at the
    rendezvous): RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE as integers in range, and for more than one
    process the rendezvous address torchrun sets."""
    world = _env_int("WORLD_SIZE", 1) or 1
    rank = _env_int("RANK", 0, world - 1, f" (WORLD_SIZE is {world})")
    local_world = _env_int("LOCAL_WORLD_SIZE", 1, world, f" (WORLD_SIZE is {world})") or world
    local_rank = _env_int("LOCAL_RANK", 0, local_world - 1, f" ({local_world} process(es) on this node)")
    if world > 1:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
        if missing:
            raise SpecscopeError(f"WORLD_SIZE={world} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'}"
                                 f" not set, so no other process can be found; {TORCHRUN}")
    return {"rank": rank or 0, "world": world, "local_rank": local_rank}


def dist_info() -> tuple[int, int]:
    d = dist_env()
    return d["rank"], d["world"]


def rank_device(requested: str, local_rank: int | None, cuda_count: int) -> str:
    """The device this process trains on. Under torchrun each process of a node has its own GPU, cuda:LOCAL_RANK:
    a bare "cuda" would put every rank's model on GPU 0. Pure (the caller says what it sees), so testable anywhere."""
    if requested == "cpu" or (requested == "auto" and cuda_count == 0):
        return "cpu"
    if requested not in ("auto", "cuda"):
        return requested                      # an explicit cuda:N is the user's to choose
    if cuda_count == 0:
        raise SpecscopeError("--device cuda was asked for but no CUDA device is available; use --device cpu")
    if local_rank is None:
        return "cuda"
    if not 0 <= local_rank < cuda_count:
        raise SpecscopeError(f"this is process LOCAL_RANK={local_rank} but only {cuda_count} CUDA device(s) are "
                             f"visible; start at most {cuda_count} per node (torchrun --nproc-per-node "
                             f"{cuda_count}) or make more visible (CUDA_VISIBLE_DEVICES)")
    return f"cuda:{local_rank}"


def process_device(requested: str) -> torch.device:
    """rank_device for this process (LOCAL_RANK from torchrun), made the current CUDA device (NCCL and every bare
    .cuda() then use it)."""
    dev = torch.device(rank_device(requested, dist_env()["local_rank"],
                                   torch.cuda.device_count() if torch.cuda.is_available() else 0))
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


def total_steps_for(max_steps: int | None, num_epochs: float | None, n_train: int, batch_size: int) -> int:
    """Optimizer steps of a run: --max-train-steps, the steps --num-epochs passes take (an epoch is
    n_train // batch_size steps, as batch_indices draws them), or the fewer of the two when both are given."""
    if num_epochs is None:
        return max_steps if max_steps is not None else 1000
    epoch_steps = max(1, math.ceil(num_epochs * max(1, n_train // batch_size)))
    return epoch_steps if max_steps is None else min(max_steps, epoch_steps)


def init_distributed(device: torch.device):
    import torch.distributed as dist

    rank, world = dist_info()
    if world > 1 and not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        except (RuntimeError, ValueError) as e:     # torch raises DistBackendError / DistStoreError on a timeout
            raise SpecscopeError(f"process {rank} of {world} could not join the others at "
                                 f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                                 f"({str(e).splitlines()[0][:160]}); {TORCHRUN}") from None
    return rank, world


def all_reduce_(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


# ---------------------------------------------------------------- data

def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g).tolist()
    n_eval = max(1, int(round(n * eval_fraction))) if n > 1 and eval_fraction > 0 else 0
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])


def batch_indices(train_idx: list[int], step: int, batch_size: int, seed: int) -> list[int]:
    """Global batch of optimizer step `step`: epoch e's permutation is seeded with (seed, e)."""
    per_epoch = max(1, len(train_idx) // batch_size)
    epoch, i = divmod(step, per_epoch)
    g = torch.Generator().manual_seed(seed * 100_003 + epoch + 1)
    perm = torch.randperm(len(train_idx), generator=g).tolist()
    return [train_idx[j] for j in perm[i * batch_size:(i + 1) * batch_size]]


def collate(seqs: list[dict], device, max_len: int) -> dict:
    """Pad a batch (built where the features live, then moved: no copy when they already sit on `device`)."""
    T = min(max_len, max(len(s["input_ids"]) for s in seqs))
    B = len(seqs)
    Ht = seqs[0]["aux"].shape[-1]
    H = seqs[0]["hidden"].shape[-1]
    at = seqs[0]["aux"].device
    out = {"aux": torch.zeros(B, T, 3, Ht, device=at), "hidden": torch.zeros(B, T, H, device=at),
           "input_ids": torch.zeros(B, T, dtype=torch.long, device=at),
           "argmax": torch.full((B, T), -1, dtype=torch.long, device=at),
           "valid": torch.zeros(B, T, dtype=torch.bool, device=at)}
    for i, s in enumerate(seqs):
        n = min(T, len(s["input_ids"]))
        out["aux"][i, :n] = s["aux"][:n].float()
        out["hidden"][i, :n] = s["hidden"][:n].float()
        out["input_ids"][i, :n] = s["input_ids"][:n].long()
        out["argmax"][i, :n] = s["argmax"][:n].long()
        # position p is counted when the token the target predicts there (p+1) is an assistant token
        lm = s["loss_mask"][:n].bool()
        out["valid"][i, :n - 1] = lm[1:n]
    return {k: v.to(device) for k, v in out.items()}


# ---------------------------------------------------------------- schedule / state

def lr_lambda(cfg: TrainConfig):
    def f(step):
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        prog = min(1.0, (step - cfg.warmup) / max(1, cfg.total_steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))
    return f


def rng_state() -> dict:
    import numpy as np

    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s: dict):
    import numpy as np

    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])
    np.random.set_state(s["numpy"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def save_checkpoint(ckpt_dir: Path, step: int, drafter, opt, sched, cfg: TrainConfig, meta: dict):
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "model": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
             "drafter_config": drafter.config.to_dict(), "optimizer": opt.state_dict(),
             "scheduler": sched.state_dict(), "rng": rng_state(), "train_config": cfg.to_dict(), "meta": meta}
    with atomic_output(ckpt_dir / f"ckpt-{step:07d}.pt", "checkpoint") as tmp:
        torch.save(state, tmp)
    write_atomic(ckpt_dir / "latest", f"ckpt-{step:07d}.pt", "checkpoint pointer")
    # keep the two newest: a crash while writing one never loses the previous
    for old in sorted(ckpt_dir.glob("ckpt-*.pt"))[:-2]:
        old.unlink()


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    f = ckpt_dir / "latest"
    if not f.exists():
        return None
    p = ckpt_dir / f.read_text().strip()
    return p if p.exists() else None


def load_checkpoint(path: Path) -> dict:
    try:
        return torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as e:
        raise SpecscopeError(f"cannot read checkpoint {path} ({type(e).__name__}: {e})") from None


def drafter_from_checkpoint(state: dict):
    d = Eagle3Drafter(DrafterConfig.from_dict(state["drafter_config"]))
    d.load_state_dict(state["model"])
    return d


# ---------------------------------------------------------------- the loop

@dataclass
class TrainRun:
    """What one training call works with, passed to the loop's parts: the model with its optimizer and schedule,
    the data split, this process's place among the others, where the outputs go."""
    cfg: TrainConfig
    drafter: Eagle3Drafter
    loss_mod: TTTLoss
    model: torch.nn.Module              # loss_mod, wrapped in DDP when there are several processes
    params: list
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    data: object
    train_idx: list[int]
    eval_idx: list[int]
    device: torch.device
    rank: int
    world: int
    out_dir: Path
    meta: dict
    log: Callable[[str], None] = print

    @property
    def ckpt_dir(self) -> Path:
        return self.out_dir / "checkpoints"


def evaluate(loss_mod: TTTLoss, data, idx: list[int], cfg: TrainConfig, device, batch_size: int = 8) -> dict:
    stats = []
    loss_mod.eval()
    with torch.no_grad(), _autocast(cfg, device):
        for i in range(0, len(idx), batch_size):
            b = collate([data.seqs[j] for j in idx[i:i + batch_size]], device, cfg.max_len)
            stats.append(loss_mod(b)[1])
    loss_mod.train()
    return summarise(stats, cfg.ttt_steps)


def _autocast(cfg: TrainConfig, device):
    if cfg.dtype == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    import contextlib
    return contextlib.nullcontext()


def train(drafter, embed: torch.Tensor, lm_head_w: torch.Tensor, data, out_dir: Path, cfg: TrainConfig,
          device: torch.device, resume: bool = False, progress: bool = True, log=print, stop_after: int | None = None,
          meta: dict | None = None, report_to: str = "none"):
    """Train `drafter` in place; metrics to out_dir/metrics.jsonl (and to the `report_to` tracker), checkpoints
    to out_dir/checkpoints. `stop_after`: return after that many optimizer steps of this call (tests; kill
    simulation)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    cfg.validate()
    rank, world = init_distributed(device)
    out_dir = Path(out_dir)
    torch.manual_seed(cfg.seed)
    train_idx, eval_idx = split_for_training(cfg, len(data), world)
    few = heldout_warning(len(eval_idx), len(data)) if rank == 0 else None
    if few:
        log(f"warning: {few}")
    drafter.to(device).train()
    drafter.requires_grad_(True)
    loss_mod = TTTLoss(drafter, embed.to(device), lm_head_w.to(device), cfg.ttt_steps, cfg.decay)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    step = resume_from(out_dir / "checkpoints", drafter, opt, sched, cfg, log) if resume else 0
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        trim_metrics(out_dir / "metrics.jsonl", step)
    run = TrainRun(cfg, drafter, loss_mod, DDP(loss_mod) if world > 1 else loss_mod, params, opt, sched, data,
                   train_idx, eval_idx, device, rank, world, out_dir, meta or {}, log)
    tracker = Tracker(report_to, out_dir, {**cfg.to_dict(), "world_size": world}, run_name=out_dir.parent.name) \
        if rank == 0 and report_to != "none" else None
    metrics = _MetricsLog(out_dir / "metrics.jsonl", tracker, rank == 0)
    return _loop(run, step, metrics, stop_after, progress)


def split_for_training(cfg: TrainConfig, n: int, world: int) -> tuple[list[int], list[int]]:
    """The training and held-out sequences, once the batch is known to split over the processes; settles
    cfg.total_steps (the steps --num-epochs passes take, when given)."""
    if cfg.batch_size % world:
        raise SpecscopeError(f"--batch-size {cfg.batch_size} must be a multiple of the process count {world}")
    train_idx, eval_idx = split_indices(n, cfg.eval_fraction, cfg.seed)
    if not train_idx:
        raise SpecscopeError("not enough captured sequences to train (need at least 2)")
    cfg.total_steps = total_steps_for(cfg.total_steps, cfg.num_epochs, len(train_idx), cfg.batch_size)
    return train_idx, eval_idx


def resume_from(ckpt_dir: Path, drafter, opt, sched, cfg: TrainConfig, log) -> int:
    """--resume: the latest checkpoint's weights, optimizer, schedule and RNG put back; the step to continue from
    (0 when there is none)."""
    ck = latest_checkpoint(ckpt_dir)
    if ck is None:
        log(f"--resume: no checkpoint in {ckpt_dir}; starting from step 0")
        return 0
    st = load_checkpoint(ck)
    drafter.load_state_dict(st["model"])
    opt.load_state_dict(st["optimizer"])
    sched.load_state_dict(st["scheduler"])
    set_rng_state(st["rng"])
    # a schedule fitted to --max-minutes lives in the checkpoint, not in the flags: keep it
    tc = st.get("train_config") or {}
    if tc.get("max_minutes") is not None and tc.get("total_steps", cfg.total_steps) < cfg.total_steps:
        cfg.total_steps = tc["total_steps"]
    log(f"resumed from {ck.name} at step {st['step']}")
    return st["step"]


def trim_metrics(metrics_path: Path, step: int):
    """Drop metrics logged after the checkpoint we resume from: the resumed run re-logs those steps."""
    if metrics_path.exists():
        keep = [l for l in metrics_path.read_text().split("\n") if _metric_step(l) is not None
                and _metric_step(l) <= step]
        write_atomic(metrics_path, "".join(l + "\n" for l in keep), "metrics file")


def _loop(run: TrainRun, step: int, metrics: _MetricsLog, stop_after: int | None, progress: bool):
    """Optimizer steps from `step` to the end of the schedule, the time budget or `stop_after` steps of this call,
    each logged, evaluated and checkpointed on its period; the last step's train record."""
    cfg = run.cfg
    tokens_seen = step * _avg_tokens(run.data, run.train_idx, cfg.batch_size)
    shown = _Display(progress, run.rank, cfg.total_steps, step, run.log)
    t0, done_here, last = time.time(), 0, None
    best = _best_so_far(run.ckpt_dir)
    try:
        while step < cfg.total_steps:
            loss, stats, gn, ntok = optimizer_step(run, step)
            step += 1
            done_here += 1
            if cfg.max_minutes is not None and done_here == 10 and step == 10:
                fit_schedule(cfg, time.time() - t0, step, shown, run.log)
            tokens_seen += ntok
            s = summarise([stats], cfg.ttt_steps)
            last = {"step": step, "split": "train", "loss": float(loss.detach()) * run.world,
                    "lr": run.sched.get_last_lr()[0], "grad_norm": float(gn), "tokens": tokens_seen, "acc": s["acc"],
                    "loss_k": s["loss"], "sim_tau": s["sim_tau"], "time_s": round(time.time() - t0, 2)}
            metrics.write(last)
            shown.update(step, last)
            out_of_time = _out_of_time(cfg, t0, run.world)
            if run.eval_idx and (step % cfg.eval_every == 0 or step == cfg.total_steps or out_of_time) \
                    and run.rank == 0:
                best = evaluate_and_keep(run, step, tokens_seen, best, metrics, shown)
            if step % cfg.ckpt_every == 0 or step == cfg.total_steps or out_of_time:
                if run.rank == 0:
                    save_checkpoint(run.ckpt_dir, step, run.drafter, run.opt, run.sched, cfg,
                                    {**run.meta, "tokens": tokens_seen})
            if stop_after is not None and done_here >= stop_after:
                break
            if out_of_time:
                run.log(f"--max-minutes {cfg.max_minutes} reached at step {step}/{cfg.total_steps}; "
                        f"checkpoint saved: continue with --resume")
                break
    finally:
        shown.close()
        metrics.close()
    return last


def optimizer_step(run: TrainRun, step: int):
    """One optimizer step on this process's share of global batch `step`; (loss, TTT stats, gradient norm, positions
    counted over all processes). A non-finite loss or gradient stops the run on every process."""
    cfg = run.cfg
    idx = batch_indices(run.train_idx, step, cfg.batch_size, cfg.seed)
    batch = collate([run.data.seqs[j] for j in idx[run.rank::run.world]], run.device, cfg.max_len)
    denom = count_positions(batch, run.drafter.t2d, cfg.ttt_steps).to(torch.float32)
    all_reduce_(denom)
    with _autocast(cfg, run.device):
        loss, stats = run.model(batch, denom)
    # a diverged run stops here: one more step would turn every weight into NaN, and a drafter of NaNs
    # still loads and "runs". Every rank learns of it (a rank alone in a collective would hang)
    bad = torch.tensor([0.0 if bool(torch.isfinite(loss.detach())) else 1.0])
    if float(all_reduce_(bad)) > 0:
        raise SpecscopeError(divergence(step + 1, "loss", float(loss.detach()) * run.world, cfg, first=step == 0))
    # DDP averages gradients over ranks; the per-rank loss is a share of the global sum, so scale back
    (loss * run.world).backward()
    gn = torch.nn.utils.clip_grad_norm_(run.params, cfg.grad_clip)
    if not bool(torch.isfinite(gn)):     # the same on every rank: DDP has averaged the gradients
        raise SpecscopeError(divergence(step + 1, "gradient norm", float(gn), cfg, first=step == 0))
    run.opt.step()
    run.sched.step()
    run.opt.zero_grad(set_to_none=True)
    ntok = torch.tensor([float(batch["valid"].sum())])
    all_reduce_(ntok)
    return loss, stats, gn, int(ntok)


def fit_schedule(cfg: TrainConfig, elapsed_s: float, step: int, shown: _Display, log):
    """A time budget on a fresh run: fit the cosine schedule to the steps the budget allows (measured over the first
    10), so the learning rate has decayed when time is up."""
    fit = int(10 / max(elapsed_s, 1e-6) * cfg.max_minutes * 60 * 0.9)
    if fit < cfg.total_steps:
        log(f"--max-minutes {cfg.max_minutes}: {fit} steps fit; schedule set to {fit} steps")
        cfg.total_steps = max(fit, step + 1)
        shown.set_total(cfg.total_steps)


def _out_of_time(cfg: TrainConfig, t0: float, world: int) -> bool:
    """--max-minutes spent; every rank stops at the same step (one alone in a collective would hang)."""
    out_of_time = cfg.max_minutes is not None and time.time() - t0 > cfg.max_minutes * 60
    if world > 1 and cfg.max_minutes is not None:
        flag = torch.tensor([float(out_of_time)])
        out_of_time = bool(all_reduce_(flag) > 0)
    return out_of_time


def evaluate_and_keep(run: TrainRun, step: int, tokens_seen: int, best: float, metrics: _MetricsLog,
                      shown: _Display) -> float:
    """Held-out evaluation at `step` (rank 0): logged, the weights kept as a snapshot, and as best.pt when their
    chain τ is the best yet; the best chain τ so far."""
    cfg, drafter = run.cfg, run.drafter
    ev = evaluate(run.loss_mod, run.data, run.eval_idx, cfg, run.device)
    metrics.write({"step": step, "split": "eval", "tokens": tokens_seen, "acc": ev["acc"], "loss_k": ev["loss"],
                   "sim_tau": ev["sim_tau"], "chain_tau": ev["chain_tau"], "positions": ev["positions"],
                   "conversations": len(run.eval_idx)})
    meta = {**run.meta, "tokens": tokens_seen, "eval": ev}
    # every evaluated step's weights, for checkpoint selection by real decoding (the `select` stage)
    with atomic_output(run.out_dir / "snapshots" / f"step-{step:07d}.pt", "snapshot", make_parents=True) as tmp:
        torch.save({**_weights(drafter, step), "train_config": cfg.to_dict(), "meta": meta}, tmp)
    if ev["chain_tau"] > best:
        # the best held-out checkpoint by per-position chain τ (closer to real chain decoding than SpecForge's
        # simulated τ); weights only
        best = ev["chain_tau"]
        with atomic_output(run.ckpt_dir / "best.pt", "checkpoint", make_parents=True) as tmp:
            torch.save({**_weights(drafter, step), "meta": meta}, tmp)
    shown.note(f"step {step}: {heldout_words(ev, len(run.eval_idx))}")
    return best


def _weights(drafter, step: int) -> dict:
    return {"step": step, "model": {k: v.detach().cpu() for k, v in drafter.state_dict().items()},
            "drafter_config": drafter.config.to_dict()}


def _metric_step(line: str):
    """The step of a metrics.jsonl line; None for a blank or torn one (a kill mid-write)."""
    try:
        return json.loads(line)["step"] if line.strip() else None
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def _best_so_far(ckpt_dir: Path) -> float:
    f = ckpt_dir / "best.pt"
    if not f.exists():
        return float("-inf")
    return float(load_checkpoint(f)["meta"]["eval"]["chain_tau"])


def _avg_tokens(data, idx, bs):
    if not idx:
        return 0
    return int(sum(int(data.read(i, ("loss_mask",))["loss_mask"].sum()) for i in idx) / len(idx) * bs)


class _MetricsLog:
    """metrics.jsonl, and the --report-to tracker, written by rank 0 alone."""

    def __init__(self, path: Path, tracker: Tracker | None, enabled: bool):
        self.path, self.tracker, self.enabled = path, tracker, enabled

    def write(self, rec: dict):
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if self.tracker:
                self.tracker.log(rec)

    def close(self):
        if self.tracker:
            self.tracker.close()


class _Display:
    """How rank 0 shows the run: the shared progress bar (specscope.progress: steps, rate, time left) on a terminal's
    stderr; with no live bar (--no-progress, or stderr is not a terminal: nohup, CI) a log line a minute with the
    rate and the time left instead, so an hours-long run says how it is doing. The other ranks show nothing."""

    def __init__(self, progress: bool, rank: int, total: int, start: int, log):
        import sys

        from specscope.progress import Progress

        live = progress and rank == 0 and sys.stderr.isatty()
        self.bar = Progress("train", total, "step", start=start) if live else None
        self.lines = Rate("train step", total, log, start=start, every_s=60.0) if not live and rank == 0 else None
        self.log = log

    def set_total(self, total: int):
        if self.bar:
            self.bar.set_total(total)
        if self.lines:
            self.lines.total = total

    def update(self, step: int, rec: dict):
        info = f"loss {rec['loss']:.3f} acc0 {rec['acc'][0]:.3f} τ {rec['sim_tau']:.2f}"
        if self.bar:
            self.bar.update(step, info=info)
        elif self.lines:
            self.lines(step, info=info)

    def note(self, text: str):
        if self.bar:
            self.bar.note(text)
        else:
            self.log(text)

    def close(self):
        if self.bar:
            self.bar.close()
