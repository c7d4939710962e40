"""LLM CSG builder: a scripted OpenAI-protocol server on 127.0.0.1, the on-disk cache, and a tiny
random causal LM built from config (no downloads)."""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from cast_core.csg.geneval import graph_from_geneval
from cast_core.csg.graph import validate_graph
from cast_core.csg.llm import DEFAULT_TEMPLATE, CsgBuildError, LlmCsgBuilder
from cast_core.csg.llm_clients import ChatEndpointClient, LlmClientError, LocalCausalLMClient
from cast_core.csg.llm_schema import AnswerError, parse_answer, parse_spec
from cast_core.csg.parser import parse_prompt
from tasks.stages.csg_cache import CsgCache, CsgCacheWarning

PROMPT = "a photo of two red circles left of a blue square"
RECORD = {"tag": "position", "prompt": PROMPT,
          "include": [{"class": "square", "count": 1, "color": "blue"},
                      {"class": "circle", "count": 2, "color": "red", "position": ["left of", 0]}]}
# What a model might write: its own ids, key order and capitals; the builder normalises them.
GOOD = {"relations": [{"subject": "circles", "relation": "Left of", "object": "sq"}],
        "objects": [{"noun": "circle", "id": "circles", "count": 2, "attributes": {"color": "red"}},
                    {"id": "sq", "noun": "Square", "count": 1, "attributes": {"color": "blue"}}]}
BAD = {"objects": [{"id": "a", "noun": "circle", "count": 11}],
       "relations": [{"subject": "a", "relation": "next to", "object": "b"}]}
TRANSPORTS = ["httpx", "urllib"]


@dataclasses.dataclass(frozen=True)
class Reply:
    content: str = ""
    status: int = 200
    delay_s: float = 0.0
    body: str | None = None  # sent as-is instead of a chat-completions reply


class ChatServer:
    """Chat-completions server answering each POST with the next scripted Reply."""

    def __init__(self) -> None:
        self.script: list[Reply] = []
        self.requests: list[dict] = []
        self.paths: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.paths.append(self.path)
                reply = server.script.pop(0) if server.script else Reply(body="", status=599)
                time.sleep(reply.delay_s)
                payload = reply.body if reply.body is not None else json.dumps(
                    {"choices": [{"message": {"role": "assistant", "content": reply.content}}]})
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    self.wfile.write(payload.encode())
                except OSError:
                    pass  # the client gave up (timeout test)

            def log_message(self, *args) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def client(self, transport: str = "auto", **kwargs) -> ChatEndpointClient:
        return ChatEndpointClient(self.base_url, "test-model", transport=transport, **kwargs)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    srv = ChatServer()
    yield srv
    srv.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_good_answer_gives_the_parser_graph(server, transport):
    server.script = [Reply(json.dumps(GOOD))]
    graph = LlmCsgBuilder(server.client(transport, api_key="k"), "test-model").build(
        PROMPT, tag="position")
    assert graph == graph_from_geneval(RECORD) == parse_prompt(PROMPT, "position")
    (request,) = server.requests
    assert server.paths == ["/v1/chat/completions"]
    assert (request["model"], request["temperature"]) == ("test-model", 0.0)
    assert request["messages"] == DEFAULT_TEMPLATE.messages(PROMPT)
    assert request["messages"][-1] == {"role": "user", "content": f"Prompt: {PROMPT}"}


def test_free_form_answer_with_two_relations_and_other_attributes():
    example_prompt, answer = DEFAULT_TEMPLATE.examples[1]
    builder = LlmCsgBuilder(ScriptedClient([answer]), "m")
    graph = builder.build(example_prompt)
    rows = [(a.id, a.type, a.answer, a.parents, a.value, a.question) for a in graph.atoms()]
    assert rows == [
        ("obj0", "object", "yes", (), None, "Is there an apple?"),
        ("obj0/count", "count", "3", ("obj0",), "3", "How many apples are there?"),
        ("obj1", "object", "yes", (), None, "Is there a table?"),
        ("obj1/material", "attribute", "yes", ("obj1",), "wooden", "Is the table made of wood?"),
        ("obj2", "object", "yes", (), None, "Is there a cat?"),
        ("obj2/state", "attribute", "yes", ("obj2",), "sleeping", "Is the cat sleeping?"),
        ("rel0", "relation", "yes", ("obj0", "obj1"), "above",
         "Are the three apples above the wooden table?"),
        ("rel1", "relation", "yes", ("obj2", "obj1"), "below",
         "Is the sleeping cat below the wooden table?"),
    ]


def test_every_few_shot_answer_is_valid_and_canonical():
    for example_prompt, answer in DEFAULT_TEMPLATE.examples:
        spec = parse_answer(answer)
        assert spec.to_dict() == json.loads(answer), example_prompt
        assert parse_spec(spec.to_dict()) == spec


class ScriptedClient:
    def __init__(self, answers: list[str]) -> None:
        self.answers, self.calls = list(answers), []

    def complete(self, messages):
        self.calls.append(list(messages))
        return self.answers.pop(0)


def test_malformed_json_then_good_succeeds_with_the_error_fed_back(server):
    malformed = '{"objects": [{"id": "obj0", "noun": "circle" "count": 2}]'
    with pytest.raises(AnswerError) as expected:
        parse_answer(malformed)
    server.script = [Reply(malformed), Reply(json.dumps(GOOD))]
    graph = LlmCsgBuilder(server.client(), "test-model").build(PROMPT)
    assert graph == parse_prompt(PROMPT)
    first, second = server.requests
    assert second["messages"][:-2] == first["messages"]
    assert second["messages"][-2] == {"role": "assistant", "content": malformed}
    feedback = second["messages"][-1]
    assert feedback["role"] == "user" and str(expected.value) in feedback["content"]
    assert "not JSON" in feedback["content"]


def test_schema_violations_every_try_end_in_a_clear_error(server):
    server.script = [Reply(json.dumps(BAD))] * 3
    with pytest.raises(CsgBuildError) as caught:
        LlmCsgBuilder(server.client(), "test-model", max_tries=3).build(PROMPT)
    message = str(caught.value)
    assert len(server.requests) == 3 and caught.value.tries == 3
    for part in (repr(PROMPT), "after 3 tries", "objects[0].count must be an integer 1..10",
                 "relations[0].object \"b\" is not an object id", '"next to" is not one of',
                 '"noun": "circle"'):
        assert part in message, part
    assert len(server.requests[2]["messages"]) == len(server.requests[0]["messages"]) + 4


def test_last_answer_is_truncated_in_the_error():
    answer = "x" * 5000
    with pytest.raises(CsgBuildError) as caught:
        LlmCsgBuilder(ScriptedClient([answer]), "m", max_tries=1).build(PROMPT)
    assert "x" * 500 + "..." in str(caught.value) and "x" * 501 not in str(caught.value)
    assert caught.value.last_answer == answer and "not JSON" in caught.value.last_error


@pytest.mark.parametrize("wrapped", [
    "```json\n{}\n```", "```\n{}\n```", "  ```JSON {} ```  ", "<think>two circles</think>\n{}",
])
def test_fenced_answers_parse(wrapped):
    answer = wrapped.replace("{}", json.dumps(GOOD, indent=2))
    graph = LlmCsgBuilder(ScriptedClient([answer]), "m").build(PROMPT)
    assert graph == parse_prompt(PROMPT)


@pytest.mark.parametrize("answer, fragment", [
    ([], "must be a JSON object"),
    ({"relations": []}, "the answer is missing key 'objects'"),
    ({"objects": []}, "objects must be an array of 1..10"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}], "scene": "x"}, "unknown keys ['scene']"),
    ({"objects": [{"id": "a", "noun": "cat", "count": "2"}]}, 'integer 1..10, got a string "2"'),
    ({"objects": [{"id": "a", "noun": "cat", "count": True}]}, "got a boolean true"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 0}]}, "count must be an integer 1..10"),
    ({"objects": [{"id": "a", "noun": "cat"}]}, "objects[0] is missing key 'count'"),
    ({"objects": [{"id": "a", "noun": "two cats", "count": 2}]}, "without article or number"),
    ({"objects": [{"id": "a", "noun": 7, "count": 1}]}, "noun must be 1..4 lowercase words"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1, "colour": "red"}]}, "['colour']"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1, "attributes": {"mood": "happy"}}]},
     "attributes key 'mood' is unknown"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1, "attributes": {"color": ["red"]}}]},
     "attributes.color must be 1..3 lowercase words"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}, {"id": "a", "noun": "dog", "count": 1}]},
     "object id 'a' repeats"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}, {"id": "b", "noun": "cat", "count": 2}]},
     "same kind 'cat'"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}],
      "relations": [{"subject": "a", "relation": "above", "object": "a"}]}, "to itself"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}],
      "relations": [{"subject": "a", "relation": "above", "object": "z"}]},
     'relations[0].object "z" is not an object id; use one of [\'a\']'),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}, {"id": "b", "noun": "dog", "count": 1}],
      "relations": [{"subject": "a", "relation": "near", "object": "b"}]}, "is not one of"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}, {"id": "b", "noun": "dog", "count": 1}],
      "relations": [{"subject": "a", "relation": "above", "object": "b"}] * 2},
     "relations[1] repeats relations[0]"),
    ({"objects": [{"id": "a", "noun": "cat", "count": 1}], "relations": {}}, "relations must be"),
])
def test_schema_violations_have_precise_messages(answer, fragment):
    with pytest.raises(AnswerError) as caught:
        parse_spec(answer)
    assert fragment in str(caught.value)


def test_valid_answer_gives_a_valid_graph_with_renamed_ids():
    spec = parse_spec(GOOD)
    assert spec.to_dict()["objects"][0]["id"] == "obj0"
    graph = LlmCsgBuilder(ScriptedClient([json.dumps(GOOD)]), "m").build(PROMPT)
    validate_graph(graph)
    assert [e.subject for e in graph.edges] == ["obj0"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_http_error_is_clear(server, transport):
    server.script = [Reply(body='{"error": "model not loaded"}', status=500)]
    with pytest.raises(LlmClientError, match=r"answered HTTP 500: .*model not loaded"):
        LlmCsgBuilder(server.client(transport), "test-model").build(PROMPT)
    assert len(server.requests) == 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_timeout_is_clear(server, transport):
    server.script = [Reply(json.dumps(GOOD), delay_s=1.0)]
    with pytest.raises(LlmClientError, match=r"timed out after 0.2 s"):
        server.client(transport, timeout_s=0.2).complete(DEFAULT_TEMPLATE.messages(PROMPT))


def test_reply_without_content_and_unreachable_server_are_clear(server):
    server.script = [Reply(body='{"choices": []}'), Reply(body='{"choices": [{"message": '
                                                             '{"content": null}}]}')]
    with pytest.raises(LlmClientError, match=r"without choices\[0\].message.content: .*choices"):
        server.client().complete(DEFAULT_TEMPLATE.messages(PROMPT))
    with pytest.raises(LlmClientError, match="sent content None, not text"):
        server.client().complete(DEFAULT_TEMPLATE.messages(PROMPT))
    dead = ChatEndpointClient("http://127.0.0.1:9/v1", "m", timeout_s=2)
    with pytest.raises(LlmClientError, match="cannot reach chat endpoint"):
        dead.complete(DEFAULT_TEMPLATE.messages(PROMPT))
    with pytest.raises(ValueError, match="must start with http"):
        ChatEndpointClient("127.0.0.1:8000/v1", "m")


def test_cache_hit_skips_the_server_and_keys_on_model_and_template(server, tmp_path):
    cache = CsgCache(tmp_path / "cache")
    server.script = [Reply(json.dumps(GOOD))] * 3
    builder = LlmCsgBuilder(server.client(), "test-model", cache=cache)
    first = builder.build(PROMPT)
    assert builder.build(PROMPT, tag="t") == dataclasses.replace(first, tag="t")
    assert len(server.requests) == 1
    other_template = dataclasses.replace(DEFAULT_TEMPLATE, version="csg-llm-test")
    LlmCsgBuilder(server.client(), "test-model", cache=cache, template=other_template).build(PROMPT)
    LlmCsgBuilder(server.client(), "other-model", cache=cache).build(PROMPT)
    assert len(server.requests) == 3
    files = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(files) == 3 and all(f.endswith(".json") and not f.startswith(".") for f in files)


@pytest.mark.parametrize("garbage", ["{not json", '{"answer": 3}', "\udcff", "[]"])
def test_corrupt_cache_file_is_ignored_with_a_warning_and_rewritten(tmp_path, garbage):
    cache = CsgCache(tmp_path)
    path = cache.path(PROMPT, "m", DEFAULT_TEMPLATE.version)
    path.write_bytes(garbage.encode("utf-8", "surrogateescape"))
    client = ScriptedClient([json.dumps(GOOD)])
    with pytest.warns(CsgCacheWarning, match="ignoring CSG cache file"):
        graph = LlmCsgBuilder(client, "m", cache=cache).build(PROMPT)
    assert graph == parse_prompt(PROMPT) and len(client.calls) == 1
    assert json.loads(path.read_text())["answer"] == parse_spec(GOOD).to_dict()


def test_cached_answer_that_no_longer_validates_is_rebuilt(tmp_path):
    cache = CsgCache(tmp_path)
    cache.put(PROMPT, "m", DEFAULT_TEMPLATE.version, BAD)
    client = ScriptedClient([json.dumps(GOOD)])
    with pytest.warns(RuntimeWarning, match="cached CSG answer .* is invalid"):
        LlmCsgBuilder(client, "m", cache=cache).build(PROMPT)
    assert len(client.calls) == 1
    assert cache.get(PROMPT, "m", DEFAULT_TEMPLATE.version) == parse_spec(GOOD).to_dict()


def test_cache_write_is_atomic(tmp_path, monkeypatch):
    cache = CsgCache(tmp_path)
    path = cache.put(PROMPT, "m", "v1", {"objects": []})
    before = path.read_bytes()

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        cache.put(PROMPT, "m", "v1", {"objects": [1]})
    assert path.read_bytes() == before and list(tmp_path.iterdir()) == [path]
    assert cache.get(PROMPT, "m", "v2") is None


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory) -> Path:
    """A 1-layer random Qwen2 causal LM with a BPE tokenizer trained on the template text."""
    from tests.tiny_models import save_causal_lm

    return save_causal_lm(tmp_path_factory.mktemp("tiny-lm"),
                          [m["content"] for m in DEFAULT_TEMPLATE.messages(PROMPT)])


def test_local_random_lm_ends_in_a_clear_build_error(tiny_lm):
    client = LocalCausalLMClient(str(tiny_lm), max_new_tokens=8)
    messages = DEFAULT_TEMPLATE.messages(PROMPT)
    assert client.render(messages).startswith("<|im_start|>system\nYou turn a text-to-image")
    assert client.render(messages).endswith(f"Prompt: {PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(CsgBuildError) as caught:
        LlmCsgBuilder(client, "tiny-random", max_tries=3).build(PROMPT)
    assert caught.value.tries == 3 and "after 3 tries" in str(caught.value)
    assert caught.value.last_answer == client.complete(
        [*messages, *_retries(client, messages, 2)])


def _retries(client: LocalCausalLMClient, messages, n: int) -> list[dict]:
    """The turns the builder appended after `n` rejected greedy answers."""
    from cast_core.csg.llm import feedback_turn

    turns: list[dict] = []
    for _ in range(n):
        answer = client.complete([*messages, *turns])
        with pytest.raises(AnswerError) as caught:
            parse_answer(answer)
        turns += [{"role": "assistant", "content": answer}, feedback_turn(str(caught.value))]
    return turns


def test_local_client_without_chat_template_joins_turns(tiny_lm):
    client = LocalCausalLMClient(str(tiny_lm), max_new_tokens=4)
    client.tokenizer.chat_template = None
    text = client.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "system: S\n\nuser: U\n\nassistant: "
    assert isinstance(client.complete([{"role": "user", "content": "U"}]), str)
