"""Where a model's weights come from: a local folder or a Hugging Face hub id, told apart before a
loader runs.

`from_pretrained` takes either. Given a folder that does not exist, Hugging Face reads the string as
a hub id and answers with its repo-id rules ("Repo id must be in the form 'repo_name' or
'namespace/repo_name'"), which says nothing about the folder. `source_problem` answers first, in
one line: the folder does not exist (with the nearest existing name when there is one), and whether
the string could be a hub id at all (`org/name` or a legacy `name`: at most one slash, no leading
`.`, `/` or `~`). A
string that could be a hub id is let through (the hub decides), except under `HF_HUB_OFFLINE=1`
when it is not in the local Hugging Face cache.

No torch import: the flows call this before the slow imports.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class ModelSourceError(FileNotFoundError):
    """A model folder that does not exist (and is no usable hub id); the message says which."""


def could_be_hub_id(text: str) -> bool:
    """True for strings of the hub's `org/name` (or legacy `name`) form."""
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text and not text.endswith((".", "-"))


def nearest_name(path: Path) -> Path | None:
    """The existing path closest to a missing absolute `path`: under its deepest existing parent,
    the closest name to the first missing part (with the rest of `path` appended when that
    exists too); None when no name is close."""
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    first, *rest = path.relative_to(parent).parts
    names = [p.name for p in parent.iterdir() if not p.name.startswith(".")]
    close = difflib.get_close_matches(first, names, n=1, cutoff=0.6)
    if not close:
        return None
    whole = parent.joinpath(close[0], *rest)
    return whole if whole.exists() else parent / close[0]


def _in_hub_cache(hub_id: str) -> bool:
    from huggingface_hub.constants import HF_HUB_CACHE

    snapshots = Path(HF_HUB_CACHE) / f"models--{hub_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.iterdir())


def source_problem(path_or_hub_id: str, field: str, marker: str | None = None,
                   hub_allowed: bool = True) -> str | None:
    """None when `path_or_hub_id` is a usable folder (holding the file `marker`, when given) or a
    possible hub id (`hub_allowed`); else one line that names `field`, what is wrong and the fix."""
    text = str(path_or_hub_id)
    path = Path(text).expanduser()
    shown = f"{field} = {text!r}"
    if path.is_dir():
        if marker and not (path / marker).is_file():
            return f"{shown}: the folder {path} has no {marker}; point {field} at a model folder"
        return None
    if path.exists():
        return f"{shown}: {path} is a file, not a model folder; point {field} at the folder"
    hub = hub_allowed and could_be_hub_id(text)
    local_first = Path(text).parts[0] if Path(text).parts else text
    if hub and not Path(local_first).is_dir():
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        if not offline or _in_hub_cache(text):
            return None
        return (f"{shown}: no local folder of that name, and as a Hugging Face hub id it is not "
                f"in the local cache while HF_HUB_OFFLINE=1; download it (huggingface-cli "
                f"download {text}) or point {field} at a local folder")
    near = nearest_name(path.absolute())
    hint = f" (did you mean {os.path.relpath(near)}?)" if near else ""
    if not hub_allowed:
        why = "and this model family loads only local folders"
    elif could_be_hub_id(text):
        why = f"and a local folder {local_first}/ exists, so it reads as a path, not a hub id"
    else:
        why = "and it is not a Hugging Face hub id either (those look like 'org/name')"
    return f"{shown}: no such folder {path.absolute()}{hint}, {why}; fix {field}"


def require_source(path_or_hub_id: str, field: str, marker: str | None = None,
                   hub_allowed: bool = True) -> None:
    """Raise ModelSourceError with `source_problem`'s line when there is a problem."""
    problem = source_problem(path_or_hub_id, field, marker, hub_allowed)
    if problem:
        raise ModelSourceError(problem)
