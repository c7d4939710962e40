"""Data-parallel policy updates: two gloo ranks, each holding only the rows of its own samples
and backpropagating its part of every optimizer step, end on the LoRA and AdamW state of the
single-process update over all the step's samples (to 1e-6), for the spatial (CAST) and the
scalar (Flow-GRPO) SDE objective and for the forward-process (NFT) objective with scalar and map
advantages, with parts of unequal size and an empty one, and over several inner epochs, and
agree on the update's KL; the shard arithmetic itself is checked on plain inputs, and so is what
a rank reads over several inner epochs: about its N / world samples, within a stated bound."""

import pytest
import torch
import torch.multiprocessing as mp

from cast_core.backbones.shapes import ShapesBackbone, ShapesBackboneConfig
from cast_core.data_parallel import SOLO, Shard, arrange_steps, local_rows
from cast_core.lora import add_lora
from cast_core.nft_update import NftConfig, nft_step_indices, nft_update
from cast_core.policy import PolicyConfig, policy_update, step_indices
from cast_core.rollout import RolloutSpec, rollout
from cast_core.update_kl import update_kl_nats
from cast_core.window import SdeWindow

TINY = ShapesBackboneConfig(num_layers=1, num_heads=2, head_dim=8, text_width=16, text_layers=1)
PROMPTS = ["a photo of a red circle"] * 2 + ["a photo of two blue squares"] * 3
SPEC = RolloutSpec(num_steps=4, guidance_scale=1.5, noise_level=0.7, sde_kind="flow_sde",
                   window=SdeWindow(1, 3))
# (objective, steps_per_epoch, kl_beta, inner_epochs): 5 samples in 1 step (parts 3 + 2), in 2
# steps of 3 and 2 (parts 2 + 1 and 1 + 1) with the KL to the reference, in 5 steps of 1 (rank
# 1's part empty), three epochs of 2 steps (the third's shuffle arranged back onto the owners)
CASES = [("scalar", 1, 0.0, 1), ("spatial", 2, 0.1, 1), ("spatial", 5, 0.0, 1),
         ("spatial", 2, 0.0, 3)]
# the rows each rank holds: with one epoch its parts; with three, still its first epoch's (cut in
# the shuffle's order, the third epoch's parts would make them 4 and 3)
CASE_ROWS = [[3, 2], [3, 2], [5, 0], [3, 2]]
# NFT (advantage, steps_per_epoch, inner_epochs): 6 samples (3 groups of 2) in one step (parts
# 3 + 3), a map in 2 steps of 3 (parts 2 + 1), two epochs of 6 steps of 1 (rank 1's parts empty),
# a map in two epochs of 2 steps of 3 (the second epoch's first step arranged: one sample moves)
NFT_PROMPTS = PROMPTS + ["a photo of a green triangle"]
NFT_CASES = [("scalar", 1, 1), ("map", 2, 1), ("scalar", 6, 2), ("map", 2, 2)]
NFT_ROWS = [[3, 3], [4, 2], [6, 0], [5, 3]]


def test_parts_are_contiguous_and_cover_the_step():
    idx = torch.tensor([4, 0, 3, 1, 2])
    shards = [Shard(r, 2) for r in range(2)]
    assert [s.part(idx).tolist() for s in shards] == [[4, 0, 3], [1, 2]]
    assert [s.sizes(5) for s in shards] == [[3, 2], [3, 2]]
    assert Shard(1, 2).part(idx[:1]).tolist() == [] and Shard(0, 3).sizes(1) == [1, 0, 0]
    assert torch.equal(SOLO.part(idx), idx)
    with pytest.raises(ValueError, match="rank < world"):
        Shard(2, 2)
    steps = [torch.tensor([4, 0, 3]), torch.tensor([1, 2])]  # one epoch: the rows partition
    assert [Shard(r, 2).rows(steps).tolist() for r in range(2)] == [[0, 1, 4], [2, 3]]
    assert local_rows(torch.tensor([1, 3]), 5).tolist() == [-1, 0, -1, 1, -1]
    assert torch.equal(local_rows(None, 3), torch.arange(3))


def test_later_epochs_are_arranged_onto_the_first_epochs_ranks():
    """Epoch 1 cuts [3, 0] and [1, 2]: rank 0 owns 3 and 1, rank 1 owns 0 and 2. Epoch 2's
    shuffle [2, 1], [0, 3] is reordered so that each sample returns to its owner ([1, 2],
    [3, 0]); cut as shuffled, each rank would backpropagate all four samples."""
    steps = [torch.tensor(s) for s in ([3, 0], [1, 2], [2, 1], [0, 3])]
    assert [s.tolist() for s in arrange_steps(steps, 2)] == [[3, 0], [1, 2], [1, 2], [3, 0]]
    assert [Shard(r, 2).rows(steps).tolist() for r in range(2)] == [[1, 3], [0, 2]]
    assert arrange_steps(steps, 1) == steps
    # an owner's part full: its third sample goes to the rank with room
    full = [torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 3, 2])]
    assert arrange_steps(full[:1] + [torch.tensor([2, 0, 1, 3])], 2)[1].tolist() == [0, 1, 2, 3]
    assert arrange_steps([torch.tensor([0, 2, 1, 3]), full[0]], 2)[1].tolist() == [0, 2, 1, 3]


def _read_bound(steps: list, shard: Shard, first: int) -> int:
    """The most rows `Shard.rows` may hold (cast_core.data_parallel): the rank's samples of the
    first epoch (the first `first` steps), N_r, plus, per later step, the room its part q has
    after the o samples of its own that the step holds, max(0, q - o)."""
    own = set(torch.cat([shard.part(idx) for idx in steps[:first]]).tolist())
    later = [(shard.sizes(len(idx))[shard.rank], sum(i in own for i in idx.tolist()))
             for idx in steps[first:]]
    return len(own) + sum(max(0, q - o) for q, o in later)


# (N, steps_per_epoch, inner_epochs, world, the most rows a rank reads / (N / world)): the shapes
# recipes' update (128 samples, 2 steps of 64, 2 epochs) on 2 and 4 ranks, 4 epochs of 4 steps
# of a FLUX.2-sized rollout (1152) on 8 ranks, one step an epoch, and a ragged split. Cut in the
# shuffle's order the reads would be about N (1 - (1 - 1/world)^E) / (N / world): 1.5, 1.75,
# 3.3, 3.3, 2.3
READS = [(128, 2, 2, 2, 1.1), (128, 2, 2, 4, 1.25), (1152, 4, 4, 8, 1.25), (1152, 1, 4, 8, 1.0),
         (97, 3, 3, 4, 1.5)]


@pytest.mark.parametrize("n, steps, epochs, world, ratio", READS)
def test_a_rank_reads_about_its_share_over_inner_epochs(n, steps, epochs, world, ratio):
    """Every arranged step holds the shuffle's samples in parts of `Shard.sizes`; the first
    epoch is cut as shuffled and its parts partition the N samples; a rank's rows are its first
    epoch's samples plus at most the later steps' room (`_read_bound`), all of them with one
    step an epoch, and at most `ratio` N / world."""
    config = PolicyConfig(advantage="scalar", clip_range=0.2, steps_per_epoch=steps,
                          inner_epochs=epochs)
    for seed in range(3):
        plan = step_indices(n, config, seed)
        arranged = arrange_steps(plan, world)
        assert [a.sort().values.tolist() for a in arranged] == [
            p.sort().values.tolist() for p in plan]
        assert all(torch.equal(a, p) for a, p in zip(arranged[:steps], plan[:steps]))
        first = [Shard(r, world).rows(plan[:steps]) for r in range(world)]
        assert sorted(torch.cat(first).tolist()) == list(range(n))
        for r in range(world):
            rows = Shard(r, world).rows(plan)
            assert set(first[r].tolist()) <= set(rows.tolist())
            assert len(rows) <= _read_bound(plan, Shard(r, world), steps)
            assert len(rows) <= ratio * n / world
            if steps == 1:
                assert torch.equal(rows, first[r])


def _train(objective: str, steps: int, kl_beta: float, epochs: int, shard: Shard) -> dict:
    """The LoRA, AdamW state and step records after one update of the tiny policy."""
    torch.manual_seed(0)
    model = ShapesBackbone(TINY).eval()
    lora = add_lora(model, rank=2, alpha=2.0)
    with torch.no_grad():  # off B = 0, so both factors get gradients
        for p in lora:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out = rollout(model, PROMPTS, [3, 4, 5, 6, 7], SPEC)
    gen = torch.Generator().manual_seed(1)
    adv = (torch.randn(5, generator=gen) if objective == "scalar"
           else torch.randn(5, 32, 32, generator=gen))
    optimizer = torch.optim.AdamW(lora, lr=1e-2, weight_decay=0.01)
    config = PolicyConfig(advantage=objective, clip_range=0.2, kl_beta=kl_beta,
                          steps_per_epoch=steps, inner_epochs=epochs, micro_batch=2)
    held, split = None, None
    if shard.world > 1:  # the rank holds the rows of its own samples only
        plan = step_indices(len(PROMPTS), config, 5)
        held = shard.rows(plan)
        split = [Shard(r, shard.world).rows(plan[:steps]) for r in range(shard.world)]
        out = out.select(held)
    records = policy_update(model, optimizer, PROMPTS, out, SPEC, adv, config, shuffle_seed=5,
                            shard=shard, held=held)
    moved = update_kl_nats(model, PROMPTS, out, SPEC, micro_batch=2, shard=shard, held=held,
                           split=split).nats
    return {**_state(lora, optimizer), "records": records, "moved": moved,
            "rows": out.latents.shape[0]}


def _state(lora: list, optimizer) -> dict:
    state = optimizer.state_dict()["state"]
    return {"lora": [p.detach().clone() for p in lora],
            "adam": [(s["exp_avg"], s["exp_avg_sq"], float(s["step"])) for s in state.values()]}


def _train_nft(advantage: str, steps: int, epochs: int, shard: Shard) -> dict:
    """The LoRA, AdamW state and step records after one NFT update of the tiny policy."""
    torch.manual_seed(0)
    model = ShapesBackbone(TINY).eval()
    lora = add_lora(model, rank=2, alpha=2.0)
    with torch.no_grad():
        for p in lora:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x0 = rollout(model, NFT_PROMPTS, [3, 4, 5, 6, 7, 8], SPEC).x0
    gen = torch.Generator().manual_seed(1)
    adv = (torch.randn(6, generator=gen) if advantage == "scalar"
           else torch.randn(6, *x0.shape[-2:], generator=gen))
    optimizer = torch.optim.AdamW(lora, lr=1e-2, weight_decay=0.01)
    config = NftConfig(group_size=2, inner_epochs=epochs, steps_per_epoch=steps, micro_batch=2,
                       beta=0.5)
    held = None
    if shard.world > 1:
        held = shard.rows(nft_step_indices(6, config, 9))
        x0 = x0[held]
    records = nft_update(model, optimizer, NFT_PROMPTS, x0, adv, config, 1.5, seed=9,
                         shard=shard, held=held)
    return {**_state(lora, optimizer), "records": records, "rows": x0.shape[0]}


def _rank(rank: int, init: str, results: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        got = ([_train(*case, Shard(rank, 2)) for case in CASES]
               + [_train_nft(*case, Shard(rank, 2)) for case in NFT_CASES])
    finally:
        dist.destroy_process_group()
    torch.save(got, f"{results}.{rank}")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Each case's results on ranks 0 and 1 -> [(rank 0's, rank 1's)]."""
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(_rank, args=(f"file://{tmp / 'rendezvous'}", str(tmp / "out")), nprocs=2)
    got = [torch.load(tmp / f"out.{r}", weights_only=False) for r in range(2)]
    return list(zip(*got))


def _same_state(got: dict, want: dict, steps: int) -> None:
    for a, b in zip(got["lora"], want["lora"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert len(got["adam"]) == len(want["adam"])
    for (m, v, n), (m0, v0, n0) in zip(got["adam"], want["adam"]):
        torch.testing.assert_close(m, m0, rtol=0, atol=1e-6)
        torch.testing.assert_close(v, v0, rtol=0, atol=1e-9)
        assert n == n0 == steps


@pytest.mark.parametrize("case", range(len(CASES)))
def test_two_ranks_take_the_single_process_steps(two_ranks, case):
    want = _train(*CASES[case], SOLO)
    # the ranks hold disjoint rows of the 5 samples, those of their parts
    assert [got["rows"] for got in two_ranks[case]] == CASE_ROWS[case]
    assert want["rows"] == 5
    _, steps, _, epochs = CASES[case]
    for got in two_ranks[case]:
        _same_state(got, want, steps * epochs)
        # A KL between two close policies is a small difference of large log-probs, so its
        # float32 rounding shows at about 1e-4 relative: the solo run alone gives 0.0024360 on 2
        # threads and 0.0024362 on 1 (case 0), and the ranks, whose batches hold other rows,
        # differed from it by up to 1e-4 (torch 2.13, transformers 5.25). The LoRA and Adam state
        # above are checked to 1e-6.
        assert got["moved"] == pytest.approx(want["moved"], rel=5e-4, abs=1e-7)
        for r, r0 in zip(got["records"], want["records"], strict=True):
            assert r.samples == r0.samples and r.skipped == r0.skipped
            for field in ("loss", "grad_norm", "ratio_mean", "clip_fraction"):
                assert getattr(r, field) == pytest.approx(getattr(r0, field), rel=1e-5,
                                                          abs=1e-7), field
            assert r.policy_kl_nats == pytest.approx(r0.policy_kl_nats, rel=5e-4, abs=1e-7)
            assert (r.ref_kl_nats is None) == (r0.ref_kl_nats is None)
    ranks = two_ranks[case]
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["lora"], ranks[1]["lora"]))


@pytest.mark.parametrize("case", range(len(NFT_CASES)))
def test_two_ranks_take_the_single_process_nft_steps(two_ranks, case):
    advantage, steps, epochs = NFT_CASES[case]
    want = _train_nft(advantage, steps, epochs, SOLO)
    ranks = two_ranks[len(CASES) + case]
    assert [got["rows"] for got in ranks] == NFT_ROWS[case]
    for got in ranks:
        _same_state(got, want, steps * epochs)
        for r, r0 in zip(got["records"], want["records"], strict=True):
            assert (r.epoch, r.samples, r.skipped) == (r0.epoch, r0.samples, r0.skipped)
            assert r.positive_share == r0.positive_share
            for field in ("loss", "grad_norm"):
                assert getattr(r, field) == pytest.approx(getattr(r0, field), rel=1e-5,
                                                          abs=1e-7), field
            assert [b is None for b in r.loss_by_t] == [b is None for b in r0.loss_by_t]
            assert ([b for b in r.loss_by_t if b is not None]
                    == pytest.approx([b for b in r0.loss_by_t if b is not None], rel=1e-5,
                                     abs=1e-7))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["lora"], ranks[1]["lora"]))
