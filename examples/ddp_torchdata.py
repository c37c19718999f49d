"""DP-SGD under DistributedDataParallel(static_graph=True), fed by a torchdata.nodes pipeline.

    torchrun --nproc_per_node=2 examples/ddp_torchdata.py --out ddp.pt   # 2 gloo processes, CPU
    python examples/ddp_torchdata.py --out one.pt                        # 1 process: the reference

The two runs end with the same parameters (up to float summation order): every step, the two
ranks' local batches are disjoint and together are exactly the batch the single process takes.

The pipeline (``make_loader``), the same code on every rank::

    SamplerWrapper(DistributedSampler(shuffle=True, seed=SEED, drop_last=True))  indices
      -> Mapper(dataset.__getitem__)                                             examples
      -> Batcher(global_batch // world_size, drop_last=True)                     local batches
      -> Mapper(collate)                                                         stacked tensors
      -> Prefetcher(2)                                                           a thread ahead
      -> Loader                                                                  one pass/epoch

Why the union over ranks is the single-process batch: ``DistributedSampler`` draws ONE
permutation ``perm`` of the dataset from ``seed + epoch`` (the same on every rank: the seed is
shared; ``SamplerWrapper`` calls ``set_epoch`` at each new epoch) and gives rank ``r`` the
positions ``r, r + W, r + 2W, ...``.  Rank ``r``'s step-``k`` batch of ``b = B / W`` examples is
then ``perm`` at the positions of ``[k*B, (k+1)*B)`` congruent to ``r`` mod ``W``, and the ``W``
ranks together hold ``perm[k*B:(k+1)*B]``: the step-``k`` batch of one process with batch ``B``.
Every rank and the single process take ``floor(N / B)`` full steps per epoch (the tail is
dropped everywhere).

One DP-SGD step (``functrans.nn.dp``'s building blocks): each rank computes per-example
gradients of its local batch with ``vmap(grad)`` (``per_sample_grads``), clips each example's
total gradient to ``--max-norm`` and sums (``clip_and_sum``); rank 0 alone adds the Gaussian
noise ``N(0, (noise_multiplier * max_norm)^2)`` from a seeded generator; the sum is divided by
the GLOBAL batch size.  DDP then all-reduces it: each rank backwards ``surrogate_loss`` of its
local part times the world size, anchored to a forward through the DDP wrapper (which arms
DDP's reducer), and DDP's averaging all-reduce leaves the global noisy mean in every ``p.grad``.
A plain ``torch.optim.SGD`` steps.  Without torchrun (no ``WORLD_SIZE`` in the environment) the
script runs ``dp_sgd_grads(..., reduction="mean")`` in one process instead, as the reference.

It prints, per epoch, the loss and accuracy on the whole dataset (rank 0), and the ε spent so
far if ``functrans.nn.dp`` has ``privacy_spent`` and its accountant is installed (computed for
Poisson sampling at rate ``B / N``; shuffled fixed-size batches, as here, are the usual
approximation of it, not a formal guarantee).  ``--out`` receives the final parameters
(``torch.save`` of ``{name: tensor}``, written by rank 0).  A few seconds on a CPU.

Several machines: the same script, with torchrun's ``--nnodes`` (see the README); the global
batch size must be divisible by the total number of processes.
"""
import argparse
import datetime
import os
import time

import torch
from torch import nn

from functrans.nn import dp
from functrans.nn.dp import (add_gaussian_noise, assign_grads, clip_and_sum, dp_sgd_grads,
                             per_sample_grads, surrogate_loss)

TORCHDATA_HINT = ("this example needs torchdata: pip install --no-deps torchdata==0.11.0 (keeps "
                  "the installed torch), or bash scripts/setup.sh dev")


class SyntheticDataset:
    """``n`` examples ``(x, y)``: 16 features; the class (of 4) is the argmax of a fixed linear
    map of ``x`` plus noise.  The same on every rank (built from ``seed`` alone)."""

    def __init__(self, n=512, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=gen)
        w = torch.randn(16, 4, generator=gen)
        self.y = (self.x @ w + 0.5 * torch.randn(n, 4, generator=gen)).argmax(1)

    def __len__(self):
        return self.x.shape[0]

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def collate(examples):
    """A list of tuples of tensors -> a tuple of stacked tensors (one row per example)."""
    return tuple(torch.stack(field) for field in zip(*examples))


def make_loader(dataset, *, global_batch, rank, world_size, seed, prefetch=2):
    """The torchdata.nodes pipeline of rank ``rank`` of ``world_size`` (see the module
    docstring): an iterable of local batches ``(x, y)`` of ``global_batch // world_size``
    examples each, one pass per ``iter()``, reshuffled (with ``seed + epoch``) at each pass."""
    try:
        from torchdata.nodes import Batcher, Loader, Mapper, Prefetcher, SamplerWrapper
    except ImportError as e:
        raise ImportError(TORCHDATA_HINT) from e
    from torch.utils.data import DistributedSampler
    if global_batch % world_size:
        raise ValueError(f"--batch-size={global_batch} (the global batch) must be divisible by "
                         f"the number of processes, {world_size}: every rank takes an equal part")
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True,
                                 seed=seed, drop_last=True)
    node = SamplerWrapper(sampler)                    # indices; set_epoch at every new pass
    node = Mapper(node, dataset.__getitem__)          # examples
    node = Batcher(node, batch_size=global_batch // world_size, drop_last=True)
    node = Mapper(node, collate)                      # (x, y), stacked
    node = Prefetcher(node, prefetch_factor=prefetch)  # the next batches, prepared by a thread
    return Loader(node)


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def loss_fn(out, y):
    return nn.functional.cross_entropy(out, y)


def epsilon(args, steps, n):
    """ε after ``steps`` steps, if functrans.nn.dp can account (None otherwise)."""
    privacy_spent = getattr(dp, "privacy_spent", None)
    if privacy_spent is None or steps == 0:
        return None
    try:
        return privacy_spent(noise_multiplier=args.noise_multiplier,
                             sample_rate=args.batch_size / n, steps=steps, delta=args.delta)
    except ImportError:   # the accountant's package (Opacus) is not installed
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="where to torch.save the final parameters {name: tensor}")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="the GLOBAL batch size")
    p.add_argument("--examples", type=int, default=512, help="size of the synthetic dataset")
    p.add_argument("--max-norm", type=float, default=1.0)
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    distributed = "WORLD_SIZE" in os.environ       # set by torchrun
    if distributed:
        import torch.distributed as dist
        # env:// reads MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE, as torchrun sets them
        dist.init_process_group("gloo", init_method="env://",
                                timeout=datetime.timedelta(seconds=60))
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    try:
        train(args, rank, world, distributed)
    finally:
        if distributed:
            dist.barrier()   # every collective done on every rank before gloo is torn down
            dist.destroy_process_group()


def train(args, rank, world, distributed):
    data = SyntheticDataset(args.examples, seed=args.seed)
    loader = make_loader(data, global_batch=args.batch_size, rank=rank, world_size=world,
                         seed=args.seed)
    model = make_model(args.seed)
    noise_gen = torch.Generator().manual_seed(args.seed + 1)   # only rank 0 draws from it
    std = args.noise_multiplier * args.max_norm
    if distributed:
        from torch.nn.parallel import DistributedDataParallel
        net = DistributedDataParallel(model, static_graph=True)
    else:
        net = model
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.5)

    def report(epoch, steps, seen):
        with torch.no_grad():
            out = model(data.x)
            loss = loss_fn(out, data.y).item()
            acc = (out.argmax(1) == data.y).float().mean().item()
        eps = epsilon(args, steps, len(data))
        eps = "" if eps is None else f"  ε {eps:.2f} (δ={args.delta:g})"
        if rank == 0:
            print(f"epoch {epoch}  loss {loss:.4f}  accuracy {acc:.3f}{eps}  "
                  f"[{steps} steps; {seen} examples on rank 0 of {world}]", flush=True)

    start, steps = time.time(), 0
    report(0, 0, 0)
    for epoch in range(1, args.epochs + 1):
        seen = 0
        for x, y in loader:
            seen += x.shape[0]
            if distributed:
                sums, _ = clip_and_sum(per_sample_grads(net, loss_fn, (x, y)), args.max_norm)
                if rank == 0:
                    sums = add_gaussian_noise(sums, std, generator=noise_gen)
                local = {k: g / args.batch_size for k, g in sums.items()}
                opt.zero_grad()
                # the forward through DDP arms its reducer; the surrogate's backward puts
                # world * local in p.grad, and DDP's average over the ranks makes it the sum
                anchor = net(x)
                surrogate_loss(net, local, scale=world, anchor=anchor).backward()
            else:
                grads = dp_sgd_grads(model, loss_fn, (x, y), max_norm=args.max_norm,
                                     noise_multiplier=args.noise_multiplier,
                                     generator=noise_gen, reduction="mean")
                opt.zero_grad()
                assign_grads(model, grads)
            opt.step()
            steps += 1
        report(epoch, steps, seen)

    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    if distributed:   # DDP keeps the replicas equal; check it, cheaply
        import torch.distributed as dist
        flat = torch.cat([p.reshape(-1) for p in params.values()])
        ref = flat.clone()
        dist.broadcast(ref, src=0)
        if not torch.equal(flat, ref):
            raise RuntimeError(f"rank {rank}'s parameters differ from rank 0's")
    if rank == 0:
        print(f"{steps} DP-SGD steps of {args.batch_size} examples on {world} process"
              f"{'es' if world > 1 else ''} in {time.time() - start:.1f} s"
              + (" (parameters identical on every rank)" if distributed else ""), flush=True)
        if args.out:
            torch.save(params, args.out)


if __name__ == "__main__":
    main()
