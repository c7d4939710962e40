"""The advantage stage's pure parts on plain inputs: rows -> AtomBatch -> BatchCredit -> rows."""

import dataclasses
import random

import pytest
import torch

from cast_core.batch_credit import AtomBatch, CreditConfig, batch_credit
from cast_core.csg.graph import ATOM_TYPES
from tasks.stages.compute_advantages import advantage_rows, atom_batch, credit_config
from tasks.stages.recipe_method import AdvantageSection

G, HW = 4, 4


def _rows(scores: dict[str, list[list[float]]], heat=None) -> list[dict]:
    """atom_scores rows: scores[prompt][sample] = one score per atom ("o", "c": object, count)."""
    rows = []
    for pid, samples in scores.items():
        for gi, values in enumerate(samples):
            for atom, kind, s in zip(("o", "c"), ("object", "count"), values):
                h = heat if heat is not None else [1.0] * (HW * HW)
                rows.append({"prompt_id": pid, "sample_index": gi, "atom_id": atom,
                             "atom_type": kind, "score": s, "heatmap": h,
                             "heatmap_h": HW, "heatmap_w": HW})
    return rows


SCORES = {"p0": [[1.0, 0.9], [1.0, 0.1], [0.2, 0.8], [1.0, 0.3]],
          "p1": [[0.6, 0.2], [0.9, 0.7], [0.1, 0.4], [0.8, 0.9]]}
PARENTS = {(p, "o"): [] for p in SCORES} | {(p, "c"): ["o"] for p in SCORES}


def test_atom_batch_reads_later_samples_in_any_order_and_places_parents_and_types():
    rows = _rows(SCORES)
    ids, batch = atom_batch(rows, ["p0", "p1"], G, PARENTS)
    firsts = [r for r in rows if r["sample_index"] == 0]  # they give the atom order
    others = [r for r in rows if r["sample_index"] != 0]
    random.Random(0).shuffle(others)
    shuffled = others[:5] + firsts + others[5:]
    ids2, batch2 = atom_batch(shuffled, ["p0", "p1"], G, PARENTS)
    assert ids == ids2 == [["o", "c"], ["o", "c"]]
    for field in dataclasses.fields(AtomBatch):
        assert torch.equal(getattr(batch, field.name), getattr(batch2, field.name)), field.name
    assert batch.scores[0, 1].tolist() == [1.0, 0.1]
    assert batch.types[0].tolist() == [ATOM_TYPES.index("object"), ATOM_TYPES.index("count")]
    assert batch.parents[0].tolist() == [[False, False], [True, False]]
    assert batch.mask.all()


def test_atom_batch_refuses_a_sample_without_scores():
    rows = [r for r in _rows(SCORES) if (r["prompt_id"], r["sample_index"]) != ("p1", 3)]
    with pytest.raises(ValueError, match=r"missing for \(prompt, sample\) \[\('p1', 3\)\]"):
        atom_batch(rows, ["p0", "p1"], G, PARENTS)


def test_atom_batch_shapes_are_checked():
    with pytest.raises(ValueError, match="heatmaps"):
        AtomBatch(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3, 4), torch.ones(1, 3, dtype=bool),
                  torch.zeros(1, 3, dtype=torch.int64), torch.zeros(1, 3, 3, dtype=bool))


def test_one_atom_with_a_uniform_heatmap_gives_the_scalar_advantage_everywhere():
    """Closed form: with one atom the reward is its score, so the atom z-score is Flow-GRPO's
    scalar advantage, and a uniform heatmap projects it unchanged onto every pixel."""
    scores = torch.tensor([[[0.1], [0.5], [0.9], [0.3]]], dtype=torch.float64)  # [1, G, 1]
    batch = AtomBatch(scores, torch.ones(1, G, 1, HW, HW), torch.ones(1, 1, dtype=torch.bool),
                      torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, 1, dtype=torch.bool))
    credit = batch_credit(batch, CreditConfig(), (2, 2), len(ATOM_TYPES))
    z = (scores[0, :, 0] - scores.mean()) / scores.std(correction=0)
    assert torch.allclose(credit.scalar.advantages[0], z)
    assert torch.allclose(credit.atom, z.float())
    assert torch.allclose(credit.maps, z.float()[:, None, None].expand(G, 2, 2))
    assert torch.allclose(credit.type_maps.sum(1), credit.maps)
    assert credit.type_maps[:, 1:].abs().max() == 0  # every atom is of type 0


def test_gating_zeroes_a_child_whose_parent_is_absent_and_type_maps_sum_to_the_map():
    _, batch = atom_batch(_rows(SCORES), ["p0", "p1"], G, PARENTS)
    credit = batch_credit(batch, CreditConfig(clip=100.0), (2, 2), len(ATOM_TYPES))
    absent = batch.scores[..., 0] < 0.5  # [B, G]: the count's parent object is missing
    assert torch.equal(credit.gated[..., 1], absent)
    assert (credit.advantages[..., 1][absent] == 0).all()
    assert torch.equal(credit.advantages[..., 0], credit.atoms.advantages[..., 0])
    assert torch.allclose(credit.type_maps.sum(1), credit.maps, atol=1e-6)
    ungated = batch_credit(batch, CreditConfig(gate_by_parents=False), (2, 2), len(ATOM_TYPES))
    assert not ungated.gated.any()
    assert torch.equal(ungated.advantages, ungated.atoms.advantages)


def test_advantage_rows_carry_one_row_per_atom_and_one_per_sample():
    ids, batch = atom_batch(_rows(SCORES), ["p0", "p1"], G, PARENTS)
    credit = batch_credit(batch, CreditConfig(), (2, 2), len(ATOM_TYPES))
    adv, maps = advantage_rows({"run_id": "r", "iteration": 3}, ["p0", "p1"], ids, credit,
                               "blobs/x", "h", (2, 2))
    assert len(adv) == 2 * G * 2 and len(maps) == 2 * G
    assert [m["blob_index"] for m in maps] == list(range(2 * G))
    row = next(r for r in adv if (r["prompt_id"], r["sample_index"], r["atom_id"]) == ("p1", 2, "c"))
    assert row["advantage"] == float(credit.advantages[1, 2, 1])
    assert row["gated"] is True and row["iteration"] == 3  # p1 sample 2: object scored 0.1
    assert maps[5]["reward"] == pytest.approx(float(batch.scores[1, 1].mean()))


def test_credit_config_carries_every_advantage_field_but_kind_and_scalar_steps():
    section = AdvantageSection(kind="spatial", atom_norm="pooled", spatial_mix=0.5,
                               heatmap_source="group_others", global_weight=0.0)
    config = credit_config(section)
    assert {f.name for f in dataclasses.fields(CreditConfig)} == set(
        AdvantageSection.model_fields) - {"kind", "scalar_steps"}  # the trainer applies it
    assert (config.atom_norm, config.spatial_mix, config.heatmap_source,
            config.global_weight) == ("pooled", 0.5, "group_others", 0.0)


def test_group_credit_norm_without_gating_is_flowgrpo_exactly():
    """Closed form: with pooled atom z-scores and no gate, a sample's mean atom credit is an
    affine map of its mean atom score R, so its group z-score is Flow-GRPO's advantage."""
    _, batch = atom_batch(_rows(SCORES), ["p0", "p1"], G, PARENTS)
    config = CreditConfig(gate_by_parents=False, atom_norm="pooled", credit_norm="group")
    credit = batch_credit(batch, config, (2, 2), len(ATOM_TYPES))
    scalar = credit.scalar.advantages.reshape(-1).float()
    assert torch.allclose(credit.atom, scalar, atol=1e-6)
    plain = batch_credit(batch, CreditConfig(gate_by_parents=False, atom_norm="pooled"), (2, 2),
                         len(ATOM_TYPES))
    assert not torch.allclose(plain.atom, scalar, atol=1e-3)  # the pooled norm alone is not it


def test_group_credit_norm_centres_the_gated_credit_on_zero_with_unit_spread():
    """Gating removes mostly negative credits (a failed parent's children), so the plain gated
    credit of a group need not sum to 0; after the group norm its per-sample means are z-scores."""
    _, batch = atom_batch(_rows(SCORES), ["p0", "p1"], G, PARENTS)
    plain = batch_credit(batch, CreditConfig(clip=100.0), (2, 2), len(ATOM_TYPES))
    assert plain.atom.view(2, G).sum(1).abs().max() > 0.1
    normed = batch_credit(batch, CreditConfig(clip=100.0, credit_norm="group"), (2, 2),
                          len(ATOM_TYPES))
    c = normed.atom.view(2, G).double()  # [B, G]
    assert torch.allclose(c.mean(1), torch.zeros(2, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(c.std(1, correction=0), torch.ones(2, dtype=torch.float64), atol=1e-6)
    assert torch.equal(normed.gated, plain.gated)


def test_score_gating_ranks_a_missing_object_below_a_wrong_count_and_colour():
    """Gating the credit leaves a sample whose object is missing only the object's negative
    credit, so it can outrank a sample that draws the object with the wrong count and colour
    (with pooled z-scores: whenever the children's means sum to more than 1); gating the score
    fails its children too, so the missing object ranks last (cast_core.advantage)."""
    scores = torch.tensor([[[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.2, 0.2],
                            [1.0, 1.0, 1.0]]], dtype=torch.float64)  # (object, count, colour)
    parents = torch.zeros(1, 3, 3, dtype=torch.bool)
    parents[0, 1, 0] = parents[0, 2, 0] = True
    types = torch.tensor([[ATOM_TYPES.index(t) for t in ("object", "count", "attribute")]])
    batch = AtomBatch(scores, torch.ones(1, G, 3, HW, HW), torch.ones(1, 3, dtype=torch.bool),
                      types, parents)
    on_credit = batch_credit(batch, CreditConfig(atom_norm="pooled"), (2, 2), len(ATOM_TYPES))
    on_score = batch_credit(batch, CreditConfig(atom_norm="pooled", gate_on="score"), (2, 2),
                            len(ATOM_TYPES))
    assert on_credit.rewards[0, 1] > on_credit.rewards[0, 2]  # 1/3 against 0.133
    assert on_credit.atom[2] > on_credit.atom[1]  # yet the missing object ranks above
    assert on_score.atom[2] < on_score.atom[1] < on_score.atom[0]
    assert torch.equal(on_score.gated, on_credit.gated)  # the same samples are gated
    assert on_score.advantages[0, 2, 1] != 0  # the gated score is z-scored, not zeroed
    assert torch.equal(on_score.rewards, on_credit.rewards)  # the scalar reward is ungated
