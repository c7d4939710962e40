"""Schema of the LLM scene-graph builder's answers: the JSON the model writes and its validation.

The model describes the scene in a small JSON format that is easy to write:

    {"objects": [{"id": "obj0", "noun": "circle", "count": 2, "attributes": {"color": "red"}}],
     "relations": [{"subject": "obj0", "relation": "left of", "object": "obj1"}]}

`parse_answer` (a raw reply) and `parse_spec` (decoded JSON) turn it into a `SceneSpec`, or raise
`AnswerError` listing every problem, worded for the model to fix: unknown or missing keys, wrong
JSON types, counts outside 1..10, relation words outside `RELATIONS`, references to undeclared
ids, repeated kinds. Only harmless noise is forgiven: a ```json fence, a <think>...</think> block
before the answer, and letter case / extra spaces in nouns, attribute values and relation words.
The object ids the model chose become indices in its order; `SceneSpec.to_dict` writes them back
as "obj0", "obj1", ... (the canonical form that is cached). Attributes are kept in
`ATTRIBUTE_KEYS` order, whatever order the model wrote them in.

These rules are part of the LLM builder's template version (`cast_core.csg.llm.TEMPLATE_VERSION`):
bump it whenever they change, so cached answers are not reused.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cast_core.csg.graph import MAX_COUNT, MIN_COUNT, RELATIONS, CsgError
from cast_core.csg.questions import NUMBER_NAMES
from cast_core.csg.words import COUNT_WORDS

ATTRIBUTE_KEYS: tuple[str, ...] = ("color", "size", "material", "texture", "shape", "state")
MAX_OBJECTS = 10
MAX_NOUN_WORDS = 4
MAX_VALUE_WORDS = 3


class AnswerError(CsgError):
    """An LLM answer is not valid scene JSON; the message lists every problem, for the model."""


@dataclass(frozen=True)
class ObjectSpec:
    """One kind of object the answer names: `count` instances of `noun` (singular)."""

    noun: str
    count: int
    attributes: tuple[tuple[str, str], ...]  # (key, value) in ATTRIBUTE_KEYS order


@dataclass(frozen=True)
class RelationSpec:
    """`objects[subject]` is `relation` of `objects[object]`."""

    subject: int  # index into SceneSpec.objects
    relation: str
    object: int


@dataclass(frozen=True)
class SceneSpec:
    """A validated LLM answer: what `cast_core.csg.llm.scene_graph` turns into a SceneGraph."""

    objects: tuple[ObjectSpec, ...]
    relations: tuple[RelationSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        """The canonical answer JSON (ids renamed obj0, obj1, ...); `parse_spec` reads it back."""
        return {"objects": [{"id": f"obj{i}", "noun": o.noun, "count": o.count,
                             "attributes": dict(o.attributes)}
                            for i, o in enumerate(self.objects)],
                "relations": [{"subject": f"obj{r.subject}", "relation": r.relation,
                               "object": f"obj{r.object}"} for r in self.relations]}


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_FENCE = re.compile(r"```[A-Za-z]*\s*(.*?)\s*```", re.DOTALL)
_PHRASE = re.compile(r"[a-z0-9][a-z0-9'-]*( [a-z0-9][a-z0-9'-]*)*")
_NOT_FIRST_NOUN_WORDS = frozenset(COUNT_WORDS) | frozenset(NUMBER_NAMES) | {"the"}


def parse_answer(text: str) -> SceneSpec:
    """An LLM reply -> SceneSpec, after removing a ```json fence or a <think> block."""
    body = _THINK.sub("", text).strip()
    fenced = _FENCE.fullmatch(body)
    body = fenced.group(1) if fenced else body
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        raise AnswerError(f"the answer is not JSON ({err.msg} at line {err.lineno} column "
                          f"{err.colno}); reply with the JSON object only") from err
    return parse_spec(data)


def parse_spec(data: Any) -> SceneSpec:
    """Validated SceneSpec of decoded answer JSON; AnswerError lists every problem."""
    if not isinstance(data, dict):
        raise AnswerError(f'the answer must be a JSON object {{"objects": [...], "relations": '
                          f'[...]}}, got {_kind(data)}')
    problems = _key_problems("the answer", data, ("objects",), ("relations",))
    objects, relations = data.get("objects", []), data.get("relations", [])
    if "objects" in data and (not isinstance(objects, list)
                              or not 1 <= len(objects) <= MAX_OBJECTS):
        problems.append(f"objects must be an array of 1..{MAX_OBJECTS} objects, got "
                        f"{_kind(objects)}")
    if not isinstance(relations, list):
        problems.append(f"relations must be an array (use [] for none), got {_kind(relations)}")
    if problems:
        raise AnswerError("; ".join(problems))
    problems = [p for i, o in enumerate(objects) for p in _object_problems(i, o)]
    ids = [o.get("id") for o in objects if isinstance(o, dict)]
    problems += [f"object id {i!r} repeats; give each object its own id"
                 for i in sorted({i for i in ids if isinstance(i, str) and ids.count(i) > 1})]
    valid_ids = {i for i in ids if isinstance(i, str)}
    problems += [p for k, r in enumerate(relations) for p in _relation_problems(k, r, valid_ids)]
    if problems:
        raise AnswerError("; ".join(problems))
    spec = _spec(objects, relations)
    problems = _repeat_problems(spec)
    if problems:
        raise AnswerError("; ".join(problems))
    return spec


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
             int: "a number", float: "a number", type(None): "null"}
    return f"{names.get(type(value), type(value).__name__)} {json.dumps(value)[:80]}"


def _words(value: Any) -> str | None:
    """Lowercase, single-spaced phrase of `value`, or None when it is not a string of words."""
    if not isinstance(value, str):
        return None
    phrase = " ".join(value.lower().split())
    return phrase if _PHRASE.fullmatch(phrase) else None


def _key_problems(where: str, data: dict[str, Any], required: tuple[str, ...],
                  optional: tuple[str, ...]) -> list[str]:
    problems = [f"{where} is missing key {k!r}" for k in required if k not in data]
    unknown = [k for k in data if k not in required + optional]
    if unknown:
        problems.append(f"{where} has unknown keys {unknown}; allowed: {list(required + optional)}")
    return problems


def _object_problems(i: int, o: Any) -> list[str]:
    where = f"objects[{i}]"
    if not isinstance(o, dict):
        return [f"{where} must be an object, got {_kind(o)}"]
    problems = _key_problems(where, o, ("id", "noun", "count"), ("attributes",))
    if "id" in o and not (isinstance(o["id"], str) and o["id"]):
        problems.append(f"{where}.id must be a non-empty string, got {_kind(o['id'])}")
    if "noun" in o:
        problems += _noun_problems(where, o["noun"])
    count = o.get("count", MIN_COUNT)
    if isinstance(count, bool) or not isinstance(count, int) or not MIN_COUNT <= count <= MAX_COUNT:
        problems.append(f"{where}.count must be an integer {MIN_COUNT}..{MAX_COUNT}, got "
                        f"{_kind(count)}")
    return problems + _attribute_problems(where, o.get("attributes", {}))


def _noun_problems(where: str, value: Any) -> list[str]:
    noun = _words(value)
    if noun is None or len(noun.split()) > MAX_NOUN_WORDS:
        return [f"{where}.noun must be 1..{MAX_NOUN_WORDS} lowercase words, got {_kind(value)}"]
    if noun.split()[0] in _NOT_FIRST_NOUN_WORDS:
        return [f"{where}.noun {noun!r} must be the bare noun, without article or number"]
    return []


def _attribute_problems(where: str, attributes: Any) -> list[str]:
    if not isinstance(attributes, dict):
        problem = f"{where}.attributes must be an object (use {{}} for none), got "
        return [problem + _kind(attributes)]
    problems = [f"{where}.attributes key {k!r} is unknown; use one of {list(ATTRIBUTE_KEYS)}"
                for k in attributes if k not in ATTRIBUTE_KEYS]
    for key, value in attributes.items():
        phrase = _words(value)
        if phrase is None or len(phrase.split()) > MAX_VALUE_WORDS:
            problems.append(f"{where}.attributes.{key} must be 1..{MAX_VALUE_WORDS} lowercase "
                            f"words, got {_kind(value)}")
    return problems


def _relation_problems(k: int, r: Any, ids: set[str]) -> list[str]:
    where = f"relations[{k}]"
    if not isinstance(r, dict):
        return [f"{where} must be an object, got {_kind(r)}"]
    problems = _key_problems(where, r, ("subject", "relation", "object"), ())
    for end in ("subject", "object"):
        if end in r and not (isinstance(r[end], str) and r[end] in ids):
            problems.append(f"{where}.{end} {json.dumps(r[end])} is not an object id; use one "
                            f"of {sorted(ids)}")
    if "relation" in r and _words(r["relation"]) not in RELATIONS:
        problems.append(f"{where}.relation {json.dumps(r['relation'])} is not one of "
                        f"{list(RELATIONS)}; leave out other relations")
    if "subject" in r and r.get("subject") == r.get("object"):
        problems.append(f"{where} relates {json.dumps(r['subject'])} to itself; use two objects")
    return problems


def _spec(objects: list[dict[str, Any]], relations: list[dict[str, Any]]) -> SceneSpec:
    """SceneSpec of checked answer JSON; object ids become indices in answer order."""
    index = {o["id"]: i for i, o in enumerate(objects)}
    specs = tuple(ObjectSpec(_words(o["noun"]), o["count"],
                             tuple((k, _words(o["attributes"][k])) for k in ATTRIBUTE_KEYS
                                   if k in o.get("attributes", {})))
                  for o in objects)
    edges = tuple(RelationSpec(index[r["subject"]], _words(r["relation"]), index[r["object"]])
                  for r in relations)
    return SceneSpec(specs, edges)


def _repeat_problems(spec: SceneSpec) -> list[str]:
    kinds = [(o.noun, o.attributes) for o in spec.objects]
    problems = [f"objects[{i}] and objects[{kinds.index(kind)}] are the same kind {kind[0]!r}; "
                "list each kind once with its total count"
                for i, kind in enumerate(kinds) if kinds.index(kind) < i]
    edges = list(spec.relations)
    return problems + [f"relations[{k}] repeats relations[{edges.index(e)}]"
                       for k, e in enumerate(edges) if edges.index(e) < k]
