"""DP-SGD on a synthetic "MNIST-like" task: an MLP, per-example clipping and Gaussian noise.

    python examples/dp_sgd_mnist_like.py

Ten classes of 8x8 "images": each class is a fixed random template plus pixel noise.  Every
step computes per-example gradients with functrans (vmap of grad over functional_call), clips
each example's total gradient norm to MAX_NORM, adds N(0, (NOISE_MULTIPLIER * MAX_NORM)^2)
noise to the sum, averages over the batch and lets a plain torch optimizer step.
Runs in a few seconds on CPU; the printed loss goes down.
"""
import time

import torch
from torch import nn

from functrans.nn.dp import assign_grads, dp_sgd_grads

MAX_NORM, NOISE_MULTIPLIER, BATCH, STEPS, LR = 1.0, 1.0, 64, 60, 0.5


def make_data(n, generator):
    templates = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = templates[labels] + 0.8 * torch.randn(n, 64, generator=generator)
    return images, labels


def main():
    torch.manual_seed(0)
    data_gen = torch.Generator().manual_seed(1)
    noise_gen = torch.Generator().manual_seed(2)  # the DP noise has its own generator
    x_eval, y_eval = make_data(512, data_gen)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    loss_fn = nn.functional.cross_entropy

    def eval_loss():
        with torch.no_grad():
            out = model(x_eval)
            return loss_fn(out, y_eval).item(), (out.argmax(1) == y_eval).float().mean().item()

    start = time.time()
    print(f"step   0  loss {eval_loss()[0]:.4f}")
    for step in range(1, STEPS + 1):
        x, y = make_data(BATCH, data_gen)
        grads, norms = dp_sgd_grads(model, loss_fn, (x, y), max_norm=MAX_NORM,
                                    noise_multiplier=NOISE_MULTIPLIER, generator=noise_gen,
                                    reduction="mean", return_norms=True)
        opt.zero_grad()
        assign_grads(model, grads)
        opt.step()
        if step % 10 == 0:
            loss, acc = eval_loss()
            clipped = (norms > MAX_NORM).float().mean().item()
            print(f"step {step:3d}  loss {loss:.4f}  accuracy {acc:.3f}  "
                  f"clipped {clipped:.0%} of examples")
    print(f"{STEPS} DP-SGD steps in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
