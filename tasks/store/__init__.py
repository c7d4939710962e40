"""The store: one writer and reader of Parquet tables and content-addressed blobs (`store`), every
table's schema (`schemas`), the stage protocol (`stage`: cache keys, completion records, seeds)
and what guards its records (`integrity`, `run_pin`, `gc`, `locations`).

Imports nothing else from `tasks/`.
"""
