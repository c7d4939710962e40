"""LLM Causal-Scene-Graph builder for free-form prompts: ask a chat model, validate, retry.

The model only describes the scene in a small JSON format that is easy to write:

    {"objects": [{"id": "obj0", "noun": "circle", "count": 2, "attributes": {"color": "red"}}],
     "relations": [{"subject": "obj0", "relation": "left of", "object": "obj1"}]}

and our code turns that into the `SceneGraph` (atoms, questions, answers, parent links) with the
same conventions as the GenEval parser (`cast_core.csg_parser`): an LLM answer that describes a
GenEval prompt gives exactly the parser's graph. Generalisations the parser's grammar never needs:
any number of relations (edge i is "rel{i}", its atom's parents are its two object atoms) and
attribute keys besides colour (one "obj0/<key>" atom each, in `ATTRIBUTE_KEYS` order). Count and
relation questions name an object by its colour only, as the parser does.

Validation is strict and lists every problem: unknown or missing keys, wrong JSON types, counts
outside 1..10, relation words outside `RELATIONS`, references to undeclared ids, repeated kinds.
Only harmless noise is forgiven: a ```json fence, a <think>...</think> block before the answer,
and letter case / extra spaces in nouns, attribute values and relation words. The object ids the
model chose are renamed "obj0", "obj1", ... in its order. After a rejected answer the
conversation gets that answer plus a user turn with the exact error, and the model tries again;
after `max_tries` rejections `CsgBuildError` names the prompt, the tries, the last error and the
last answer. Accepted answers are cached in their canonical form (`SceneSpec.to_dict`) under
(prompt, model id, template version), through any object with the `AnswerCache` methods.

The template (system rules and few-shot turns) is versioned by `TEMPLATE_VERSION`: bump it
whenever the template or the validation rules change, so cached answers are not reused.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from cast_core.csg import (
    MAX_COUNT,
    MIN_COUNT,
    RELATIONS,
    Atom,
    CsgError,
    ObjectNode,
    RelationEdge,
    SceneGraph,
    validate_graph,
)
from cast_core.csg_llm_clients import ChatClient, ChatMessage
from cast_core.csg_parser import COUNT_WORDS, NUMBER_NAMES, noun_phrase, pluralize

TEMPLATE_VERSION = "csg-llm-v1"
ATTRIBUTE_KEYS: tuple[str, ...] = ("color", "size", "material", "texture", "shape", "state")
MAX_OBJECTS = 10
MAX_NOUN_WORDS = 4
MAX_VALUE_WORDS = 3
ANSWER_EXCERPT_CHARS = 500

_SYSTEM = f"""You turn a text-to-image prompt into a scene graph used to check generated images.
Reply with one JSON object and nothing else (no prose, no code fences), in this form:
{{"objects": [{{"id": "obj0", "noun": "...", "count": 1, "attributes": {{}}}}], "relations": []}}
Rules:
- objects: each concrete visible thing the prompt asks for, each kind once, in the order the \
prompt names them; at least one. Ids are "obj0", "obj1", ...
- noun: the bare singular noun in lowercase ("dog", "fire hydrant"): no article, number or \
adjective.
- count: how many the prompt asks for, an integer {MIN_COUNT} to {MAX_COUNT}; 1 when it says \
"a", "an" or gives no number.
- attributes: only what the prompt states, keys from {", ".join(ATTRIBUTE_KEYS)}; each value a \
short lowercase word or phrase ("red", "large", "wooden"). {{}} when there are none.
- relations: only spatial relations the prompt states, relation one of \
{", ".join(f'"{r}"' for r in RELATIONS)} ("on" or "on top of" is "above", "under" is "below"); \
subject and object are object ids. Leave out every other relation ("next to", "holding", \
"in front of"). [] when there are none."""

_EXAMPLES: tuple[tuple[str, dict[str, Any]], ...] = (
    ("a photo of two red circles left of a blue square", {
        "objects": [{"id": "obj0", "noun": "circle", "count": 2, "attributes": {"color": "red"}},
                    {"id": "obj1", "noun": "square", "count": 1, "attributes": {"color": "blue"}}],
        "relations": [{"subject": "obj0", "relation": "left of", "object": "obj1"}]}),
    ("three apples on a wooden table, with a sleeping cat under it", {
        "objects": [{"id": "obj0", "noun": "apple", "count": 3, "attributes": {}},
                    {"id": "obj1", "noun": "table", "count": 1,
                     "attributes": {"material": "wooden"}},
                    {"id": "obj2", "noun": "cat", "count": 1, "attributes": {"state": "sleeping"}}],
        "relations": [{"subject": "obj0", "relation": "above", "object": "obj1"},
                      {"subject": "obj2", "relation": "below", "object": "obj1"}]}),
    ("a large green car parked next to a dog chasing a frisbee", {
        "objects": [{"id": "obj0", "noun": "car", "count": 1,
                     "attributes": {"color": "green", "size": "large"}},
                    {"id": "obj1", "noun": "dog", "count": 1, "attributes": {}},
                    {"id": "obj2", "noun": "frisbee", "count": 1, "attributes": {}}],
        "relations": []}),
)


@dataclass(frozen=True)
class PromptTemplate:
    """System rules plus few-shot (prompt, answer JSON) turns; `version` keys the cache."""

    version: str
    system: str
    examples: tuple[tuple[str, str], ...]

    def messages(self, prompt: str) -> list[ChatMessage]:
        turns: list[ChatMessage] = [{"role": "system", "content": self.system}]
        for example_prompt, answer in self.examples:
            turns += [user_turn(example_prompt), {"role": "assistant", "content": answer}]
        return [*turns, user_turn(prompt)]


def user_turn(prompt: str) -> ChatMessage:
    return {"role": "user", "content": f"Prompt: {prompt}"}


DEFAULT_TEMPLATE = PromptTemplate(TEMPLATE_VERSION, _SYSTEM,
                                  tuple((p, json.dumps(a)) for p, a in _EXAMPLES))


class AnswerError(CsgError):
    """An LLM answer is not valid scene JSON; the message lists every problem, for the model."""


class CsgBuildError(RuntimeError):
    """Every try of the LLM builder gave an invalid answer."""

    def __init__(self, prompt: str, model_id: str, tries: int, last_error: str,
                 last_answer: str) -> None:
        excerpt = last_answer[:ANSWER_EXCERPT_CHARS]
        excerpt += "..." if len(last_answer) > ANSWER_EXCERPT_CHARS else ""
        super().__init__(f"LLM CSG builder ({model_id}) gave up on prompt {prompt!r} after "
                         f"{tries} tries; last validation error: {last_error}; last answer "
                         f"(first {ANSWER_EXCERPT_CHARS} chars): {excerpt!r}")
        self.prompt, self.tries, self.last_error, self.last_answer = (
            prompt, tries, last_error, last_answer)


@dataclass(frozen=True)
class ObjectSpec:
    noun: str
    count: int
    attributes: tuple[tuple[str, str], ...]  # (key, value) in ATTRIBUTE_KEYS order


@dataclass(frozen=True)
class RelationSpec:
    subject: int  # index into SceneSpec.objects
    relation: str
    object: int


@dataclass(frozen=True)
class SceneSpec:
    """A validated LLM answer: what `scene_graph` turns into a SceneGraph."""

    objects: tuple[ObjectSpec, ...]
    relations: tuple[RelationSpec, ...]

    def to_dict(self) -> dict[str, Any]:
        """The canonical answer JSON (ids renamed obj0, obj1, ...); `parse_spec` reads it back."""
        return {"objects": [{"id": f"obj{i}", "noun": o.noun, "count": o.count,
                             "attributes": dict(o.attributes)}
                            for i, o in enumerate(self.objects)],
                "relations": [{"subject": f"obj{r.subject}", "relation": r.relation,
                               "object": f"obj{r.object}"} for r in self.relations]}


def object_node(node_id: str, noun: str, count: int,
                attributes: tuple[tuple[str, str], ...]) -> ObjectNode:
    """Node with its object atom, a count atom when count >= 2, one atom per attribute."""
    atoms = [Atom(node_id, "object", f"Is there {noun_phrase(1, noun)}?", "yes", (), node_id)]
    color = dict(attributes).get("color")
    if count > 1:
        what = " ".join(w for w in (color, pluralize(noun)) if w)
        atoms.append(Atom(f"{node_id}/count", "count", f"How many {what} are there?", str(count),
                          (node_id,), node_id, value=str(count)))
    for key, value in attributes:
        what = f"Is the {noun}" if count == 1 else f"Are the {pluralize(noun)}"
        question = f"{what} {value}?"
        atoms.append(Atom(f"{node_id}/{key}", "attribute", question, "yes", (node_id,), node_id,
                          value=value))
    return ObjectNode(node_id, noun, count, attributes, tuple(atoms))


def relation_edge(edge_id: str, subject: ObjectNode, relation: str,
                  obj: ObjectNode) -> RelationEdge:
    """Edge `subject` `relation` `obj` with its one relation atom (parents: both object atoms)."""
    verb = "Is" if subject.count == 1 else "Are"
    question = f"{verb} the {_description(subject)} {relation} the {_description(obj)}?"
    atom = Atom(edge_id, "relation", question, "yes", (subject.id, obj.id), subject.id, obj.id,
                relation)
    return RelationEdge(edge_id, subject.id, relation, obj.id, (atom,))


def _description(n: ObjectNode) -> str:
    """The node after "the": "red circle", "two red circles"."""
    words = [NUMBER_NAMES[n.count] if n.count > 1 else None, n.color,
             n.noun if n.count == 1 else pluralize(n.noun)]
    return " ".join(w for w in words if w)


def scene_graph(prompt: str, spec: SceneSpec, tag: str | None = None) -> SceneGraph:
    """The validated SceneGraph of `spec`: node i is "obj{i}", edge k is "rel{k}"."""
    nodes = tuple(object_node(f"obj{i}", o.noun, o.count, o.attributes)
                  for i, o in enumerate(spec.objects))
    edges = tuple(relation_edge(f"rel{k}", nodes[r.subject], r.relation, nodes[r.object])
                  for k, r in enumerate(spec.relations))
    graph = SceneGraph(prompt, nodes, edges, tag)
    validate_graph(graph)
    return graph



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


class AnswerCache(Protocol):
    """Where accepted answers (`SceneSpec.to_dict()`) are kept; e.g. tasks.csg_cache.CsgCache."""

    def get(self, prompt: str, model_id: str, template_version: str) -> dict[str, Any] | None:
        """The cached answer, or None (missing or unreadable)."""

    def put(self, prompt: str, model_id: str, template_version: str,
            answer: dict[str, Any]) -> Any:
        """Store `answer` for the key."""


def feedback_turn(error: str) -> ChatMessage:
    return {"role": "user", "content": f"That answer was rejected: {error}. Reply with the "
                                       "corrected JSON object only."}


class LlmCsgBuilder:
    """Prompt -> SceneGraph through a chat model, with validation, retries and a cache."""

    def __init__(self, client: ChatClient, model_id: str, max_tries: int = 3,
                 cache: AnswerCache | None = None,
                 template: PromptTemplate = DEFAULT_TEMPLATE) -> None:
        if max_tries < 1:
            raise ValueError(f"max_tries must be >= 1, got {max_tries}")
        if not model_id:
            raise ValueError("model_id must name the model (it is part of the cache key)")
        self.client, self.model_id, self.max_tries = client, model_id, max_tries
        self.cache, self.template = cache, template

    @property
    def builder_id(self) -> str:
        return f"llm({self.model_id}, {self.template.version})"

    def build(self, prompt: str, tag: str | None = None) -> SceneGraph:
        spec = self._cached(prompt)
        if spec is None:
            spec = self._ask(prompt)
            if self.cache is not None:
                self.cache.put(prompt, self.model_id, self.template.version, spec.to_dict())
        return scene_graph(prompt, spec, tag)

    def _cached(self, prompt: str) -> SceneSpec | None:
        if self.cache is None:
            return None
        data = self.cache.get(prompt, self.model_id, self.template.version)
        if data is None:
            return None
        try:
            return parse_spec(data)
        except CsgError as err:
            warnings.warn(f"cached CSG answer for {prompt!r} is invalid and is rebuilt: {err}",
                          RuntimeWarning, stacklevel=3)
            return None

    def _ask(self, prompt: str) -> SceneSpec:
        messages = self.template.messages(prompt)
        error, answer = "", ""
        for _ in range(self.max_tries):
            answer = self.client.complete(messages)
            try:
                spec = parse_answer(answer)
                scene_graph(prompt, spec)
                return spec
            except CsgError as err:
                error = str(err)
            messages += [{"role": "assistant", "content": answer}, feedback_turn(error)]
        raise CsgBuildError(prompt, self.model_id, self.max_tries, error, answer)
