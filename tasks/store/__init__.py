"""The store and the stage protocol: one writer and reader of Parquet tables, content-addressed
blobs and the DuckDB catalog (`store`, with its atomic file writes in `files`, its refs and
completion records in `records`, its Parquet parts in `parts` and its DuckDB views in `catalog`),
every table's schema (`schemas`), the stage protocol (`stage`: cache keys, completion records,
seeds, the code version), and what guards the records: their hashes (`integrity`), the recipe a
run is pinned to (`run_pin`), what `cast gc` may delete (`gc`), and where the store is by default
(`locations`).

Imports nothing else from `tasks`: a recipe is seen only through what the pin reads of it
(`run_pin.PinnedRecipe`), and rebuilding a damaged output, which runs a stage, is
`tasks.stages.guard`.
"""
