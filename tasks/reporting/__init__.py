"""Reporting: what a person reads about a run, drawn from the store: the end-of-iteration report
with its labelled contact sheet and the evaluation's printed summary (`report`, `contact_sheet`),
the markdown evaluation report (`eval_report`) with its plots (`eval_plots`), and the
repository's one markdown-table helper (`markdown`).

May import `tasks.store` and `tasks.stages` (today: the recipe type and the plot helpers); the
store and the stages import nothing from here.
"""
