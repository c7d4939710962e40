"""Where a model folder or hub id lives, and its name in cache keys when it is a hub snapshot.

`from_pretrained` accepts a local folder or a hub id; the id resolves to a folder of the Hugging
Face cache, `.../models--<org>--<name>/snapshots/<40-hex commit>/`. Such a folder is named exactly
by `org/name@commit`, so cache keys need not read gigabytes of weights to tell two models apart.
Any other folder has no such name (the caller hashes its files).
"""

from __future__ import annotations

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
