"""Causal Scene Graphs: the graph types and their validation (`graph`), the offline parser
(`parser`, with `clauses`, `references`, `questions` and the word lists of `vocab` /
`vocabulary.json`), and the LLM builder (`llm`, `llm_schema`, `llm_clients`).

May import: the standard library; inside the LLM clients only, lazily, `httpx`, `transformers` and
`torch` (the local causal LM). Nothing else from `cast_core`: every other layer may import this
one, so it imports none of them. No servers, command lines or plots.
"""
