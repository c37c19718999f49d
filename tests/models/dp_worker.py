"""One rank of the 2-process DP-SGD test (launched by tests/models/test_dpsgd.py).

    python -m tests.models.dp_worker RANK WORLD_SIZE INIT_METHOD MODES OUT_DIR

MODES is a comma-separated list of modes, run one after the other in one process group (one
launch for all of them: starting processes is the slow part).  A mode is
* ``allreduce``: ``dp_sgd_grads(..., distributed=True)``: the clipped sums are all-reduced, the
  noise is added once, by rank 0;
* ``ddp``: the model wrapped in ``DistributedDataParallel(static_graph=True)``; each rank
  backwards ``surrogate_loss`` of its local clipped sum (rank 0's with the noise) scaled by the
  world size, so DDP's averaging all-reduce yields the global noisy sum;
* ``allreduce_ghost`` / ``ddp_ghost``: the same with ``method="ghost"`` (the ddp mode's local
  clipped sum from ``dp_sgd_grads(ddp, ..., method="ghost")``, noise on rank 0 only).
Each rank takes its contiguous half of the batch; after STEPS optimizer steps it saves its
parameters to OUT_DIR/<mode>_rank<RANK>.pt.  ``make_problem``/``reference_params`` are the
single-process reference.
"""
import datetime
import os
import sys

import torch
from torch import nn

from functrans.nn.dp import (add_gaussian_noise, assign_grads, clip_and_sum, dp_sgd_grads,
                             per_sample_grads, surrogate_loss)

SEED, BATCH, STEPS = 1234, 8, 2
MAX_NORM, NOISE_MULTIPLIER, LR = 0.5, 1.1, 0.1


def make_problem():
    """(model, inputs, targets): a small MLP and one synthetic batch, the same in every process."""
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(BATCH, 6)
    y = torch.randint(0, 3, (BATCH,))
    return model, x, y


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def reference_params(shard=None):
    """The same STEPS DP-SGD steps in one process on the whole batch (or on rank ``shard``'s
    half only: what a rank would reach without any communication)."""
    model, x, y = make_problem()
    if shard is not None:
        x, y = _shard(x, shard, 2), _shard(y, shard, 2)
    opt = _optimizer(model)
    gen = torch.Generator().manual_seed(SEED)
    for _ in range(STEPS):
        grads = dp_sgd_grads(model, loss_fn, (x, y), max_norm=MAX_NORM,
                             noise_multiplier=NOISE_MULTIPLIER, generator=gen, reduction="mean")
        opt.zero_grad()
        assign_grads(model, grads)
        opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _shard(t, rank, world):
    n = t.shape[0] // world
    return t[rank * n:(rank + 1) * n]


def run(rank, world, init_method, modes, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        for mode in modes:
            params = run_mode(rank, world, mode)
            torch.save(params, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
        # Both ranks are done with every collective before either tears gloo down (a rank
        # that exits while its peer's gloo threads still talk to it was seen to abort with
        # "terminate called without an active exception" under load).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_mode(rank, world, mode):
    """STEPS DP-SGD steps of one MODE on this rank's shard; the final parameters."""
    model, x, y = make_problem()
    batch = (_shard(x, rank, world), _shard(y, rank, world))
    gen = torch.Generator().manual_seed(SEED)  # only rank 0 ever draws from it
    method = "ghost" if mode.endswith("_ghost") else "materialize"
    if mode.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, static_graph=True)
        opt = _optimizer(ddp)
        for _ in range(STEPS):
            if method == "ghost":
                sums = dp_sgd_grads(ddp, loss_fn, batch, max_norm=MAX_NORM,
                                    noise_multiplier=NOISE_MULTIPLIER if rank == 0 else 0.0,
                                    generator=gen, method="ghost")
            else:
                sums, _ = clip_and_sum(per_sample_grads(ddp, loss_fn, batch), MAX_NORM)
                if rank == 0:
                    sums = add_gaussian_noise(sums, NOISE_MULTIPLIER * MAX_NORM,
                                              generator=gen)
            local = {k: g / BATCH for k, g in sums.items()}  # "mean" over the GLOBAL batch
            opt.zero_grad()
            # A forward through the DDP wrapper arms its reducer (the anchor enters as
            # 0 * output); the surrogate puts world * local in p.grad and DDP's average over
            # the ranks turns that into the global sum.
            out = ddp(batch[0])
            surrogate_loss(ddp, local, scale=world, anchor=out).backward()
            opt.step()
    else:
        opt = _optimizer(model)
        for _ in range(STEPS):
            grads = dp_sgd_grads(model, loss_fn, batch, max_norm=MAX_NORM,
                                 noise_multiplier=NOISE_MULTIPLIER, generator=gen,
                                 reduction="mean", distributed=True, method=method)
            opt.zero_grad()
            assign_grads(model, grads)
            opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


if __name__ == "__main__":
    rank, world, init_method, modes, out_dir = sys.argv[1:6]
    run(int(rank), int(world), init_method, modes.split(","), out_dir)
