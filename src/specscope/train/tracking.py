"""What a training run reports as it goes: `Rate` progress lines (done/total, rate, time left) for every stage, and
the optional experiment trackers of `specscope train --report-to`: TensorBoard or Weights & Biases, each imported
only when asked for. Every metrics.jsonl record is also logged there, as `train/loss`, `eval/acc_0`, ..."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

from specscope.errors import SpecscopeError

TRACKERS = ("none", "tensorboard", "wandb")
_PACKAGE = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_tracker(kind: str) -> None:
    """Refuse a tracker whose library is not installed (before any model loads, not after hours of data work)."""
    if kind not in TRACKERS:
        raise SpecscopeError(f"--report-to takes {', '.join(TRACKERS)}; got {kind!r}")
    pkg = _PACKAGE.get(kind)
    if pkg and importlib.util.find_spec(pkg) is None:
        raise SpecscopeError(f"--report-to {kind} needs the {pkg} package, which is not installed; run: pip install "
                             f"{pkg} (or use --report-to none)")


def scalars(rec: dict) -> dict[str, float]:
    """One metrics record -> flat scalar names under its split (lists become name_0, name_1, ...)."""
    split = rec.get("split", "train")
    out = {}
    for k, v in rec.items():
        if k in ("step", "split") or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[f"{split}/{k}"] = float(v)
        elif isinstance(v, list):
            for i, x in enumerate(v):
                if isinstance(x, (int, float)) and not isinstance(x, bool):
                    out[f"{split}/{k}_{i}"] = float(x)
    return out


class Tracker:
    """log(rec) after each metrics record; close() at the end. Only rank 0 makes one."""

    def __init__(self, kind: str, out_dir: Path, config: dict, run_name: str | None = None):
        check_tracker(kind)
        self.kind, self.run = kind, None
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.run = SummaryWriter(log_dir=str(Path(out_dir) / "tensorboard"))
            self.run.add_text("config", "\n".join(f"    {k}: {v}" for k, v in sorted(config.items())))
        elif kind == "wandb":
            import wandb

            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "specscope"), name=run_name,
                                  dir=str(out_dir), config=config, resume="allow")

    def log(self, rec: dict) -> None:
        if self.run is None:
            return
        vals = scalars(rec)
        if self.kind == "tensorboard":
            for k, v in vals.items():
                self.run.add_scalar(k, v, rec["step"])
        else:
            self.run.log(vals, step=rec["step"])

    def close(self) -> None:
        if self.run is not None:
            (self.run.close if self.kind == "tensorboard" else self.run.finish)()
            self.run = None


class Rate:
    """Progress lines with the measured rate and the time left ("answered 512/7900 (41.2/s, 3:00 left)").

    The rate counts only work done in this run: `start` is what was already done when it began (a resumed run),
    or, left None, the first call's count, which callers report before doing any work."""

    def __init__(self, what: str, total: int, log, start: int | None = None, every_s: float = 10.0):
        self.what, self.total, self.log, self.every = what, total, log, every_s
        self.t0 = self.last = time.monotonic()
        self.start = start

    def __call__(self, n: int, force: bool = False, info: str = ""):
        now = time.monotonic()
        if self.start is None:
            self.start, self.t0, self.last = n, now, now
            if n:
                self.log(f"{self.what} {n}/{self.total} already done (resumed)")
            return
        if not force and now - self.last < self.every and n < self.total:
            return
        self.last = now
        from specscope.progress import left_text, rate_text     # the wording every command's progress uses

        elapsed = max(now - self.t0, 1e-9)
        words = [x for x in (rate_text(n - self.start, elapsed, ""),
                             left_text(n - self.start, self.total - self.start, elapsed)) if x]
        self.log(f"{self.what} {n}/{self.total} ({', '.join(words)}){' ' + info if info else ''}")
