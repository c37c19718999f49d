"""DP-SGD on a synthetic "MNIST-like" task: Poisson-sampled batches, per-example clipping,
Gaussian noise, and the privacy spent (ε for a given δ) after each epoch.

    python examples/dp_sgd_mnist_like.py

Ten classes of 8x8 "images": each class is a fixed random template plus pixel noise; a training
set of N_TRAIN examples and a held-out set.  The run is planned first: the noise multiplier is
the one that keeps EPOCHS epochs within TARGET_EPSILON at DELTA (``noise_for_epsilon``, Opacus's
RDP accountant).  Every step draws a batch by Poisson sampling (each example joins with
probability SAMPLE_RATE, so the batch size varies), computes per-example gradients with
functrans (vmap of grad over functional_call), clips each example's total gradient norm to
MAX_NORM, adds N(0, (noise_multiplier * MAX_NORM)^2) noise to the sum, divides by the EXPECTED
batch size (as Opacus does) and lets a plain torch optimizer step.  A ``PrivacyLedger`` counts
the steps and prints the ε spent after each epoch.  Runs in a few seconds on CPU; the printed
loss goes down.  Without Opacus (``pip install functrans[dp]``) it trains with
FALLBACK_NOISE_MULTIPLIER and prints no ε.
"""
import time

import torch
from torch import nn

from functrans.errors import MissingDependencyError
from functrans.nn.dp import (PoissonSampler, PrivacyLedger, assign_grads, dp_sgd_grads,
                             noise_for_epsilon)

MAX_NORM, LR, EPOCHS, N_TRAIN, EXPECTED_BATCH = 1.0, 0.5, 2, 2048, 64
SAMPLE_RATE = EXPECTED_BATCH / N_TRAIN        # 1/32: one epoch is 32 steps
STEPS_PER_EPOCH = round(1 / SAMPLE_RATE)
TARGET_EPSILON, DELTA = 3.0, 1e-5
FALLBACK_NOISE_MULTIPLIER = 1.0


def make_data(n, generator):
    templates = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (n,), generator=generator)
    images = templates[labels] + 0.8 * torch.randn(n, 64, generator=generator)
    return images, labels


def plan():
    """The noise multiplier for EPOCHS epochs within TARGET_EPSILON (None: no Opacus)."""
    try:
        return noise_for_epsilon(target_epsilon=TARGET_EPSILON, sample_rate=SAMPLE_RATE,
                                 steps=EPOCHS * STEPS_PER_EPOCH, delta=DELTA)
    except MissingDependencyError as e:
        print(f"no privacy accounting: {e}")
        return None


def main():
    torch.manual_seed(0)
    data_gen = torch.Generator().manual_seed(1)
    noise_gen = torch.Generator().manual_seed(2)  # the DP noise has its own generator
    x_train, y_train = make_data(N_TRAIN, data_gen)
    x_eval, y_eval = make_data(512, data_gen)
    sampler = PoissonSampler(N_TRAIN, SAMPLE_RATE, steps=STEPS_PER_EPOCH, seed=3)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    loss_fn = nn.functional.cross_entropy

    noise_multiplier = plan()
    ledger = None
    if noise_multiplier is None:
        noise_multiplier = FALLBACK_NOISE_MULTIPLIER
    else:
        ledger = PrivacyLedger("rdp")
        print(f"planned: {EPOCHS} epochs x {STEPS_PER_EPOCH} steps at sample rate "
              f"{SAMPLE_RATE:.5f} within ε = {TARGET_EPSILON} (δ = {DELTA}) need noise "
              f"multiplier {noise_multiplier:.6f}")

    def eval_loss():
        with torch.no_grad():
            out = model(x_eval)
            return loss_fn(out, y_eval).item(), (out.argmax(1) == y_eval).float().mean().item()

    start, step = time.time(), 0
    print(f"step   0  loss {eval_loss()[0]:.4f}")
    for epoch in range(1, EPOCHS + 1):
        sizes, clipped = [], 0
        for idx in sampler:    # a Poisson-sampled batch: its size varies, it may be empty
            step += 1
            grads, norms = dp_sgd_grads(model, loss_fn, (x_train[idx], y_train[idx]),
                                        max_norm=MAX_NORM, noise_multiplier=noise_multiplier,
                                        generator=noise_gen, reduction="sum",
                                        return_norms=True)
            grads = {name: g / sampler.expected_batch_size for name, g in grads.items()}
            opt.zero_grad()
            assign_grads(model, grads)
            opt.step()
            if ledger is not None:
                ledger.step(noise_multiplier=noise_multiplier, sample_rate=SAMPLE_RATE)
            sizes.append(len(idx))
            clipped += int((norms > MAX_NORM).sum())
            if step % 16 == 0:
                loss, acc = eval_loss()
                print(f"step {step:3d}  loss {loss:.4f}  accuracy {acc:.3f}")
        privacy = (f"  ε = {ledger.epsilon(DELTA):.4f} (δ = {DELTA}, RDP)"
                   if ledger is not None else "")
        print(f"epoch {epoch}  {step} steps, batch sizes {min(sizes)}-{max(sizes)}, clipped "
              f"{clipped / max(sum(sizes), 1):.0%} of examples{privacy}")
    print(f"{step} DP-SGD steps in {time.time() - start:.1f} s")


if __name__ == "__main__":
    main()
