"""The shapes world's prompt grammar and its train / eval / hard splits, in GenEval's JSONL format.

Each record is GenEval metadata: {"tag", "include": [{"class", "count", "color"?, "position"?}],
"exclude", "prompt"}. "position": [rel, j] on clause i means clause i's object is rel of clause
j's; as in GenEval, a relation record lists the reference object first and the subject second,
while the prompt names the subject first. "exclude" holds one clause per counted clause (count
n >= 2) with count n + 1, which makes the count exact; GenEval writes it only for counting.

Tags: GenEval's six small ones over 3 shapes x 5 colours (single_object 3, two_object 6,
counting 9, colors 15, position 24, color_attr 150) and three harder ones with counts 1..4 and a
colour on every noun: hard_counted_relation ("two red circles left of a blue square"),
hard_three_objects ("a red circle, two blue squares and a green triangle"), hard_counted_colors
("two red circles and three blue squares"). Within a prompt the shapes are distinct.
Departure from GenEval: color_attr lets both nouns share a colour (150 prompts, not 120).

Splits (`make_splits`), deterministic from the seed:
- hard: 200 hard-tag prompts with >= 5 atoms, balanced over the three hard tags;
- eval: every single_object/two_object/counting/colors/position prompt, 60 of the 150 color_attr
  prompts, and 30 prompts per hard tag (>= 5 atoms);
- train: 5000 prompts: the small-tag prompts not held out in eval, then hard-tag prompts (any
  counts) up to the total. single_object, two_object, counting and colors have too few prompts to
  hold out, so they are in train and eval alike; position is wholly held out.
A sampled hard-tag prompt never describes the scene of a prompt in another split, nor of any
small-tag prompt (scenes compared order-free, "A left of B" equal to "B right of A"): stricter
than disjoint prompt text. Within train, two word orders of one scene may both appear.

The training pool (`make_pool`): POOL_SIZE hard-tag prompts of the train split, each with >=
MIN_POOL_ATOMS atoms and a distinct scene, none sharing a prompt text or a scene with the held-out
files (eval, hard), balanced over the three hard tags (11 / 11 / 10 in HARD_TAGS order). Within a
tag the candidates are taken in file order and the picks evenly spaced over them (candidate
floor(i n / k) of n, i < k); the tags are then interleaved (one of each in turn), so any window of
consecutive pool prompts mixes the tags. A fixed pool is what RL trains on when it should learn
visibly: every prompt comes back every few iterations (`prompts.selection = "cycle"`).

The command line that writes the three split files and the pool is `flows.shapes_prompts`
(python -m flows.shapes_prompts --out data/prompts --seed 0; python -m flows.shapes_prompts pool
--out data/prompts/pool.jsonl); the only I/O in this module is `load_prompt_file`.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cast_core.csg.geneval import graph_from_geneval
from cast_core.csg.parser import PREFIX, parse_prompt
from cast_core.csg.questions import noun_phrase
from cast_core.shapes.world import COLORS, MAX_COUNT, RELATIONS, SHAPES

SMALL_TAGS: tuple[str, ...] = ("single_object", "two_object", "counting", "colors", "position",
                               "color_attr")
HARD_TAGS: tuple[str, ...] = ("hard_counted_relation", "hard_three_objects",
                              "hard_counted_colors")
TAGS: tuple[str, ...] = SMALL_TAGS + HARD_TAGS
SHARED_TAGS: tuple[str, ...] = SMALL_TAGS[:4]  # too few prompts to hold out: in train and eval
HARD_SIZE, EVAL_COLOR_ATTR, EVAL_PER_HARD_TAG, TRAIN_SIZE, MIN_HARD_ATOMS = 200, 60, 30, 5000, 5
POOL_SIZE, MIN_POOL_ATOMS = 32, 4
INVERSE = {"right of": "left of", "below": "above"}
Clause = tuple[str, int, str | None]


@dataclass(frozen=True)
class TagGrammar:
    """Prompts of one tag: `objects` distinct shapes, each with a count from `counts`."""

    objects: int
    counts: tuple[int, ...]
    colored: bool
    related: bool


_ANY = tuple(range(1, MAX_COUNT + 1))
GRAMMARS: dict[str, TagGrammar] = {
    "single_object": TagGrammar(1, (1,), False, False),
    "two_object": TagGrammar(2, (1,), False, False),
    "counting": TagGrammar(1, _ANY[1:], False, False),
    "colors": TagGrammar(1, (1,), True, False),
    "position": TagGrammar(2, (1,), False, True),
    "color_attr": TagGrammar(2, (1,), True, False),
    "hard_counted_relation": TagGrammar(2, _ANY, True, True),
    "hard_three_objects": TagGrammar(3, _ANY, True, False),
    "hard_counted_colors": TagGrammar(2, _ANY, True, False),
}


class PromptFileError(ValueError):
    """A prompt file line is malformed; the message names the file and the 1-based line."""


def make_record(tag: str, clauses: list[Clause], relation: str | None = None) -> dict[str, Any]:
    """GenEval record of (shape, count, colour) clauses in prompt order; clauses[0] REL [1]."""
    phrases = [noun_phrase(n, shape, color) for shape, n, color in clauses]
    if relation:
        text = f"{phrases[0]} {relation} {phrases[1]}"
    else:
        text = " and ".join(filter(None, [", ".join(phrases[:-1]), phrases[-1]]))
    include = [{"class": s, "count": n, **({"color": c} if c else {})} for s, n, c in clauses]
    if relation:
        include = [include[1], {**include[0], "position": [relation, 0]}]
    exclude = [{"class": s, "count": n + 1, **({"color": c} if c else {})}
               for s, n, c in clauses if n >= 2]
    return {"tag": tag, "include": include, "exclude": exclude, "prompt": PREFIX + text}


def enumerate_prompts(tag: str) -> list[dict[str, Any]]:
    """Every record of `tag`, in a fixed order (shape order, then colours, counts, relation)."""
    return [_record_of(tag, combination) for combination in _combinations(tag)]


def _combinations(tag: str) -> list[tuple]:
    """(shapes, colours, counts, relation) tuples of `tag`, in enumeration order."""
    if tag not in GRAMMARS:
        raise ValueError(f"unknown tag {tag!r}; use one of {TAGS}")
    g = GRAMMARS[tag]
    return list(itertools.product(
        itertools.permutations(SHAPES, g.objects),
        itertools.product(COLORS if g.colored else (None,), repeat=g.objects),
        itertools.product(g.counts, repeat=g.objects),
        RELATIONS if g.related else (None,)))


def _record_of(tag: str, combination: tuple) -> dict[str, Any]:
    shapes, colors, counts, relation = combination
    return make_record(tag, list(zip(shapes, counts, colors)), relation)


def atom_count(record: dict[str, Any]) -> int:
    """A, the number of atoms in the record's scene graph."""
    return len(graph_from_geneval(record).atoms())


def scene_key(record: dict[str, Any]) -> tuple:
    """Order-free identity of the scene a record asks for ("A right of B" == "B left of A")."""
    include = record["include"]
    items = [(c["class"], c["count"], c.get("color") or "") for c in include]
    positioned = [i for i, c in enumerate(include) if "position" in c]
    if not positioned:
        return tuple(sorted(items)), None
    relation, j = include[positioned[0]]["position"]
    subject, obj = items[positioned[0]], items[j]
    if relation in INVERSE:
        subject, obj, relation = obj, subject, INVERSE[relation]
    return tuple(sorted(items)), (subject, relation, obj)


def sample_prompts(tag: str, n: int, rng: random.Random, *, min_atoms: int = 0,
                   avoid: frozenset = frozenset(), distinct: bool = True) -> list[dict[str, Any]]:
    """n random records of `tag` with >= min_atoms atoms and a scene_key outside `avoid`.

    With `distinct`, no two picked records describe the same scene (only their word order differs).
    """
    pool = _combinations(tag)
    rng.shuffle(pool)
    picked, seen = [], set(avoid)
    for combination in pool:
        if len(picked) == n:
            break
        record = _record_of(tag, combination)
        key = scene_key(record)
        if key not in seen and (min_atoms == 0 or atom_count(record) >= min_atoms):
            picked.append(record)
            if distinct:
                seen.add(key)
    if len(picked) < n:
        raise ValueError(f"only {len(picked)} {tag} prompts have >= {min_atoms} atoms and avoid "
                         f"the given scenes, {n} asked; ask for fewer")
    return picked


def make_splits(seed: int) -> dict[str, list[dict[str, Any]]]:
    """{"train", "eval", "hard"} record lists, deterministic from `seed` (see module docstring)."""
    rng = random.Random(seed)
    small = {tag: enumerate_prompts(tag) for tag in SMALL_TAGS}
    held = sorted(rng.sample(range(len(small["color_attr"])), EVAL_COLOR_ATTR))
    eval_attr = [small["color_attr"][i] for i in held]
    train_attr = [r for i, r in enumerate(small["color_attr"]) if i not in held]
    eval_small = [r for tag in (*SHARED_TAGS, "position") for r in small[tag]] + eval_attr
    train_small = [r for tag in SHARED_TAGS for r in small[tag]] + train_attr
    hard_sizes = _even_split(HARD_SIZE, len(HARD_TAGS))
    train_sizes = _even_split(TRAIN_SIZE - len(train_small), len(HARD_TAGS))
    hard, eval_hard, train_hard = [], [], []
    used = {scene_key(r) for r in eval_small + train_small}
    for tag, n_hard, n_train in zip(HARD_TAGS, hard_sizes, train_sizes):
        picked = sample_prompts(tag, n_hard + EVAL_PER_HARD_TAG, rng, min_atoms=MIN_HARD_ATOMS,
                                avoid=frozenset(used))
        hard += picked[:n_hard]
        eval_hard += picked[n_hard:]
        used |= {scene_key(r) for r in picked}
        train_hard += sample_prompts(tag, n_train, rng, avoid=frozenset(used), distinct=False)
    return {"train": train_small + train_hard, "eval": eval_small + eval_hard, "hard": hard}


def _even_split(total: int, parts: int) -> list[int]:
    return [total // parts + (i < total % parts) for i in range(parts)]


def make_pool(train: list[dict[str, Any]], held_out: list[dict[str, Any]], size: int = POOL_SIZE,
              min_atoms: int = MIN_POOL_ATOMS) -> list[dict[str, Any]]:
    """`size` records of `train` (the module docstring's pool rules), tags interleaved."""
    texts = {r["prompt"] for r in held_out}
    scenes = {scene_key(r) for r in held_out}
    picks = []
    for tag, k in zip(HARD_TAGS, _even_split(size, len(HARD_TAGS))):
        candidates, seen = [], set(scenes)
        for r in train:
            key = scene_key(r)
            if (r["tag"] == tag and r["prompt"] not in texts and key not in seen
                    and atom_count(r) >= min_atoms):
                candidates.append(r)
                seen.add(key)
        if len(candidates) < k:
            raise ValueError(f"only {len(candidates)} {tag} train prompts qualify for the pool, "
                             f"{k} asked; ask for a smaller pool")
        picks.append([candidates[i * len(candidates) // k] for i in range(k)])
    return [tag_picks[i] for i in range(max(map(len, picks))) for tag_picks in picks
            if i < len(tag_picks)]


def load_prompt_file(path: str | Path) -> list[dict[str, Any]]:
    """Records of a shapes-world JSONL prompt file, each line checked (see `check_record`)."""
    records = []
    for line_no, line in utf8_lines(path):
        try:
            records.append(check_record(json.loads(line)))
        except ValueError as err:
            raise PromptFileError(f"{path}, line {line_no}: {err}") from err
    return records


def utf8_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of each line of a UTF-8 file; a line that is not UTF-8 raises
    PromptFileError naming the file, the line and the first bad byte."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise PromptFileError(f"{path}, line {line_no}: byte {raw[err.start]:#04x} "
                                      f"(byte {err.start + 1} of the line) is not UTF-8; save "
                                      "the file as UTF-8") from None
            yield line_no, text


def check_record(record: Any) -> dict[str, Any]:
    """Return `record` when it is a valid shapes-world record, else raise ValueError."""
    if not isinstance(record, dict) or not {"tag", "include", "prompt"} <= record.keys():
        raise ValueError("each line must be a JSON object with 'tag', 'include' and 'prompt'")
    unknown = sorted(record.keys() - {"tag", "include", "exclude", "prompt"})
    if unknown or record["tag"] not in TAGS or not isinstance(record["prompt"], str):
        raise ValueError(f"unknown keys {unknown}, tag {record['tag']!r} or non-str prompt; "
                         f"tags are {TAGS}")
    include, exclude = record["include"], record.get("exclude", [])
    if not isinstance(include, list) or not include or not isinstance(exclude, list):
        raise ValueError("'include' must be a non-empty list of clauses, 'exclude' a list")
    for clause in include:
        _check_clause(clause, 1, MAX_COUNT, {"class", "count", "color", "position"})
    for clause in exclude:
        _check_clause(clause, 2, MAX_COUNT + 1, {"class", "count", "color"})
    if parse_prompt(record["prompt"], record["tag"]) != graph_from_geneval(record):
        raise ValueError(f"prompt {record['prompt']!r} does not match its 'include' clauses")
    return record


def _check_clause(clause: Any, low: int, high: int, keys: set[str]) -> None:
    """Keys, class, colour and count range of one clause; graph_from_geneval checks positions."""
    if not isinstance(clause, dict) or not clause.keys() <= keys:
        raise ValueError(f"clause {clause!r} must be an object with keys from {sorted(keys)}")
    if clause.get("class") not in SHAPES:
        raise ValueError(f"clause {clause!r}: unknown class; use one of {SHAPES}")
    if "color" in clause and clause["color"] not in COLORS:
        raise ValueError(f"clause {clause!r}: unknown colour; use one of {COLORS}")
    count = clause.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or not low <= count <= high:
        raise ValueError(f"clause {clause!r}: count must be an int in {low}..{high}")
