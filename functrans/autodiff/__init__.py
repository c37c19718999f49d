"""Autodiff transforms (grad, vjp, jvp, linearize, jacrev, jacfwd, hessian) on PyTorch autograd."""
