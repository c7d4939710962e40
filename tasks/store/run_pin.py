"""A run is pinned to its recipe: the fields that change results are recorded with the run the
first time one of its stages runs, and a later iteration under the same run id with different
values in those fields is refused.

What is pinned is `Recipe.pinned()`: every section but `eval` (evaluations are keyed by their own
spec hash), without each section's `unpinned` fields (threads, devices, caches, timeouts, the
scorer's URL, memory-only batch sizes: where and how fast, not what) and without fields added
later (`hash_if_set`) while they hold their default. The `runs` table keeps one row per run: the
hash and JSON of the pinned fields and the whole recipe as it was. The row is written exclusively
(a link, not a rename), so two processes starting one run at once agree on one pin.

Stores from before pinning have no row for their runs: the first stage that touches such a run
records the recipe it is given, since the recipes of earlier iterations were never stored and
cannot be checked after the fact.

The recipe is typed by what the pin reads of it (`PinnedRecipe`; the recipe type itself is
`tasks.stages.recipe.Recipe`), so the store imports nothing from the stages.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from tasks.store.parts import parquet_readable
from tasks.store.stage import code_version
from tasks.store.store import Store

TABLE = "runs"


class _Run(Protocol):
    @property
    def name(self) -> str: ...


class PinnedRecipe(Protocol):
    """What the pin reads of a recipe (`tasks.stages.recipe.Recipe` has it)."""

    @property
    def run(self) -> _Run: ...

    def pinned(self) -> dict[str, dict[str, Any]]: ...

    def pinned_hash(self) -> str: ...

    def canonical_json(self) -> str: ...


class RecipeMismatch(RuntimeError):
    """A recipe differs from its run's pinned recipe in fields that change results."""


@dataclass(frozen=True)
class RunPin:
    """The recipe a run is pinned to: `pinned` is `Recipe.pinned()` as JSON values; `created`
    says whether this call recorded it."""

    run_id: str
    recipe_hash: str
    pinned: dict[str, dict[str, Any]]
    pinned_at: datetime
    created: bool


def pin_recipe(store: Store, recipe: PinnedRecipe) -> RunPin:
    """The run's pin: recorded from `recipe` if the run has none, else checked against it;
    raises RecipeMismatch naming each differing field and how to start a new run."""
    if read_pin(store, recipe.run.name) is None:
        row = {"run_id": recipe.run.name, "recipe_hash": recipe.pinned_hash(),
               "pinned_json": json.dumps(recipe.pinned(), sort_keys=True),
               "recipe_json": recipe.canonical_json(), "code_version": code_version(),
               "pinned_at": datetime.now(UTC)}
        try:
            store.write_table(TABLE, [row], recipe.run.name, exclusive=True)
            return RunPin(row["run_id"], row["recipe_hash"], recipe.pinned(), row["pinned_at"],
                          created=True)
        except FileExistsError:
            pass  # another process pinned this run first: check against its pin
    return check_pin(store, recipe)


def check_pin(store: Store, recipe: PinnedRecipe) -> RunPin | None:
    """The run's pin if it holds for `recipe` (None: not pinned yet); RecipeMismatch if not.
    Writes nothing: for a check before a flow starts."""
    pin = read_pin(store, recipe.run.name)
    differences = pinned_differences(pin.pinned, recipe.pinned()) if pin else []
    if differences:
        raise RecipeMismatch(_mismatch_message(store, pin, differences))
    return pin


def read_pin(store: Store, run_id: str) -> RunPin | None:
    """The run's recorded pin, or None; a pin file that does not read raises, naming it."""
    path = store.root / "tables" / TABLE / f"{run_id}.parquet"
    if not path.exists():
        return None
    if not parquet_readable(path):
        raise RecipeMismatch(
            f"{path}: the recipe pin of run {run_id!r} is damaged (not a readable Parquet file); "
            f"restore it from a backup, or delete it to pin the run to the recipe of its next "
            f"iteration (nothing then checks that the earlier iterations used the same one)")
    row = store.read_table(TABLE, {"run_id": run_id}).to_pylist()[0]
    return RunPin(row["run_id"], row["recipe_hash"], json.loads(row["pinned_json"]),
                  row["pinned_at"], created=False)


def pinned_differences(old: dict[str, dict[str, Any]],
                       new: dict[str, dict[str, Any]]) -> list[tuple[str, Any, Any]]:
    """[(section.field, pinned value, given value)] for each field that differs (a field only
    one side has shows `None` on the other side), sorted by name."""
    out = []
    for section in sorted(old.keys() | new.keys()):
        a, b = old.get(section, {}), new.get(section, {})
        out += [(f"{section}.{f}", a.get(f), b.get(f)) for f in sorted(a.keys() | b.keys())
                if a.get(f) != b.get(f)]
    return out


def _mismatch_message(store: Store, pin: RunPin, differences: list[tuple[str, Any, Any]]) -> str:
    fields = "\n".join(f"  {name}: {json.dumps(was)} (pinned) -> {json.dumps(now)} (this recipe)"
                       for name, was, now in differences)
    restore = (f"restore {differences[0][0]}" if len(differences) == 1 else
               "restore the fields listed")
    return (f"run {pin.run_id!r} in {store.root} is pinned to the recipe it started with "
            f"(pinned {pin.pinned_at:%Y-%m-%d %H:%M} UTC, hash {pin.recipe_hash[:16]}); this "
            f"recipe differs in fields that change results:\n{fields}\n"
            f"Continuing would mix two experiments under one run id. Start a new run instead: "
            f"give it a new name (--set run.name='\"{pin.run_id}-2\"' on the command line, or "
            f"[run] name in the recipe), or {restore}. Threads, "
            f"devices, caches, timeouts and memory-only batch sizes may change freely.")
