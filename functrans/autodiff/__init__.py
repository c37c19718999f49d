"""Autodiff transforms (grad, vjp, jvp, linearize, jacrev, jacfwd, hessian) on PyTorch autograd.

Imports: nothing (``functrans/__init__.py`` imports each transform from its own module).
"""
