"""Where a model folder or hub id lives, and its identity in cache keys.

`from_pretrained` accepts a local folder or a hub id; the id resolves to a folder of the Hugging
Face cache, `.../models--<org>--<name>/snapshots/<40-hex commit>/`. Such a folder is named exactly
by `org/name@commit`, so cache keys need not read gigabytes of weights to tell two models apart.
Any other folder is named by the sha256 of its files (`folder_sha256`), memoised per process on
the files' names, sizes and mtimes (`model_identity`), since real checkpoints are tens of GB.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path


def local_folder(path_or_hub_id: str | Path, allow_patterns: Sequence[str] | None = None) -> Path:
    """The resolved local folder: the path itself, or the hub id's snapshot (downloaded into the
    Hugging Face cache as `from_pretrained` would, restricted to `allow_patterns` when given)."""
    path = Path(path_or_hub_id).expanduser()
    if not path.is_dir():
        from huggingface_hub import snapshot_download

        patterns = list(allow_patterns) if allow_patterns else None
        path = Path(snapshot_download(str(path_or_hub_id), allow_patterns=patterns))
    return path.resolve()


def snapshot_identity(folder: Path) -> str | None:
    """`org/name@commit` for a Hugging Face cache snapshot folder, else None."""
    repo = folder.parent.parent.name
    if (folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name)
            and repo.startswith("models--")):
        return f"{repo[len('models--'):].replace('--', '/')}@{folder.name}"
    return None


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 hex digest of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def folder_sha256(folder: str | Path) -> str:
    """sha256 over every file under a folder (relative path + content hash), e.g. a checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    lines = [f"{p.relative_to(folder).as_posix()}\t{file_sha256(p)}"
             for p in sorted(folder.rglob("*")) if p.is_file()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def model_identity(path_or_hub_id: str | Path) -> str:
    """A content identity of a model folder or hub id, for cache keys and scorer ids:
    `org/name@commit` for a Hugging Face cache snapshot (a hub id is resolved to its snapshot
    first, downloading it as `from_pretrained` would), else `folder_sha256` of the folder."""
    path = local_folder(path_or_hub_id)
    identity = snapshot_identity(path)
    if identity:
        return identity
    files = tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in sorted(path.rglob("*")) if p.is_file())
    return _folder_sha256_memo(str(path), files)


@functools.lru_cache(maxsize=16)
def _folder_sha256_memo(folder: str, files: tuple) -> str:
    return folder_sha256(folder)
