"""Every table's Arrow schema, declared once, with a version number per table.

The store (`tasks/store/store.py`) checks each write against these declarations and writes every
Parquet file with exactly the declared schema, so the DuckDB views over a table's files agree on
column types; the catalog's views are generated from the same declarations (`duckdb_type`).

Conventions:
- Ids are strings; a prompt's id is `prompt_id(text)`, the first 16 hex digits of the sha256 of
  its text. Counters (iteration, step, sample_index, atom_index, ...) are integers.
- Hashes are sha256 hex digests; paths are POSIX paths relative to the store root.
- Timestamps are UTC, microseconds. List columns name their item field "element", as Parquet does,
  so a file read back has a schema equal to the declared one (metadata included).
- A column is non-nullable unless marked `_NULL`. Bump a table's version whenever its columns
  change.
- `windows` names its bounds `window_start` / `window_end` (as `rollouts` does): `end` is an SQL
  keyword and would need quoting in every query.

Integrity (issue 19):
- `stages` version 2 adds `path_hashes`: the sha256 of each output in `paths` order, so a damaged
  file can be named (null in version 1 files: only the combined `content_hash` is known there).
- `stage_failures`: a stage that refused to record completion (`tasks.store.stage.StageRefused`:
  empty output, non-finite weights) leaves a row saying why; a retry with the same key overwrites
  it.
- `runs`: one row per run, the recipe it is pinned to (`Recipe.pinned`, `tasks.store.run_pin`).
- `collected_blobs`: blobs `cast gc` deleted (`tasks.store.gc`); a record naming one stays valid.

Diagnostics (version 2 of train_steps, checkpoints, evals; `cast_core/diagnostics.py` defines
them):
- `train_steps.ratio_mean_per_step` / `clip_fraction_per_step`: K values in window-step order,
  each over the step's samples and positions (null when the step was skipped).
- `train_steps.reward_step_weights_json` (version 3): with `recast.weighting` "static" or
  "recast", {atom type: [weight at each window step]} the loss applied to that type's share of
  the map (null with "none"); with `train.objective = "nft"` the steps are the schedule's that
  the forward-noise draws reach, and the key "step_times" gives their times.
- `train_steps` version 4: a row is one optimizer step (gradients accumulated over micro-batches;
  `samples` says how many samples it used) and `lr` the lr it ran with (warm-up included).
  KLs: `policy_kl_nats` = KL(rollout policy || policy being trained) per sample and window step
  in nats, summed over all C h w latent dims (k3 of the summed log-ratio; `policy_kl_k1_nats`
  the plain mean of -log ratio, a cross-check); `ref_kl_nats` the exact KL to the reference model
  per sample and window step summed over dims, `ref_kl_mean_dim` = ref_kl_nats / (C h w), the
  term the loss weights by kl_beta (both null with kl_beta = 0); `ratio_k3` = k3 of the loss's
  own ratio (per position, or all-dims mean for Flow-GRPO), not a KL per sample. Version 3 named
  `ratio_k3` `approx_kl` and `ref_kl_mean_dim` `kl`, and a row was one micro-batch: the store
  reads such files with nulls in the renamed and new columns; the DuckDB views (union_by_name)
  show the old columns as well, null for newer files.
- `train_steps` version 5 adds `objective` ("sde" or "nft"; null in older files, which are all
  "sde"), and for "nft" steps `positive_share` (share of samples, or positions with a map, whose
  optimality r > 1/2) and `nft_loss_by_t_json` ({"t_bins": [[lo, hi], ...], "loss": [mean
  per-sample loss of each bin or null]}); an "nft" step leaves the ratio, clip and KL columns
  null (it has no likelihoods) and `adv_mass` is the mean |advantage| of its samples.
- `checkpoints` is the one row per iteration, so it carries the iteration's diagnostics:
  `param_change_norm` = ||theta_after - theta_before||_2 of the LoRA parameters over the
  iteration's training; `update_kl_nats` (version 3; null in older files) = KL(rollout policy ||
  trained policy) per sample and window step in nats, summed over the C h w dims (k3 of the
  summed log-ratio, replayed after the last optimizer step on up to 64 of the iteration's
  samples): how far the whole iteration moved the policy; `rollout_hf_energy` = mean high-frequency energy of the iteration's
  rollout images; `constant_reward_alarm` and `alarm_reason` (null without an alarm): every group
  of some atom type had zero variance, or all scalar rewards were equal. `lr` (version 4; null
  in older files) is the lr the iteration's training ran at before the warm-up's factor:
  `train.lr`, or with `train.kl_target_nats` the KL-targeted lr, which the next iteration's lr
  is computed from. Version 5 adds `update_kl_per_step` (the same KL at each window step, K
  values in window order whose mean is `update_kl_nats`; null in older files and for the ODE)
  and `step_weights` (the loss weight of each window step the iteration trained with, under
  `train.kl_target_per_step`; null otherwise: every step 1). Version 6 adds the change of the
  velocity that KL implies, as an RMS per action dim (latent dim; tile-mean dim with block
  noise): `update_velocity_rms` over the window and `update_velocity_per_step` (null in older
  files and for the ODE). A later window step has a smaller noise std, so the same velocity change
  moves it by more nats; the velocity reads alike across steps, windows and noise levels.
- `evals.group_kind` is "overall" (group_name "all"), "tag", "atom_type" (images: those with at
  least one atom of the type; strict_accuracy = atom_accuracy there) or "atom_count" (group_name
  the number of atoms of the prompt); `hf_energy` is the group's mean image high-frequency energy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

STR, I32, I64 = pa.string(), pa.int32(), pa.int64()
F32, F64, BOOL = pa.float32(), pa.float64(), pa.bool_()
UTC_TIME = pa.timestamp("us", tz="UTC")
_NULL = True


def _list(item: pa.DataType) -> pa.DataType:
    return pa.list_(pa.field("element", item))


@dataclass(frozen=True)
class TableSpec:
    """One table: its name, schema version, one-line description and Arrow schema."""

    name: str
    version: int
    doc: str
    schema: pa.Schema


class SchemaError(ValueError):
    """Rows or an Arrow table do not match a table's declared schema."""


def _table(name: str, version: int, doc: str, *columns: tuple) -> TableSpec:
    fields = [pa.field(c[0], c[1], nullable=len(c) > 2 and c[2]) for c in columns]
    metadata = {"cast.table": name, "cast.version": str(version)}
    return TableSpec(name, version, doc, pa.schema(fields, metadata=metadata))


_KEYS = (("run_id", STR), ("iteration", I32), ("prompt_id", STR), ("sample_index", I32))

_SPECS = (
    _table("stages", 2, "Stage completion rows, written last by each stage; the truth for resume.",
           ("run_id", STR), ("iteration", I32), ("stage", STR), ("cache_key", STR), ("rows", I64),
           ("content_hash", STR), ("paths", _list(STR)), ("code_version", STR),
           ("started_at", UTC_TIME), ("finished_at", UTC_TIME),
           ("path_hashes", _list(STR), _NULL)),
    _table("stage_failures", 1,
           "A stage that refused to record its output (invalid or non-finite): why, and figures.",
           ("run_id", STR), ("iteration", I32), ("stage", STR), ("cache_key", STR),
           ("reason", STR), ("details_json", STR, _NULL), ("code_version", STR),
           ("failed_at", UTC_TIME)),
    _table("collected_blobs", 1,
           "Bulky blobs `cast gc` deleted (window tensors, advantage maps, optimizer states of old "
           "iterations): the stage records naming them stay valid and `cast verify` says "
           "'collected'.",
           ("path", STR), ("sha256", STR), ("bytes", I64), ("run_id", STR), ("iteration", I32),
           ("kind", STR), ("collected_at", UTC_TIME)),
    _table("runs", 1,
           "The recipe a run is pinned to (written by its first stage): the hash and JSON of the "
           "fields that change results, and the whole recipe as it was.",
           ("run_id", STR), ("recipe_hash", STR), ("pinned_json", STR), ("recipe_json", STR),
           ("code_version", STR), ("pinned_at", UTC_TIME)),
    _table("csgs", 1, "One causal scene graph per prompt, as JSON, with the builder that made it.",
           ("run_id", STR), ("prompt_id", STR), ("prompt", STR), ("tag", STR, _NULL),
           ("split", STR), ("builder", STR), ("graph_json", STR), ("num_atoms", I32)),
    _table("atoms", 1, "One row per verifiable atom of a prompt's scene graph.",
           ("run_id", STR), ("prompt_id", STR), ("atom_id", STR), ("atom_index", I32),
           ("type", STR), ("question", STR), ("answer", STR), ("parents", _list(STR)),
           ("subject", STR), ("object", STR, _NULL), ("value", STR, _NULL)),
    _table("calibration_curves", 1,
           "Mean/std cosine similarity of each step's Tweedie x0 to the final image, per backbone.",
           ("run_id", STR), ("backbone_id", STR), ("step", I32), ("sigma", F64),
           ("similarity_mean", F64), ("similarity_std", F64), ("num_prompts", I32),
           ("embedder", STR)),
    _table("windows", 1, "The SDE window chosen for a backbone from its calibration curve.",
           ("run_id", STR), ("backbone_id", STR), ("formation_step", I32), ("method", STR),
           ("window_start", I32), ("window_end", I32), ("num_steps", I32), ("noise_level", F64),
           ("plot_path", STR, _NULL)),
    _table("rollouts", 2,
           "One sampled image per (prompt, sample): seed, policy, and its row `blob_index` in the "
           "iteration's image and window-step blobs (safetensors, content-addressed).",
           *_KEYS, ("seed", I64), ("policy_hash", STR), ("blob_index", I32), ("image_path", STR),
           ("image_hash", STR), ("latents_path", STR), ("latents_hash", STR),
           ("window_start", I32), ("window_end", I32), ("num_steps", I32)),
    _table("atom_scores", 1,
           "Score and grounding heatmap (row-major, heatmap_h x heatmap_w) per (sample, atom).",
           *_KEYS, ("atom_id", STR), ("atom_type", STR), ("score", F64), ("heatmap", _list(F32)),
           ("heatmap_h", I32), ("heatmap_w", I32), ("scorer_id", STR)),
    _table("advantages", 1, "Group z-score advantage per (sample, atom) with its group statistics.",
           *_KEYS, ("atom_id", STR), ("advantage", F64), ("group_mean", F64),
           ("group_std", F64), ("zero_variance", BOOL), ("gated", BOOL)),
    _table("advantage_maps", 2,
           "Per-sample advantage map on the log-prob grid (row `blob_index` of a safetensors "
           "blob) and the Flow-GRPO scalar advantage of the same sample.",
           *_KEYS, ("reward", F64), ("scalar_advantage", F64), ("blob_index", I32),
           ("map_path", STR), ("map_hash", STR), ("map_h", I32), ("map_w", I32), ("mass", F64),
           ("coverage", F64)),
    _table("checkpoints", 6,
           "The LoRA policy and optimizer state after an iteration's training, with the "
           "iteration's diagnostics: LoRA change norm, the update's KL in nats, rollout HF "
           "energy, constant-reward alarm, the lr the iteration ran at.",
           ("run_id", STR), ("iteration", I32), ("policy_hash", STR), ("lora_path", STR),
           ("optimizer_path", STR), ("optimizer_hash", STR), ("base_hash", STR),
           ("lora_rank", I32), ("lora_alpha", F64), ("optimizer_steps", I64),
           ("param_change_norm", F64), ("update_kl_nats", F64, _NULL),
           ("rollout_hf_energy", F64), ("constant_reward_alarm", BOOL),
           ("alarm_reason", STR, _NULL), ("lr", F64, _NULL),
           ("update_kl_per_step", _list(F64), _NULL), ("step_weights", _list(F64), _NULL),
           ("update_velocity_rms", F64, _NULL), ("update_velocity_per_step", _list(F64), _NULL)),
    _table("train_steps", 5,
           "One optimizer step (accumulated over micro-batches): samples used, loss and "
           "diagnostics (null when skipped; ratio mean and clip fraction also per window step), "
           "KLs in nats, lr, rewards, stage timings, ReCAST step weights.",
           ("run_id", STR), ("iteration", I32), ("step", I64), ("inner_epoch", I32),
           ("samples", I32), ("loss", F64, _NULL), ("clip_fraction", F64, _NULL),
           ("ratio_mean", F64, _NULL), ("ratio_std", F64, _NULL), ("ratio_k3", F64, _NULL),
           ("policy_kl_nats", F64, _NULL), ("policy_kl_k1_nats", F64, _NULL),
           ("ref_kl_nats", F64, _NULL), ("ref_kl_mean_dim", F64, _NULL),
           ("grad_norm", F64, _NULL), ("adv_mass", F64), ("skipped", BOOL),
           ("skip_reason", STR, _NULL), ("lr", F64), ("reward_object", F64, _NULL),
           ("reward_count", F64, _NULL), ("reward_attribute", F64, _NULL),
           ("reward_relation", F64, _NULL), ("zero_variance_fraction", F64),
           ("stage_seconds_json", STR), ("ratio_mean_per_step", _list(F64), _NULL),
           ("clip_fraction_per_step", _list(F64), _NULL),
           ("reward_step_weights_json", STR, _NULL), ("objective", STR, _NULL),
           ("positive_share", F64, _NULL), ("nft_loss_by_t_json", STR, _NULL)),
    _table("evals", 2,
           "Evaluation of one checkpoint on one group of a split (overall, tag, atom type or "
           "atom count), with the group's mean image high-frequency energy.",
           ("run_id", STR), ("iteration", I32), ("checkpoint_hash", STR), ("eval_spec_hash", STR),
           ("split", STR), ("group_kind", STR), ("group_name", STR), ("images", I32),
           ("strict_accuracy", F64), ("atom_accuracy", F64), ("mean_score", F64),
           ("diversity", F64, _NULL), ("hf_energy", F64)),
    _table("recast_gains", 1,
           "ReCAST per (reward, schedule step) for one policy: Renyi divergence of positives vs "
           "policy samples, step gain, mean-normalised gain, Sinkhorn weight W (rows = budget, "
           "columns = sum of budgets / steps); plot_path: the iteration's heatmap PNG.",
           ("run_id", STR), ("iteration", I32), ("policy_hash", STR), ("reward", STR),
           ("step", I32), ("sigma", F64), ("divergence", F64), ("gain", F64),
           ("normalised_gain", F64), ("weight", F64), ("n_positive", I32), ("n_policy", I32),
           ("budget", F64), ("alpha", F64), ("tau", F64), ("plot_path", STR)),
)

TABLES: Mapping[str, TableSpec] = {s.name: s for s in _SPECS}


def prompt_id(prompt_text: str) -> str:
    """The id of a prompt: the first 16 hex digits of sha256(utf-8 text)."""
    return hashlib.sha256(prompt_text.encode("utf-8")).hexdigest()[:16]


def table_spec(table: str) -> TableSpec:
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}; declared tables: {sorted(TABLES)}")
    return TABLES[table]


_DUCKDB_SCALARS = {STR: "VARCHAR", I32: "INTEGER", I64: "BIGINT", F32: "FLOAT", F64: "DOUBLE",
                   BOOL: "BOOLEAN", UTC_TIME: "TIMESTAMP WITH TIME ZONE"}


def duckdb_type(arrow_type: pa.DataType) -> str:
    """The DuckDB type that DuckDB itself reads from a Parquet column of this Arrow type."""
    if pa.types.is_list(arrow_type):
        return duckdb_type(arrow_type.value_type) + "[]"
    if arrow_type not in _DUCKDB_SCALARS:
        raise ValueError(f"no DuckDB type for Arrow type {arrow_type}; add it to _DUCKDB_SCALARS")
    return _DUCKDB_SCALARS[arrow_type]


def view_sql(spec: TableSpec, parquet_glob: str | Sequence[str] | None) -> str:
    """CREATE VIEW over a Parquet glob or a list of files, or an empty view with the declared
    columns (None)."""
    if parquet_glob is not None:
        files = [parquet_glob] if isinstance(parquet_glob, str) else list(parquet_glob)
        listed = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
        source = f"SELECT * FROM read_parquet([{listed}], union_by_name = true)"
    else:
        columns = ", ".join(f'CAST(NULL AS {duckdb_type(f.type)}) AS "{f.name}"'
                            for f in spec.schema)
        source = f"SELECT {columns} WHERE false"
    return f'CREATE VIEW "{spec.name}" AS {source}'


def conform(table: str, data: pa.Table | Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows (dicts) or an Arrow table -> an Arrow table with exactly the declared schema.

    Accepted conversions: null -> any type, int -> wider int or float (overflow raises),
    float64 -> float32, naive -> UTC timestamps, the same per list item. Anything else (a float
    into an int column, a number into a string column) raises SchemaError naming table and column.
    """
    spec = table_spec(table)
    if isinstance(data, pa.Table):
        _check_names(spec, data.column_names, "the Arrow table")
        given = {name: data.column(name) for name in data.column_names}
    else:
        rows, declared = list(data), set(spec.schema.names)
        for i, row in enumerate(rows):
            if row.keys() != declared:  # a mapping's keys are distinct: set equality suffices
                _check_names(spec, list(row), f"row {i}")  # raises, naming what differs
        given = {f.name: _infer(spec, f.name, [row[f.name] for row in rows]) for f in spec.schema}
    columns = [_cast(spec, field, given[field.name]) for field in spec.schema]
    return pa.Table.from_arrays(columns, schema=spec.schema)


def _check_names(spec: TableSpec, names: list[str], where: str) -> None:
    declared = spec.schema.names
    missing = [n for n in declared if n not in names]
    extra = [n for n in names if n not in declared]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if missing or extra or duplicated:
        raise SchemaError(
            f"table {spec.name!r}, {where}: missing columns {missing}, unexpected columns {extra},"
            f" duplicated columns {duplicated}; the declared columns (tasks/store/schemas.py) are "
            f"{declared}")


def _infer(spec: TableSpec, name: str, values: list) -> pa.Array:
    try:
        return pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise SchemaError(f"table {spec.name!r}, column {name!r}: values of mixed or unsupported "
                          f"types ({e}); give every row a value of the declared type") from e


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    if pa.types.is_null(source) or source == target:
        return True
    if pa.types.is_list(source) or pa.types.is_large_list(source):
        return pa.types.is_list(target) and _castable(source.value_type, target.value_type)
    if pa.types.is_integer(source):
        return pa.types.is_integer(target) or pa.types.is_floating(target)
    if pa.types.is_floating(source):
        return pa.types.is_floating(target)
    if pa.types.is_string(source) or pa.types.is_large_string(source):
        return pa.types.is_string(target)
    return pa.types.is_timestamp(source) and pa.types.is_timestamp(target)


def _cast(spec: TableSpec, field: pa.Field, column: pa.Array | pa.ChunkedArray) -> pa.Array:
    where = f"table {spec.name!r}, column {field.name!r}"
    if not _castable(column.type, field.type):
        raise SchemaError(f"{where}: got type {column.type}, declared {field.type}; convert the "
                          f"values before writing")
    try:
        column = column.cast(field.type, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
        raise SchemaError(f"{where}: cannot store the values as {field.type}: {e}") from e
    if not field.nullable and column.null_count:
        raise SchemaError(f"{where}: {column.null_count} null value(s) in a non-nullable column; "
                          f"give every row a value")
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return column
