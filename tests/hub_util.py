"""A Hugging Face hub cache written on disk exactly as huggingface_hub lays it out (no network):

    HF_HUB_CACHE/models--ORG--NAME/blobs/<git sha1, or sha256 for LFS files>
                                  /snapshots/<commit>/<file>  -> ../../blobs/<id>  (relative symlinks)
                                  /refs/<revision>            the commit hash, no newline
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".parquet")


def write_hub_repo(cache: Path, repo_id: str, files: dict[str, bytes | Path], revision: str = "main",
                   repo_type: str = "model") -> Path:
    """Store `files` (repo path -> content, or a local file to copy) as one commit of `repo_id` and point
    refs/`revision` at it. Returns the snapshot directory."""
    org, name = repo_id.split("/")
    repo = Path(cache) / f"{repo_type}s--{org}--{name}"
    data = {k: (v.read_bytes() if isinstance(v, Path) else v) for k, v in files.items()}
    commit = hashlib.sha1(b"".join(k.encode() + hashlib.sha1(v).digest() for k, v in sorted(data.items())) +
                          revision.encode()).hexdigest()
    snap = repo / "snapshots" / commit
    for rel, content in data.items():
        if rel.endswith(LFS_SUFFIXES):
            blob_id = hashlib.sha256(content).hexdigest()                    # LFS: the file's sha256
        else:
            blob_id = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()   # git blob id
        blob = repo / "blobs" / blob_id
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        os.symlink(os.path.relpath(blob, link.parent), link)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snap


def dir_files(d: Path) -> dict[str, Path]:
    return {str(f.relative_to(d)): f for f in Path(d).rglob("*") if f.is_file()}
