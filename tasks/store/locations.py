"""Where the store is when a command does not say: light to import (no Prefect, no torch), so the
command lines can check it before the slow imports."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_STORE = "runs/store"


def store_root(store: str | None) -> Path:
    """The store root: the argument, else $CAST_STORE, else runs/store (relative to the cwd)."""
    return Path(store or os.environ.get("CAST_STORE") or DEFAULT_STORE)
