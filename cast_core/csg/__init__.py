"""Causal Scene Graphs: the graph types and their validation (`graph`), the offline parser
(`parser`, with `clauses`, `references`, `questions` and the word lists of `vocab` /
`vocabulary.json`), and the LLM builder (`llm`, `llm_schema`, `llm_clients`).

May import: the standard library, and inside the LLM clients, lazily, `httpx` and `transformers`.
Nothing else from `cast_core` (no torch): every other layer may import this one, so it imports none
of them. Nothing here runs a server or reads a command line.
"""
