"""Reporting: what a person reads about a run, drawn from the store: the end-of-iteration report
and its labelled contact sheet (`report`, `contact_sheet`), the evaluation report with its plots
(`eval_report`), and the one markdown-table helper (`markdown`).

May import `tasks.store` and, of `tasks.stages`, what reads or draws a stage's outputs; the store
and the stages import nothing from here.
"""
