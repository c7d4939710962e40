"""Data parallelism for the policy update: each optimizer step's samples split across the ranks
of a torch.distributed process group, every rank stepping on the whole step's gradient.

Variant: plain synchronous data parallelism (DDP's arithmetic without its module wrapper; the
LoRA's gradients are one small bucket, summed once per optimizer step, after the micro-batches).
Every rank holds the same weights and optimizer state and knows every step's m sample indices
`idx` (the same seeded shuffle of the N samples; the update's `step_indices`). Conventions:

- Rank r of `world` takes the r-th of `world` contiguous parts of `idx` (sizes differ by at most
  one; a part may be empty) and backpropagates it in micro-batches, each weighted n / m (n its
  samples, m the whole step's) exactly as one process weights them.
- A step's parts are cut from its indices as `arrange_steps` orders them: the same m samples as
  the single process's step, reordered so that a sample returns to the rank that first
  backpropagated it (its owner) while that rank's part has room, the others filling the parts
  with room in rank order. The first inner epoch keeps the shuffle's order (no sample has an
  owner yet), so its parts partition the N samples. Each later epoch reshuffles, so a step holds
  some number o of a rank's own samples (hypergeometric around its part's size q = m / world):
  cut in the shuffle's order, a rank's parts of E epochs would cover about
  N (1 - (1 - 1/world)^E) samples; arranged, a rank receives only max(0, q - o) samples that are
  not its own per step. The parts keep `Shard.sizes`, so a rank's compute per step is unchanged.
- A rank holds only the rows of the samples it backpropagates (`Shard.rows`: the union of its
  parts over the arranged steps), `held` in sorted sample order; `local_rows` maps a sample
  index to its row there. Rank r holds at most N_r + sum over the later epochs' steps of
  max(0, q - o) rows (N_r its first epoch's samples), exactly its N_r with one optimizer step an
  epoch (then o = q = N_r in every epoch), whatever the epochs. What every sample's statistics
  need (the stored log-probs of a step, the replayed ones) comes from the rank that holds it
  through `gather_rows`.
- `all_reduce_grads` then *sums* the ranks' gradients: the sum is the gradient of the step's mean
  loss over all m samples whatever the parts' sizes. (Averaging over ranks, DDP's default, would
  weight a sample of a smaller part more.)
- `gather_rows` concatenates per-sample results (the replayed log-probs) in rank order, which is
  the arranged `idx` order, so the step's statistics and its finite-loss guard are the single
  process's on every rank; every rank clips the same gradient and takes the same optimizer step,
  so the weights stay equal without being broadcast.

Departure from one process: the same terms summed in another grouping (per rank, then across
ranks, and after the first epoch in the arranged order), so the weights agree to float rounding,
not bitwise, unless the micro-batches line up.
`SOLO` (world 1) communicates nothing, holds every row, and is the single-process update exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Shard:
    """This process's place in the data-parallel group: rank in [0, world)."""

    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"Shard needs 0 <= rank < world: got rank {self.rank} of "
                             f"{self.world}")

    def sizes(self, m: int) -> list[int]:
        """How many of a step's m samples each rank takes: [world], summing to m."""
        return [m // self.world + (r < m % self.world) for r in range(self.world)]

    def part(self, idx: Tensor) -> Tensor:
        """This rank's contiguous part of a step's sample indices idx [m] -> [sizes(m)[rank]]."""
        return torch.tensor_split(idx, self.world)[self.rank]

    def rows(self, steps: Sequence[Tensor]) -> Tensor:
        """The samples this rank backpropagates over an update whose optimizer steps take the
        sample indices `steps` (each [m], as the update shuffles them): the union of its parts
        of the arranged steps (`arrange_steps`), sorted [<= N]."""
        mine = [self.part(idx) for idx in arrange_steps(steps, self.world)]
        return torch.unique(torch.cat(mine)) if mine else torch.zeros(0, dtype=torch.long)


SOLO = Shard(0, 1)


def arrange_steps(steps: Sequence[Tensor], world: int) -> list[Tensor]:
    """Each step's sample indices (each [m], the update's shuffle) reordered for `world` ranks
    so that a sample's part is its owner's (the rank whose part took it first) while that part
    has room (`Shard.sizes`); the samples left fill the parts with room in rank order, in step
    order. The same on every rank; each step keeps its set of samples, and steps where no
    sample has an owner yet (the first inner epoch) keep their order. One rank: `steps`."""
    if world == 1:
        return list(steps)
    owner: dict[int, int] = {}
    arranged = []
    for idx in steps:
        room = Shard(0, world).sizes(len(idx))
        parts: list[list[int]] = [[] for _ in range(world)]
        left = []
        for i in idx.tolist():
            r = owner.get(i)
            if r is not None and len(parts[r]) < room[r]:
                parts[r].append(i)
            else:
                left.append(i)
        for r, part in enumerate(parts):
            take = room[r] - len(part)
            part.extend(left[:take])
            left = left[take:]
            for i in part:
                owner.setdefault(i, r)
        arranged.append(torch.tensor([i for part in parts for i in part], dtype=torch.long))
    return arranged



def local_rows(held: Tensor | None, n: int) -> Tensor:
    """[n]: each sample's row in tensors that hold the samples `held` (sorted indices; None: all
    n, row i = sample i), -1 for a sample not held."""
    if held is None:
        return torch.arange(n)
    local = torch.full((n,), -1, dtype=torch.long)
    local[held.cpu()] = torch.arange(len(held))
    return local


def held_rows(local: Tensor, idx: Tensor) -> Tensor:
    """The rows of samples `idx` (`local_rows`), refusing a sample this rank does not hold."""
    rows = local[idx.cpu()]
    if bool((rows < 0).any()):
        raise ValueError(f"samples {idx[rows < 0].tolist()} are not among this rank's rows; "
                         f"read the rows `Shard.rows` names for the update's steps")
    return rows


def sum_over_ranks(value: float, shard: Shard, device: torch.device) -> float:
    """The sum of a float over the ranks, in float64 on `device` (NCCL's tensors are on the GPU);
    `value` itself on one rank."""
    if shard.world == 1:
        return value
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return float(total)


def all_reduce_grads(params: list[Tensor], shard: Shard) -> None:
    """Sum each parameter's .grad over the ranks in place (one collective per dtype). A grad that
    is None on a rank counts as zero; it stays None only where it is None on every rank."""
    if shard.world == 1:
        return
    import torch.distributed as dist

    device = params[0].device
    present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                           device=device)
    dist.all_reduce(present)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    for dtype in sorted({g.dtype for g in grads}, key=str):
        group = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat)
        for g, summed in zip(group, flat.split([g.numel() for g in group])):
            g.copy_(summed.view_as(g))
    for p, g, count in zip(params, grads, present.tolist()):
        p.grad = g if count else None


def gather_rows(local: Tensor, sizes: list[int]) -> Tensor:
    """Every rank's rows in rank order: local [sizes[rank], ...] -> [sum(sizes), ...]."""
    if len(sizes) == 1:
        return local
    import torch.distributed as dist

    width = max(sizes)
    padded = local.new_zeros((width, *local.shape[1:]))
    padded[: local.shape[0]] = local
    slots = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(slots, padded)
    return torch.cat([slot[:n] for slot, n in zip(slots, sizes)])


def same_on_all_ranks(digest: bytes, device: torch.device) -> bool:
    """Whether every rank passed the same bytes (e.g. the trained LoRA's sha256)."""
    import torch.distributed as dist

    mine = torch.tensor(list(digest), dtype=torch.int64, device=device)
    lowest, highest = mine.clone(), mine.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    dist.all_reduce(highest, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lowest, highest))
