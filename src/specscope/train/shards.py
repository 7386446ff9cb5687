"""The data stage's files in WORKDIR/data (manifest.json and the safetensors shards it lists), read through one
validating reader: a damaged manifest or shard is one line naming the file and what to do, never a traceback, and a
shard the manifest lists but that is not whole is never taken as captured."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from specscope.errors import SpecscopeError
from specscope.models.loader import SafetensorsReader

SHARD_NAME = re.compile(r"shard-[0-9]{5,}\.safetensors")
COUNTS = ("conversations", "sequences", "tokens", "loss_tokens")


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _manifest_problem(m) -> str | None:
    """What is wrong with a manifest's structure (None: nothing)."""
    if not isinstance(m, dict):
        return "not a JSON object"
    aux = m.get("aux_layers")
    if not isinstance(aux, list) or not aux or not all(_count(i) for i in aux):
        return f"aux_layers is {aux!r}, not a list of layer indices"
    for k in ("hidden_size", "shard_size"):
        if not _count(m.get(k)) or not m.get(k):
            return f"{k} is {m.get(k)!r}, not a positive integer"
    if not _count(m.get("skipped", 0)):
        return f"skipped is {m.get('skipped')!r}"
    shards = m.get("shards")
    if not isinstance(shards, list):
        return f"shards is {shards!r}, not a list"
    for s in shards:
        if not isinstance(s, dict) or not _count(s.get("index")) or not all(_count(s.get(k, 0)) for k in COUNTS):
            return f"a shard entry is {s!r}"
        if s.get("file") is not None and not (isinstance(s["file"], str) and SHARD_NAME.fullmatch(s["file"])):
            return f"shard {s['index']} names the file {s.get('file')!r}"
    return None


def read_manifest(mpath: Path) -> dict | None:
    """The manifest at `mpath`, checked; None when there is none."""
    mpath = Path(mpath)
    if not mpath.exists():
        return None
    try:
        m = json.loads(mpath.read_bytes())
        why = _manifest_problem(m)
    except (OSError, ValueError, RecursionError) as e:
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:120]}"
    if why is not None:
        raise SpecscopeError(f"{mpath} is damaged ({why}); delete {mpath.parent} and rerun the data stage "
                             f"(--stages data) to capture again")
    return m


def _shard_problem(r: SafetensorsReader, entry: dict, manifest: dict) -> str | None:
    want = {"offsets": (entry.get("sequences", 0) + 1,)}
    T, k, H = entry.get("tokens", 0), len(manifest["aux_layers"]), manifest["hidden_size"]
    want.update(aux=(T, k, H), hidden=(T, H), argmax=(T,), input_ids=(T,), loss_mask=(T,))
    for name, shape in want.items():
        if name not in r:
            return f"no {name} tensor"
        if tuple(r.shape(name)) != shape:
            return f"{name} is {list(r.shape(name))}, the manifest says {list(shape)}"
        _, dtype, _, lo, hi = r.entries[name]
        if math.prod(shape) * dtype.itemsize != hi - lo:
            return f"{name}'s bytes do not match its shape"
    off = r.read("offsets").tolist()
    if off[0] != 0 or off[-1] != T or any(b < a for a, b in zip(off, off[1:])):
        return "its sequence offsets do not span its tokens"
    return None


def open_shard(data_dir: Path, entry: dict, manifest: dict) -> SafetensorsReader:
    """The shard `entry` of `manifest` names, its tensors checked against the entry and the manifest (shapes,
    hidden size, aux layers, offsets)."""
    path = Path(data_dir) / entry["file"]
    try:
        r = SafetensorsReader([path])
        why = _shard_problem(r, entry, manifest)
    except SpecscopeError:
        why = "not a whole safetensors file"
    if why is not None:
        raise SpecscopeError(f"captured data shard {path} is damaged ({why}); delete it and rerun the data stage "
                             f"(--stages data), which captures a shard missing from {Path(data_dir)} again")
    return r


def shard_whole(data_dir: Path, entry: dict, manifest: dict) -> bool:
    """Whether the shard `entry` lists is on disk and whole (an empty shard has no file): the data stage captures
    it again otherwise."""
    if not entry.get("file"):
        return True
    try:
        open_shard(data_dir, entry, manifest)
    except SpecscopeError:
        return False
    return True
