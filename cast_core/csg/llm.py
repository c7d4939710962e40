"""LLM Causal-Scene-Graph builder for free-form prompts: ask a chat model, validate, retry.

The model only describes the scene in the small JSON format of `cast_core.csg.llm_schema`, which
also validates it; our code turns the validated `SceneSpec` into the `SceneGraph` (atoms,
questions, answers, parent links) with the GenEval parser's own builders (`object_node`,
`relation_edge` in `cast_core.csg.questions`), so an LLM answer that describes a GenEval prompt gives
exactly the parser's graph. Generalisations the parser's grammar never needs: any number of
relations (edge k is "rel{k}", its atom's parents are its two object atoms) and attribute keys
besides colour (one "obj0/<key>" atom each, in `ATTRIBUTE_KEYS` order).

After a rejected answer the conversation gets that answer plus a user turn with the exact error,
and the model tries again; after `max_tries` rejections `CsgBuildError` names the prompt, the
tries, the last error and the last answer. Accepted answers are cached in their canonical form
(`SceneSpec.to_dict`) under (prompt, model id, template version), through any object with the
`AnswerCache` methods.

The template (system rules and few-shot turns) is versioned by `TEMPLATE_VERSION`: bump it
whenever the template or the validation rules change, so cached answers are not reused.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from cast_core.csg.graph import (
    MAX_COUNT,
    MIN_COUNT,
    RELATIONS,
    CsgError,
    SceneGraph,
    validate_graph,
)
from cast_core.csg.llm_clients import ChatClient, ChatMessage
from cast_core.csg.llm_schema import ATTRIBUTE_KEYS, SceneSpec, parse_answer, parse_spec
from cast_core.csg.questions import object_node, relation_edge

TEMPLATE_VERSION = "csg-llm-v1"
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


def scene_graph(prompt: str, spec: SceneSpec, tag: str | None = None) -> SceneGraph:
    """The validated SceneGraph of `spec`: node i is "obj{i}", edge k is "rel{k}"."""
    nodes = tuple(object_node(f"obj{i}", o.noun, o.count, o.attributes)
                  for i, o in enumerate(spec.objects))
    edges = tuple(relation_edge(f"rel{k}", nodes[r.subject], r.relation, nodes[r.object])
                  for k, r in enumerate(spec.relations))
    graph = SceneGraph(prompt, nodes, edges, tag)
    validate_graph(graph)
    return graph


class AnswerCache(Protocol):
    """Where accepted answers (`SceneSpec.to_dict()`) are kept; e.g.
    tasks.stages.csg_cache.CsgCache."""

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
