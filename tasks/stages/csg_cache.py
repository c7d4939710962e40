"""On-disk cache of accepted LLM CSG answers: one JSON file per (prompt, model, template version).

The key is the sha256 of the JSON array [prompt, model id, template version]; the file
`{root}/{key}.json` holds {"prompt", "model_id", "template_version", "answer"}, so a file can be
read by a person and checked against its key. Writes go to a temporary file in the same folder
and are moved into place with `os.replace`, so readers (other processes included) see either no
file or a whole one. A file that cannot be read, is not JSON, or names a different key is ignored
with a `CsgCacheWarning` (the caller then rebuilds and the next `put` rewrites it); it never raises.

The root is the caller's: the build_csgs stage passes a folder under the store root.
Implements `cast_core.csg.llm.AnswerCache`.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any

from tasks.store.files import atomic_write_bytes


class CsgCacheWarning(UserWarning):
    """A cache file was unreadable or did not match its key; it is treated as missing."""


def cache_key(prompt: str, model_id: str, template_version: str) -> str:
    triple = json.dumps([prompt, model_id, template_version], ensure_ascii=False)
    return hashlib.sha256(triple.encode("utf-8")).hexdigest()


class CsgCache:
    """JSON files under `root`, one per key; safe to share between processes."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def path(self, prompt: str, model_id: str, template_version: str) -> Path:
        return self.root / f"{cache_key(prompt, model_id, template_version)}.json"

    def get(self, prompt: str, model_id: str, template_version: str) -> dict[str, Any] | None:
        """The cached answer, or None when missing; unreadable files warn and count as missing."""
        path = self.path(prompt, model_id, template_version)
        if not path.exists():
            return None
        expected = {"prompt": prompt, "model_id": model_id, "template_version": template_version}
        try:
            entry = json.loads(path.read_text(encoding="utf-8"))
            ok = isinstance(entry, dict) and isinstance(entry.get("answer"), dict) and all(
                entry.get(k) == v for k, v in expected.items())
            reason = "it does not hold this key's answer"
        except (OSError, UnicodeDecodeError, ValueError) as err:
            ok, reason = False, f"it cannot be read as JSON ({err})"
        if not ok:
            warnings.warn(f"ignoring CSG cache file {path}: {reason}; it will be rebuilt",
                          CsgCacheWarning, stacklevel=2)
            return None
        return entry["answer"]

    def put(self, prompt: str, model_id: str, template_version: str,
            answer: dict[str, Any]) -> Path:
        """Write the entry atomically (`tasks.store.files.atomic_write`: temp file beside it, fsync,
        os.replace)."""
        path = self.path(prompt, model_id, template_version)
        entry = {"prompt": prompt, "model_id": model_id, "template_version": template_version,
                 "answer": answer}
        atomic_write_bytes(path, json.dumps(entry, ensure_ascii=False, indent=1).encode("utf-8"))
        return path
