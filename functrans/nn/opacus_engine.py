"""functrans as Opacus's per-sample-gradient engine: Opacus's ``GradSampleModule`` computes the
per-sample gradients of the layers it has no grad sampler for with functrans.

Opacus 1.6's ``GradSampleModule`` hooks every module with trainable parameters of its own; a
layer without a hand-written grad sampler (an RNN Opacus does not know, a custom layer; or every
layer with ``force_functorch=True``) goes through opacus/grad_sample/functorch.py:
``prepare_layer`` builds, once per layer and when the ``GradSampleModule`` is built, the
function ``layer.ft_compute_sample_grad = vmap(grad(loss), in_dims=(None, 0, 0))`` over a
stateless copy of the layer (``make_functional``, which calls ``functional_call``), and the
backward hook calls it on the layer's captured inputs and output gradients.  ``vmap``, ``grad``
and ``make_functional`` are looked up in that module's namespace when ``prepare_layer`` runs.

What this module owns: pointing those three names at functrans (``functrans.vmap``,
``functrans.grad``, a ``make_functional`` on ``functrans.functional_call``, line for line
Opacus's own otherwise) and putting Opacus's own back: ``use_functrans()`` (a ``with`` block),
``install()`` / ``uninstall()`` (process-wide), ``functrans_layers()`` (which layers of a model
functrans serves).  It edits no Opacus file; every function it builds counts its calls
(``FunctransEngine.calls``), so a test can see that functrans did the work.

Binding happens when a layer is PREPARED, i.e. when ``GradSampleModule(model)`` is built: build
it inside the block (or after ``install()``); the layers keep their functrans functions after
the block ends, and layers prepared outside keep Opacus's torch.func ones.  Layers that Opacus
has a grad sampler for (``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding``, ``nn.LayerNorm``,
``RNNLinear``, ...) keep it unless ``force_functorch=True``.  Opacus's constraints still hold:
a hooked layer has no buffers, takes its data as its first input (only ``forward_input[0]``
is captured) and returns one tensor; and ``GradSampleModule`` hooks a module that has
trainable parameters of its OWN as one layer (its children go into the same per-sample
function), so wrap e.g. an ``nn.GRU`` (which returns a tuple) in a module with a parameter of
its own, such as a learned initial state, that returns a tensor.

Opacus is optional (``pip install functrans[dp]``, or ``pip install --no-deps opacus==1.6.0
scipy opt_einsum``): it is imported inside the functions; without it they raise
``MissingDependencyError`` (an ``ImportError``) saying what to install.

Imports: errors, batching.api, autodiff.grad, stateless.
"""
from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ..autodiff.grad import grad
from ..batching.api import vmap
from ..errors import MissingDependencyError, TransformArgumentError
from .stateless import functional_call

__all__ = ["FunctransEngine", "use_functrans", "install", "uninstall", "installed",
           "functrans_layers", "OPACUS_VERSION"]

OPACUS_VERSION = "1.6.0"   # the version this adapter follows (scripts/setup.sh's pin)
_NAMES = ("vmap", "grad", "make_functional")
_lock = threading.Lock()
_installed: Optional["FunctransEngine"] = None


def _opacus_functorch(api: str) -> Any:
    """opacus.grad_sample.functorch, or a MissingDependencyError that says what to install."""
    try:
        # opacus ships no type information (and mypy may run without it): hence the ignore
        from opacus.grad_sample import functorch as ofunctorch  # type: ignore
    except ImportError as e:
        raise MissingDependencyError(
            f"{api}: functrans.nn.opacus_engine needs the optional 'opacus' package, which is "
            f"not installed. Install it with `pip install functrans[dp]` (or `pip install "
            f"--no-deps opacus=={OPACUS_VERSION} scipy opt_einsum`, which leaves torch as it "
            f"is).") from e
    return ofunctorch


def _make_functional(mod: nn.Module, disable_autograd_tracking: bool = False
                     ) -> Tuple[Callable[..., Any], Tuple[torch.Tensor, ...]]:
    """Opacus's ``make_functional`` (opacus/grad_sample/functorch.py) line for line, with
    ``functrans.functional_call`` where Opacus calls ``torch.func.functional_call``."""
    params_dict = dict(mod.named_parameters())
    params_names = list(params_dict.keys())
    params_values: Tuple[torch.Tensor, ...] = tuple(params_dict.values())
    stateless_mod = copy.deepcopy(mod)
    stateless_mod.to("meta")
    if hasattr(stateless_mod, "allow_grad_accumulation"):
        getattr(stateless_mod, "allow_grad_accumulation")()

    def fmodel(new_params_values: Tuple[torch.Tensor, ...], *args: Any, **kwargs: Any) -> Any:
        new_params_dict = dict(zip(params_names, new_params_values))
        return functional_call(stateless_mod, new_params_dict, args, kwargs)

    if disable_autograd_tracking:
        params_values = tuple(v.detach() for v in params_values)
    return fmodel, params_values


class FunctransEngine:
    """Opacus's functorch mode on functrans while active (``with engine:``, or ``install()``).

    ``calls``: how many times the per-sample-gradient functions built by this engine have run
    (one call per hooked layer and backward); ``layers_prepared``: how many functions it built
    (one per layer prepared while it was active).  Not re-entrant: entering an engine that is
    active raises; distinct engines nest (each puts back what it found).
    """

    def __init__(self) -> None:
        self.calls = 0
        self.layers_prepared = 0
        self._saved: Optional[Dict[str, Any]] = None

    @property
    def active(self) -> bool:
        """Whether this engine is entered (its block, or install(), has not ended)."""
        return self._saved is not None

    def _vmap(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        batched = vmap(fn, *args, **kwargs)
        self.layers_prepared += 1

        def per_sample_grads(*a: Any, **k: Any) -> Any:
            self.calls += 1
            return batched(*a, **k)
        setattr(per_sample_grads, "functrans_engine", self)
        return per_sample_grads

    def __enter__(self) -> "FunctransEngine":
        ofunctorch = _opacus_functorch("functrans.nn.opacus_engine.use_functrans()")
        with _lock:
            if self._saved is not None:
                raise TransformArgumentError(
                    "functrans.nn.opacus_engine.use_functrans(): this engine is already active "
                    "(it is not re-entrant); use a new use_functrans() for a nested block.")
            self._saved = {n: getattr(ofunctorch, n) for n in _NAMES}
            ofunctorch.vmap, ofunctorch.grad = self._vmap, grad
            ofunctorch.make_functional = _make_functional
        return self

    def __exit__(self, *exc: object) -> None:
        ofunctorch = _opacus_functorch("functrans.nn.opacus_engine.use_functrans()")
        with _lock:
            if self._saved is not None:
                for name, value in self._saved.items():
                    setattr(ofunctorch, name, value)
            self._saved = None

    def __repr__(self) -> str:
        state = "active" if self.active else "inactive"
        return (f"<functrans.nn.opacus_engine.FunctransEngine ({state}, "
                f"{self.layers_prepared} layers prepared, {self.calls} calls)>")


def use_functrans() -> FunctransEngine:
    """A new engine to use as ``with use_functrans() as engine:``: Opacus layers prepared in
    the block (build ``GradSampleModule(model)`` there) compute their per-sample gradients with
    functrans (``functrans.vmap(functrans.grad(...))`` over ``functrans.functional_call``),
    during and after the block; ``engine.calls`` counts those computations.  Opacus's own
    functions are back when the block ends, also on error.

    >>> import torch, warnings
    >>> from torch import nn
    >>> from opacus import GradSampleModule
    >>> from functrans.nn.opacus_engine import use_functrans, functrans_layers
    >>> class Scale(nn.Module):            # a custom layer: Opacus has no grad sampler for it
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.s = nn.Parameter(torch.zeros(4))
    ...     def forward(self, x):
    ...         return x * self.s.tanh() + x
    >>> model = nn.Sequential(nn.Linear(3, 4), Scale())
    >>> with use_functrans() as engine:
    ...     gsm = GradSampleModule(model)
    >>> functrans_layers(gsm)
    ['1']
    >>> with warnings.catch_warnings():   # the data needs no grad: torch warns, Opacus knows
    ...     warnings.simplefilter("ignore")
    ...     gsm(torch.randn(5, 3)).sum().backward()
    >>> engine.calls, tuple(model[1].s.grad_sample.shape)
    (1, (5, 4))
    """
    return FunctransEngine()


def install() -> FunctransEngine:
    """Make functrans Opacus's functorch engine process-wide (until ``uninstall()``): every
    ``GradSampleModule`` built afterwards uses it for the layers Opacus has no grad sampler for
    (all layers with ``force_functorch=True``).  Returns the engine (its ``calls`` counter);
    installing twice returns the installed engine.

    >>> from functrans.nn import opacus_engine
    >>> engine = opacus_engine.install()
    >>> opacus_engine.installed() is engine, opacus_engine.install() is engine
    (True, True)
    >>> opacus_engine.uninstall(); opacus_engine.installed() is None
    True
    """
    global _installed
    if _installed is None:
        engine = FunctransEngine()
        engine.__enter__()
        _installed = engine
    return _installed


def uninstall() -> None:
    """Put Opacus's own functions back after ``install()`` (nothing to do if not installed).
    Layers prepared meanwhile keep their functrans functions."""
    global _installed
    if _installed is not None:
        engine, _installed = _installed, None
        engine.__exit__(None, None, None)


def installed() -> Optional[FunctransEngine]:
    """The engine ``install()`` made, or None."""
    return _installed


def functrans_layers(module: nn.Module) -> List[str]:
    """The names (as in ``module.named_modules()``) of the layers whose per-sample gradients
    functrans computes: those prepared by a ``FunctransEngine``.  ``module`` may be the
    ``GradSampleModule`` or the model it wraps (names are then relative to it).

    >>> from torch import nn
    >>> functrans_layers(nn.Linear(2, 2))    # no GradSampleModule: nothing prepared
    []
    """
    inner = getattr(module, "_module", None)   # a GradSampleModule: the model it wraps
    root = inner if isinstance(inner, nn.Module) else module
    return [name for name, m in root.named_modules()
            if isinstance(getattr(getattr(m, "ft_compute_sample_grad", None),
                                  "functrans_engine", None), FunctransEngine)]
