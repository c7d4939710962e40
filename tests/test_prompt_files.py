"""Strict prompt files: bytes that are not UTF-8, metadata that contradicts its text, repeated
prompts with different metadata, limits, and builder errors, each named with file and line."""

from __future__ import annotations

import json

import pytest
from pipeline_helpers import CI_RECIPE

import tasks.stages.build_csgs as build_csgs_module
from cast_core.csg.parser import MAX_PROMPT_CHARS, parse_prompt
from cast_core.shapes.prompts import PromptFileError, load_prompt_file
from tasks.stages.prompt_sets import load_prompts, prompt_lines
from tasks.stages.recipe import load_recipe
from tasks.store.store import Store

REAL = {"backbone.family": "flux2", "backbone.height": 64, "backbone.width": 64}
CAT = {"tag": "colors", "prompt": "a photo of a red cat",
       "include": [{"class": "cat", "count": 1, "color": "red"}]}
POSITION = {"tag": "position", "prompt": "a photo of a dog left of a fire hydrant",
            "include": [{"class": "fire hydrant", "count": 1},
                        {"class": "dog", "count": 1, "position": ["left of", 0]}]}
GNOME = {"tag": "two_object", "prompt": "a photo of a garden gnome and a bench",
         "include": [{"class": "garden gnome", "count": 1}, {"class": "bench", "count": 1}]}


def _file(tmp_path, records, raw: bytes = b""):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in records) + raw)
    return path


def _recipe(path, **overrides):
    return load_recipe(CI_RECIPE, {"prompts.train": str(path), **REAL, **overrides})


def test_geneval_records_whose_text_agrees_load(tmp_path):
    path = _file(tmp_path, [CAT, POSITION, GNOME, CAT])
    assert load_prompts(_recipe(path), path) == [CAT, POSITION, GNOME, CAT]
    assert [n for n, _ in prompt_lines(_recipe(path), path)] == [1, 2, 3, 4]


@pytest.mark.parametrize("include, metadata_says", [
    ([{"class": "cat", "count": 1, "color": "blue"}], "[a blue cat]"),
    ([{"class": "cat", "count": 2, "color": "red"}], "[two red cats]"),
    ([{"class": "cat", "count": 1}], "[a cat]"),
])
def test_metadata_that_contradicts_the_text_shows_both(tmp_path, include, metadata_says):
    path = _file(tmp_path, [POSITION, {**CAT, "include": include}])
    with pytest.raises(PromptFileError) as info:
        load_prompts(_recipe(path), path)
    message = str(info.value)
    assert f"{path}, line 2:" in message and "contradicts its text" in message
    assert "the text says [a red cat]" in message and f"the metadata says {metadata_says}" in message


def test_text_richer_than_metadata_is_a_contradiction(tmp_path):
    record = {"tag": "colors", "prompt": "a photo of a wooden chair",
              "include": [{"class": "chair", "count": 1}]}
    path = _file(tmp_path, [record])
    with pytest.raises(PromptFileError, match=r"text says \[a wooden chair\], the metadata says "
                                              r"\[a chair\]"):
        load_prompts(_recipe(path), path)


def test_unparsed_text_needs_allow_metadata_only(tmp_path):
    record = {"tag": "two_object", "prompt": "a photo of a dog chasing a cat",
              "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
    path = _file(tmp_path, [CAT, record])
    with pytest.raises(PromptFileError) as info:
        load_prompts(_recipe(path), path)
    message = str(info.value)
    assert f"{path}, line 2:" in message and "verb ('chasing')" in message
    assert "[a dog, a cat]" in message and "allow_metadata_only" in message
    assert load_prompts(_recipe(path), path, allow_metadata_only=True) == [CAT, record]


def test_recipe_flag_allows_metadata_only_and_is_hashed_only_when_set(tmp_path):
    record = {"tag": "two_object", "prompt": "a photo of a dog chasing a cat",
              "include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 1}]}
    path = _file(tmp_path, [CAT, record])
    strict, allowed = _recipe(path), _recipe(path, **{"builder.allow_metadata_only": True})
    assert load_prompts(allowed, path) == [CAT, record]
    with pytest.raises(PromptFileError, match="allow_metadata_only"):
        load_prompts(strict, path)
    assert "allow_metadata_only" not in strict.pinned().get("builder", {})
    assert allowed.section_hash("builder") != strict.section_hash("builder")


def test_metadata_only_never_allows_a_contradiction(tmp_path):
    path = _file(tmp_path, [{**CAT, "include": [{"class": "cat", "count": 3}]}])
    with pytest.raises(PromptFileError, match="contradicts its text"):
        load_prompts(_recipe(path), path, allow_metadata_only=True)


@pytest.mark.parametrize("family", ["flux2", "shapes"])
def test_non_utf8_bytes_name_file_and_line(tmp_path, family):
    shapes = {"tag": "single_object", "include": [{"class": "circle", "count": 1}],
              "prompt": "a photo of a circle"}
    path = _file(tmp_path, [shapes], raw=b'{"prompt": "a photo of a caf\xe9"}\n')
    recipe = _recipe(path) if family == "flux2" else load_recipe(CI_RECIPE,
                                                                  {"prompts.train": str(path)})
    with pytest.raises(PromptFileError, match=rf"{path}, line 2: byte 0xe9 \(byte 29 of the "
                                              r"line\) is not UTF-8"):
        load_prompts(recipe, path)
    with pytest.raises(PromptFileError, match="line 2: byte 0xe9"):
        load_prompt_file(path)


def test_same_prompt_with_different_metadata_is_an_error(tmp_path):
    other = {**CAT, "tag": "single_object"}
    path = _file(tmp_path, [CAT, POSITION, other])
    with pytest.raises(PromptFileError) as info:
        load_prompts(_recipe(path), path)
    message = str(info.value)
    assert f"{path}, lines 1 and 3:" in message and "'a photo of a red cat'" in message
    assert '"tag": "colors"' in message and '"tag": "single_object"' in message


def test_same_prompt_with_different_tags_is_an_error_for_llm_builders_too(tmp_path):
    path = _file(tmp_path, [{"prompt": "a cat", "tag": "a"}, {"prompt": "a cat", "tag": "b"}])
    recipe = _recipe(path, **{"builder.kind": "llm-chat", "builder.base_url": "http://x",
                              "builder.model": "m"})
    with pytest.raises(PromptFileError, match="lines 1 and 2"):
        load_prompts(recipe, path)


def test_prompt_length_limit(tmp_path):
    long = {"prompt": "a cat" + " and a dog" * 50}
    path = _file(tmp_path, [{"prompt": "a cat"}, long])
    recipe = _recipe(path, **{"builder.kind": "llm-chat", "builder.base_url": "http://x",
                              "builder.model": "m"})
    with pytest.raises(PromptFileError, match=rf"line 2: the prompt is {len(long['prompt'])} "
                                              rf"characters long, more than the limit of "
                                              rf"{MAX_PROMPT_CHARS}"):
        load_prompts(recipe, path)


def test_atom_limit_on_metadata_names_file_and_line(tmp_path):
    nouns = [f"thing{chr(97 + i)}" for i in range(17)]
    record = {"tag": "many", "prompt": "a photo of " + ", ".join(f"two red {n}s" for n in nouns),
              "include": [{"class": n, "count": 2, "color": "red"} for n in nouns]}
    path = _file(tmp_path, [CAT, record])
    with pytest.raises(PromptFileError, match=rf"{path}, line 2: .*it has 51 atoms, more than"):
        load_prompts(_recipe(path), path)


def test_builder_errors_name_file_and_line(tmp_path, monkeypatch):
    path = _file(tmp_path, [{"prompt": "a cat"}, {"prompt": "a dog chasing a cat"}])
    recipe = _recipe(path, **{"builder.kind": "llm-chat", "builder.base_url": "http://x",
                              "builder.model": "m"})

    def build(record):
        if "chasing" in record["prompt"]:
            raise RuntimeError("the model gave up")
        return parse_prompt(record["prompt"])

    monkeypatch.setattr(build_csgs_module, "graph_builder", lambda recipe: build)
    with pytest.raises(PromptFileError, match=rf"{path}, line 2: the CSG builder failed: the "
                                              "model gave up"):
        build_csgs_module.build_csgs(Store(tmp_path / "store"), recipe)
