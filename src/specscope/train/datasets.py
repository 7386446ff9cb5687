"""`train --dataset` as users hold their data: a JSONL file (read here, line by line, with line numbers in every
complaint; any file not named .json / .parquet / .arrow), or through Hugging Face `datasets` a JSON / Parquet
file, a directory of them (its splits by file name), a `save_to_disk` directory, or a hub dataset id
(`org/name[@revision]`, with `--dataset-config` and `--dataset-split`). Records are ShareGPT (`conversations`:
from/value), OpenAI (`messages`: role/content) or SpecForge (`conversations`: role/content)."""

from __future__ import annotations

from pathlib import Path

from specscope.errors import SpecscopeError, require_file
from specscope.models.hub import parse_hub_id
from specscope.train.data import ReadReport, check_read, read_conversations, take_conversation
from specscope.train.sources import normalise

BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def check_dataset(spec: str) -> None:
    """What can be refused before any model loads: a path that is neither a readable file nor a directory, or a
    name that is neither a path nor a hub id."""
    p = Path(spec).expanduser()
    if p.is_dir():
        return
    if p.exists() or not parse_hub_id(spec):
        require_file(p, "--dataset")        # missing, a device, unreadable: one line naming which


def check_dataset_options(spec: str | None, split: str | None = "train", config: str | None = None) -> None:
    """--dataset-split and --dataset-config choose part of a dataset directory or a hub dataset; anywhere else they
    would be silently ignored, so they are refused (before any model loads)."""
    flag = f"--dataset-split {split!r}" if split not in (None, "train") else \
        f"--dataset-config {config!r}" if config is not None else None
    if flag is None:
        return
    if not spec:
        raise SpecscopeError(f"{flag} chooses part of a --dataset, and none is given: drop {flag.split()[0]}")
    p = Path(spec).expanduser()
    if p.is_file():
        raise SpecscopeError(f"{flag} applies to a dataset directory or a Hugging Face dataset id; --dataset "
                             f"{spec!r} is one file, read whole: drop {flag.split()[0]}")
    if config is not None and p.is_dir() and _saved(p):
        raise SpecscopeError(f"--dataset-config {config!r} applies to a Hugging Face dataset id; --dataset {spec!r} is "
                             f"a save_to_disk directory, which has no configurations: drop --dataset-config")


def _saved(p: Path) -> bool:
    return (p / "state.json").exists() or (p / "dataset_dict.json").exists()


def load_conversations(spec: str, split: str = "train", config: str | None = None, streaming: bool = False):
    """-> (conversations [[{"role", "content"}]], ReadReport). Malformed records are counted and skipped, as in a
    JSONL file; a dataset with none usable is an error. Local files and directories are always read as a stream
    (no Arrow copy in the datasets cache); a hub dataset is downloaded into the cache unless `streaming`."""
    check_dataset(spec)
    check_dataset_options(spec, split, config)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix not in BUILDERS:
        return read_conversations(p)         # JSONL, whatever the file is called (as before datasets)
    if p.is_file():
        ds = _load(spec, BUILDERS[p.suffix], data_files=str(p), split="train", streaming=True)
    elif p.is_dir() and _saved(p):
        ds = _from_disk(p, split)
    elif p.is_dir():
        ds = _load(spec, str(p), name=config, split=split, streaming=True)
    else:
        repo, rev = parse_hub_id(spec)
        ds = _load(spec, repo, name=config, split=split, revision=rev, streaming=streaming)
    return read_records(ds, f"{spec} ({split})" if not p.is_file() else spec)


def read_records(rows, where: str):
    """Records (dicts) of a `datasets` dataset -> conversations, with the JSONL reader's rules and report."""
    rep, convs = ReadReport(unit="record"), []
    for i, row in enumerate(_rows(rows, where), 1):
        rep.lines += 1
        take_conversation(rep, convs, i, lambda: normalise(_drop_nulls(row)))
    check_read(rep, where)
    return convs, rep


def _drop_nulls(row):
    """Arrow gives every record every column (and every turn every field) of the whole file, absent ones as None:
    a ShareGPT record beside OpenAI ones would carry "messages": None. Drop those before reading the shape."""
    if isinstance(row, dict):
        return {k: _drop_nulls(v) for k, v in row.items() if v is not None}
    if isinstance(row, list):
        return [_drop_nulls(v) for v in row]
    return row


def _quiet():
    import datasets     # Hugging Face datasets: slow to import, needed only for non-JSONL data

    datasets.disable_progress_bars()
    # its loaders log an error line and then raise (a corrupt Parquet file: "Failed to read schema ..."); the
    # exception becomes our one `error:` line, so its own log line would be a second
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


def _load(spec: str, path: str, **kw):
    datasets = _quiet()
    try:
        return datasets.load_dataset(path, **kw)
    except Exception as e:      # datasets raises many kinds (not found, offline, bad split, bad file): one line each
        raise SpecscopeError(f"cannot load --dataset {spec!r} with Hugging Face datasets: {_first_line(e)}") from None


def _from_disk(p: Path, split: str):
    datasets = _quiet()
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise SpecscopeError(f"cannot load --dataset {str(p)!r} (a save_to_disk directory): {_first_line(e)}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise SpecscopeError(f"--dataset {str(p)!r} has no split {split!r}; it has {', '.join(ds)} "
                                 f"(--dataset-split)")
        ds = ds[split]
    elif split != "train":      # one saved Dataset: no splits to choose from
        raise SpecscopeError(f"--dataset {str(p)!r} is one saved dataset with no splits; drop --dataset-split")
    return ds


def _rows(rows, where: str):
    """Iterate, turning a read error in the middle of a stream (a bad line in a JSON file) into one line."""
    it = iter(rows)
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as e:
            raise SpecscopeError(f"cannot read --dataset {where}: {_first_line(e)}") from None
        yield row


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
