"""The embedded backbone: real diffusers/transformers classes, save/load, sampling, LoRA, training."""

import json

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.sampling import sample_ode
from cast_core.shapes.pretrain import PretrainConfig, make_batch, sample_t, tag_probabilities
from tasks.stages.pretrain_shapes import pretrain_shapes

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
RECORD = {"tag": "hard_counted_relation", "prompt": "a photo of two red circles left of a blue square",
          "include": [{"class": "square", "count": 1, "color": "blue"},
                      {"class": "circle", "count": 2, "color": "red", "position": ["left of", 0]}],
          "exclude": [{"class": "circle", "count": 3, "color": "red"}]}


@pytest.fixture(scope="module")
def tiny() -> ShapesBackbone:
    torch.manual_seed(0)
    return ShapesBackbone(TINY).eval()


def test_tokenizer_knows_the_grammar_and_marks_unknown_words(tiny):
    ids = tiny.tokenizer("a photo of two red circles , a blue square").input_ids
    assert tiny.tokenizer.unk_token_id not in ids and ids[0] == tiny.tokenizer.bos_token_id
    assert tiny.tokenizer.unk_token_id in tiny.tokenizer("a photo of a giraffe").input_ids


def test_velocity_shapes_and_cfg_formula(tiny):
    x = torch.randn(3, 3, 32, 32)
    t = torch.tensor([1.0, 0.5, 0.1])
    cond = tiny.encode_prompts(["a photo of a circle"] * 3)
    uncond = tiny.encode_prompts([""] * 3)
    with torch.no_grad():
        v_c = tiny.velocity(x, t, cond)
        v_u = tiny.velocity(x, t, uncond)
        v_g = tiny.velocity(x, t, cond, guidance_scale=4.0, uncond=uncond)
    assert v_c.shape == x.shape
    torch.testing.assert_close(v_g, v_u + 4.0 * (v_c - v_u), rtol=1e-5, atol=1e-5)


def test_sigmas_are_linear_or_shifted():
    assert torch.allclose(ShapesBackbone(TINY).sigmas(4), torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]))
    shifted = ShapesBackbone(ShapesBackboneConfig(**{**TINY.__dict__, "shift": 3.0})).sigmas(4)
    t = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    torch.testing.assert_close(shifted, 3 * t / (1 + 2 * t))


def test_save_load_round_trip_gives_identical_samples(tiny, tmp_path):
    tiny.save_pretrained(tmp_path / "m")
    assert (tmp_path / "m" / "transformer" / "diffusion_pytorch_model.safetensors").exists()
    assert json.loads((tmp_path / "m" / "cast_backbone.json").read_text())["family"] == "shapes"
    loaded = ShapesBackbone.from_pretrained(tmp_path / "m").eval()
    prompts, seeds = ["a photo of a red circle", "a photo of two squares"], [1, 2]
    a = sample_ode(tiny, prompts, seeds, num_steps=3, guidance_scale=2.0)
    b = sample_ode(loaded, prompts, seeds, num_steps=3, guidance_scale=2.0)
    assert torch.equal(a, b)


def test_samples_depend_on_seed_not_batch_position(tiny):
    a = sample_ode(tiny, ["a photo of a circle", "a photo of a square"], [5, 6], 3, 1.0)
    b = sample_ode(tiny, ["a photo of a square"], [6], 3, 1.0)
    torch.testing.assert_close(a[1:], b, rtol=1e-5, atol=1e-5)


def test_lora_on_target_modules_trains_only_adapters():
    model = ShapesBackbone(ShapesBackboneConfig(**{**TINY.__dict__, "num_layers": 2}))
    config = LoraConfig(r=4, lora_alpha=4, target_modules=list(model.lora_target_modules),
                        init_lora_weights="gaussian")
    inject_adapter_in_model(config, model.transformer)
    lora = [n for n, _ in model.transformer.named_parameters() if "lora_A" in n]
    for target in model.lora_target_modules:  # every target is found (the last SD3 block has no
        assert any(f".{target}.lora_A" in n for n in lora), target  # to_add_out: 2 layers here)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(2, 3, 32, 32)
    v = model.velocity(x, torch.tensor([0.7, 0.3]), model.encode_prompts(["a photo of a circle"] * 2))
    v.pow(2).mean().backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed), sorted(changed)[:5]
    assert get_peft_model_state_dict(model.transformer)


def test_batches_are_deterministic_per_step_and_cfg_dropout_applies():
    by_tag = {"hard_counted_relation": [RECORD]}
    config = PretrainConfig(steps=2, batch_size=40, cfg_dropout=0.5)
    a, b = make_batch(by_tag, config, 3), make_batch(by_tag, config, 3)
    assert torch.equal(a.x0, b.x0) and a.prompts == b.prompts
    assert not torch.equal(a.x0, make_batch(by_tag, config, 4).x0)
    assert 5 < a.prompts.count("") < 35
    assert a.x0.min() >= -1 and a.x0.max() <= 1


def _two_tags() -> dict[str, list[dict]]:
    single = {"tag": "single_object", "include": [{"class": "circle", "count": 1}], "exclude": [],
              "prompt": "a photo of a circle"}
    return {"hard_counted_relation": [RECORD], "single_object": [single]}


def test_tag_weights_set_the_tag_frequencies_and_uniform_is_unchanged():
    by_tag = _two_tags()
    uniform = PretrainConfig(batch_size=400, cfg_dropout=0.0)
    weighted = PretrainConfig(batch_size=400, cfg_dropout=0.0, tag_weights=(("single_object", 3.0),))
    assert tag_probabilities(sorted(by_tag), uniform) is None
    assert tag_probabilities(sorted(by_tag), weighted).tolist() == [0.25, 0.75]
    share = make_batch(by_tag, weighted, 0).prompts.count("a photo of a circle") / 400
    assert 0.70 < share < 0.80  # binomial(400, 0.75): sd 0.022
    assert 0.42 < make_batch(by_tag, uniform, 0).prompts.count("a photo of a circle") / 400 < 0.58


def test_tag_weights_reject_unknown_tags_negative_and_all_zero_weights():
    with pytest.raises(ValueError, match="does not have: \\['single_objects'\\]"):
        tag_probabilities(["single_object"], PretrainConfig(tag_weights=(("single_objects", 2.0),)))
    with pytest.raises(ValueError, match="finite and >= 0"):
        PretrainConfig(tag_weights=(("single_object", -1.0),))
    with pytest.raises(ValueError, match="every tag weight 0"):
        tag_probabilities(["single_object"], PretrainConfig(tag_weights=(("single_object", 0.0),)))


def test_pretrain_command_parses_tag_weights_and_explains_a_bad_pair():
    from flows.pretrain_shapes import main, parse_tag_weights

    assert parse_tag_weights(["single_object=3", "colors=0.5"]) == {"single_object": 3.0,
                                                                    "colors": 0.5}
    with pytest.raises(SystemExit):
        main(["--no-prefect", "--tag-weights", "single_object:3"])


def test_training_times_lie_in_the_open_interval():
    t = sample_t(10_000, 0.2, torch.Generator().manual_seed(0))
    assert t.min() > 0 and t.max() < 1
    assert abs(float(t.mean()) - 0.5) < 0.02


def test_training_time_shift_is_the_sd3_map_of_the_same_draws():
    plain = sample_t(1000, 0.2, torch.Generator().manual_seed(3))
    shifted = sample_t(1000, 0.2, torch.Generator().manual_seed(3), shift=3.0)
    expected = (3 * plain / (1 + 2 * plain)).clamp(1e-4, 1 - 1e-4)
    assert torch.allclose(shifted, expected, atol=1e-6)
    assert float(shifted.median()) > 0.7  # the median 0.5 maps to 0.75


def test_resumed_training_equals_uninterrupted(tmp_path):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps(RECORD) + "\n")
    config = PretrainConfig(steps=4, batch_size=4, warmup_steps=2)
    straight = pretrain_shapes(str(prompts), str(tmp_path / "a"), str(tmp_path / "wa"), config, TINY,
                               save_every=2)
    stopped = pretrain_shapes(str(prompts), str(tmp_path / "b"), str(tmp_path / "wb"), config, TINY,
                              save_every=2, stop_after=2)
    assert stopped["stopped_at"] == 2 and not (tmp_path / "b").exists()
    resumed = pretrain_shapes(str(prompts), str(tmp_path / "b"), str(tmp_path / "wb"), config, TINY,
                              save_every=2)
    assert np.isfinite(straight["final_loss"]) and straight["final_loss"] == resumed["final_loss"]
    a = ShapesBackbone.from_pretrained(tmp_path / "a").state_dict()
    b = ShapesBackbone.from_pretrained(tmp_path / "b").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    summary = json.loads((tmp_path / "b" / "training.json").read_text())
    assert [s["to_step"] for s in summary["segments"]] == [2, 4]


def test_init_from_continues_from_saved_weights(tmp_path, tiny):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps(RECORD) + "\n")
    tiny.save_pretrained(tmp_path / "start")
    config = PretrainConfig(steps=1, batch_size=2, warmup_steps=1, lr=1e-12, ema_decay=0.5)
    pretrain_shapes(str(prompts), str(tmp_path / "out"), str(tmp_path / "w"), config, TINY,
                    init_from=str(tmp_path / "start"))
    out = ShapesBackbone.from_pretrained(tmp_path / "out").state_dict()
    start = tiny.state_dict()
    # a vanishing learning rate keeps the weights where they started (not a fresh random init)
    assert all(torch.allclose(out[k], start[k], atol=1e-6) for k in start)


def test_pretrain_command_sets_the_architecture_and_refuses_it_with_init_from(tmp_path):
    from flows.pretrain_shapes import main

    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps(RECORD) + "\n")
    common = ["--no-prefect", "--train-file", str(prompts), "--steps", "1", "--batch-size", "2",
              "--warmup-steps", "1", "--threads", "1"]
    main([*common, "--patch-size", "2", "--layers", "1", "--out", str(tmp_path / "out"),
          "--work-dir", str(tmp_path / "w")])
    model = ShapesBackbone.from_pretrained(tmp_path / "out")
    assert (model.config.patch_size, model.config.num_layers) == (2, 1)
    with pytest.raises(SystemExit):
        main([*common, "--patch-size", "2", "--init-from", str(tmp_path / "out"),
              "--out", str(tmp_path / "out2"), "--work-dir", str(tmp_path / "w2")])
