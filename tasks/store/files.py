"""How every file of a store is written: it appears under its final name only when complete. It is
written to a temporary name in the same directory (a dot-name that no glob matches), fsynced, then
`os.replace`d, so a crash leaves the old file or the new one, never half of one. A writer killed
outright (SIGKILL, a lost machine) cannot remove its temp file; `cast gc` deletes such orphans
once they are old (`tasks.store.gc`, names matching `TEMP_NAME`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

TEMP_NAME = re.compile(r"^\..+\.\d+-[0-9a-f]{12}\.tmp$")  # what `atomic_write` names its temp file


def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> str:
    """Write `data` to `final` atomically (see `atomic_write`); -> sha256 of the bytes."""
    return atomic_write(Path(final), lambda tmp: Path(tmp).write_bytes(data))


def atomic_write(final: Path, write: Callable[[str], None], *, exclusive: bool = False) -> str:
    """Write via `write(tmp_path)` into a temp file beside `final`, fsync, rename; -> sha256.
    `exclusive`: link instead of rename, so an existing `final` raises FileExistsError and
    stays as it was (the temp file is removed either way)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(final.parent / f".{final.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
    try:
        open(tmp, "xb").close()  # unlike mkstemp, honours the umask (readable by the group)
        write(tmp)
        digest = fsync_and_hash(Path(tmp))
        if exclusive:
            os.link(tmp, final)
            remove_files(Path(tmp))
        else:
            os.replace(tmp, final)
    except BaseException:
        remove_files(Path(tmp))
        raise
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return digest


def fsync_and_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
        os.fsync(f.fileno())
    return digest.hexdigest()


def remove_files(*paths: Path) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
