"""Causal Scene Graphs: the graph types and their validation (`graph`), the offline builders
(`parser` for prompt text, with `clauses`, `noun_phrases`, `words`, `refusals`, `predicates`,
`references`; `geneval` for GenEval metadata; both through `build` and `questions`; the word
lists of `vocab` / `vocabulary.json`), and the LLM builder (`llm`, `llm_schema`, `llm_clients`).

May import: the standard library; inside the LLM clients only, lazily, `httpx`, `transformers` and
`torch` (the local causal LM). Nothing else from `cast_core`: every other layer may import this
one, so it imports none of them. No servers, command lines or plots.
"""
