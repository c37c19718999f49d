"""Privacy accounting for DP-SGD: the ε a run spends, for a given δ, from Opacus's accountants.

What this module owns: the entry points ``privacy_spent`` (ε after ``steps`` steps of the
Poisson-subsampled Gaussian mechanism), ``noise_for_epsilon`` (the noise multiplier a planned
run needs to stay within a target ε) and ``PrivacyLedger`` (ε so far, step by step, e.g. after
each epoch), their argument checks, and the clear ``ImportError`` when Opacus is missing.

No accounting maths is written here: every ε comes from an Opacus accountant
(``opacus.accountants``: ``"rdp"`` = ``RDPAccountant``, Rényi DP, the default, as in Opacus;
``"prv"`` = ``PRVAccountant``, numerical composition of privacy loss random variables, tighter;
``"gdp"`` = ``GaussianAccountant``, Gaussian DP, which Opacus calls experimental: it can
underestimate ε and warns), fed the history ``(noise_multiplier, sample_rate, steps)`` exactly
as Opacus's ``PrivacyEngine`` feeds it, and the noise multiplier comes from
``opacus.accountants.utils.get_noise_multiplier`` (Opacus's own binary search).  The one rule
added on top: ``steps=0`` spends ε = 0 (no mechanism ran; Opacus's RDP accountant says the same
for an empty history).

The accounting assumes what DP-SGD with ``functrans.nn.dp`` does when batches come from Poisson
sampling (``functrans.nn.poisson.PoissonSampler``: every example joins each batch independently
with probability ``sample_rate``), each step clipping every example's gradient to ``max_norm``
and adding ``N(0, (noise_multiplier * max_norm)**2)`` noise to the sum.  ``sample_rate`` is the
per-step inclusion probability ``q`` (expected batch size / dataset size); one epoch is about
``1 / q`` steps.

Opacus is optional (``pip install functrans[dp]``, or ``pip install --no-deps opacus==1.6.0
scipy opt_einsum`` next to an installed torch); it is imported inside the functions, never when
functrans is imported.  Argument errors are ``functrans.errors`` types that open with the call
echoed, e.g. ``privacy_spent(noise_multiplier=0.0, ...): noise_multiplier must be ...``.

Imports: errors, poisson (the optional opacus package is imported inside the functions).
"""
from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, List, Tuple

from ..errors import MissingDependencyError, TransformArgumentError, transform_call
from .poisson import check_sample_rate

__all__ = ["privacy_spent", "noise_for_epsilon", "PrivacyLedger", "ACCOUNTANTS"]

# functrans's name -> the Opacus mechanism name (create_accountant's key) and class, for messages
ACCOUNTANTS = {"rdp": "RDPAccountant", "prv": "PRVAccountant", "gdp": "GaussianAccountant"}

INSTALL_HINT = ("`pip install functrans[dp]` (or, next to an installed torch, "
                "`pip install --no-deps opacus==1.6.0 scipy opt_einsum`)")


def _opacus_accountants(api: str) -> Any:
    """``opacus.accountants`` (its ``utils`` imported too), or a ``MissingDependencyError``
    saying what to install."""
    try:
        import opacus.accountants  # type: ignore[import-untyped, unused-ignore]
        import opacus.accountants.utils  # type: ignore[import-untyped, unused-ignore]
    except ImportError as e:
        raise MissingDependencyError(
            f"{api}: privacy accounting uses the accountants of the optional 'opacus' package, "
            f"which could not be imported ({e}). Install it with {INSTALL_HINT}.") from e
    return opacus.accountants


def _accountant(name: str, api: str) -> Any:
    """A fresh Opacus accountant for ``name`` (checked first, so a typo needs no Opacus)."""
    _check_accountant(name, api)
    return _opacus_accountants(api).create_accountant(mechanism=name)


# ------------------------------------------------------------------------------ argument checks
def _real(value: Any, name: str, api: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not math.isfinite(float(value)):
        raise TransformArgumentError(
            f"{api}: {name} must be a finite real number; got {value!r}.")
    return float(value)


def _check_accountant(name: Any, api: str) -> None:
    if name not in ACCOUNTANTS:
        raise TransformArgumentError(
            f"{api}: accountant must be one of {sorted(ACCOUNTANTS)} (Opacus's "
            f"{', '.join(f'{k!r} = {v}' for k, v in ACCOUNTANTS.items())}); got {name!r}.")


def _check_noise(noise_multiplier: Any, api: str) -> float:
    sigma = _real(noise_multiplier, "noise_multiplier", api)
    if sigma <= 0:
        raise TransformArgumentError(
            f"{api}: noise_multiplier must be > 0 (the noise std divided by max_norm); got "
            f"{noise_multiplier!r}. Without noise no ε is finite: a run without noise is not "
            "differentially private.")
    return sigma


def _check_delta(delta: Any, api: str) -> float:
    d = _real(delta, "delta", api)
    if not 0 < d < 1:
        raise TransformArgumentError(
            f"{api}: delta must be in (0, 1) (usually well below 1 / dataset size, e.g. 1e-5); "
            f"got {delta!r}.")
    return d


def _check_steps(steps: Any, api: str, minimum: int = 0) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral) or steps < minimum:
        raise TransformArgumentError(
            f"{api}: steps must be an int >= {minimum} (the number of DP-SGD steps; one epoch "
            f"is about 1 / sample_rate steps); got {steps!r}.")
    return int(steps)


# ------------------------------------------------------------------------------ entry points
def privacy_spent(*, noise_multiplier: float, sample_rate: float, steps: int, delta: float,
                  accountant: str = "rdp") -> float:
    """The ε that ``steps`` DP-SGD steps spend, for ``delta``: the run is (ε, δ)-DP.

    ``noise_multiplier``: σ > 0, the noise std divided by the clipping bound ``max_norm``
    (``dp_sgd_grads``'s argument of the same name).  ``sample_rate``: q in (0, 1], the
    probability with which Poisson sampling puts each example in a batch.  ``steps``: an int
    >= 0 (``steps=0`` gives 0.0).  ``delta``: δ in (0, 1).  ``accountant``: ``"rdp"`` (default),
    ``"prv"`` or ``"gdp"`` (Opacus's ``RDPAccountant``, ``PRVAccountant``,
    ``GaussianAccountant``).  Returns ε as a float, equal to what Opacus's ``PrivacyEngine``
    reports with the same accountant after ``steps`` steps (``get_epsilon(delta)``).

    >>> eps = privacy_spent(noise_multiplier=1.1, sample_rate=256 / 60000, steps=2340,
    ...                     delta=1e-5)
    >>> print(f"{eps:.2f}")
    1.10
    >>> privacy_spent(noise_multiplier=1.1, sample_rate=0.01, steps=0, delta=1e-5)
    0.0
    """
    api = transform_call("privacy_spent", None, noise_multiplier=noise_multiplier,
                         sample_rate=sample_rate, steps=steps, delta=delta,
                         accountant=accountant)
    _check_accountant(accountant, api)
    sigma = _check_noise(noise_multiplier, api)
    q = check_sample_rate(sample_rate, api)
    n = _check_steps(steps, api)
    d = _check_delta(delta, api)
    if n == 0:
        return 0.0
    acc = _accountant(accountant, api)
    acc.history = [(sigma, q, n)]   # what n calls of acc.step(...) with these values leave
    return float(acc.get_epsilon(delta=d))


def noise_for_epsilon(*, target_epsilon: float, sample_rate: float, steps: int, delta: float,
                      accountant: str = "rdp", epsilon_tolerance: float = 0.01) -> float:
    """The noise multiplier σ for a planned run to spend at most ``target_epsilon``.

    Opacus's ``get_noise_multiplier``: a binary search over σ with the chosen accountant, which
    returns the σ whose ε (``privacy_spent`` with the same arguments) lies in
    ``[target_epsilon - epsilon_tolerance, target_epsilon]``.  ``target_epsilon`` > 0;
    ``sample_rate`` q in (0, 1]; ``steps`` an int >= 1 (epochs / q for a number of epochs);
    ``delta`` in (0, 1); ``accountant`` as in ``privacy_spent``; ``epsilon_tolerance`` > 0.
    (Opacus's RDP conversion warns "Optimal order is the largest alpha" at the search's
    large-σ probes; that warning is silenced here, it says nothing about the answer.)
    A target no σ up to 1e6 reaches raises ``TransformArgumentError`` naming
    ``target_epsilon``.

    >>> sigma = noise_for_epsilon(target_epsilon=8.0, sample_rate=0.01, steps=1000,
    ...                           delta=1e-5)
    >>> eps = privacy_spent(noise_multiplier=sigma, sample_rate=0.01, steps=1000, delta=1e-5)
    >>> 8.0 - 0.01 <= eps <= 8.0
    True
    """
    api = transform_call("noise_for_epsilon", None, target_epsilon=target_epsilon,
                         sample_rate=sample_rate, steps=steps, delta=delta,
                         accountant=accountant)
    _check_accountant(accountant, api)
    target = _real(target_epsilon, "target_epsilon", api)
    if target <= 0:
        raise TransformArgumentError(
            f"{api}: target_epsilon must be > 0 (ε = 0 would need infinite noise); got "
            f"{target_epsilon!r}.")
    q = check_sample_rate(sample_rate, api)
    n = _check_steps(steps, api, minimum=1)
    d = _check_delta(delta, api)
    tol = _real(epsilon_tolerance, "epsilon_tolerance", api)
    if tol <= 0:
        raise TransformArgumentError(
            f"{api}: epsilon_tolerance must be > 0 (how far below target_epsilon the ε of the "
            f"returned noise multiplier may be); got {epsilon_tolerance!r}.")
    utils = _opacus_accountants(api).utils
    try:
        with warnings.catch_warnings():   # the search's probes at a huge sigma, not its answer
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            sigma = utils.get_noise_multiplier(target_epsilon=target, target_delta=d,
                                               sample_rate=q, steps=n,
                                               accountant=accountant, epsilon_tolerance=tol)
    except ValueError as e:   # "The privacy budget is too low." (no sigma up to 1e6 reaches it)
        raise TransformArgumentError(
            f"{api}: no noise multiplier up to {utils.MAX_SIGMA:g} reaches target_epsilon="
            f"{target_epsilon!r} with this sample_rate, steps and delta (Opacus: {e}); raise "
            "target_epsilon or delta, or lower sample_rate or steps.") from e
    return float(sigma)


class PrivacyLedger:
    """The ε spent so far by a training run, step by step (e.g. printed after each epoch).

    ``ledger = PrivacyLedger(accountant="rdp")``; after each DP-SGD step
    ``ledger.step(noise_multiplier=σ, sample_rate=q)`` (``steps=k``: k steps at once, e.g. a
    whole epoch); ``ledger.epsilon(delta)`` is the ε spent so far (0.0 before any step).  It
    keeps an Opacus accountant (``ledger.accountant``, e.g. to hand to Opacus code) whose
    ``history`` holds ``(noise_multiplier, sample_rate, steps)`` runs; σ and q may change from
    step to step (not with ``"gdp"``, which needs them constant).  ``len(ledger)`` is the number
    of steps taken; ``ledger.epsilon(delta)`` equals ``privacy_spent(...)`` for a run of
    constant σ and q.

    >>> ledger = PrivacyLedger()
    >>> for epoch in range(2):
    ...     ledger.step(noise_multiplier=1.1, sample_rate=0.01, steps=100)
    ...     print(f"epoch {epoch + 1}: {len(ledger)} steps, ε = {ledger.epsilon(1e-5):.3f}")
    epoch 1: 100 steps, ε = 0.956
    epoch 2: 200 steps, ε = 1.058
    """

    def __init__(self, accountant: str = "rdp") -> None:
        self._api = transform_call("PrivacyLedger", None, accountant=accountant)
        self.accountant: Any = _accountant(accountant, self._api)
        self.mechanism = accountant

    def step(self, *, noise_multiplier: float, sample_rate: float, steps: int = 1) -> None:
        """Record ``steps`` DP-SGD steps with noise multiplier σ and sample rate q."""
        api = transform_call("PrivacyLedger.step", None, noise_multiplier=noise_multiplier,
                             sample_rate=sample_rate, steps=steps)
        sigma = _check_noise(noise_multiplier, api)
        q = check_sample_rate(sample_rate, api)
        n = _check_steps(steps, api)
        try:
            for _ in range(n):   # the accountant merges equal consecutive steps into one run
                self.accountant.step(noise_multiplier=sigma, sample_rate=q)
        except ValueError as e:   # GaussianAccountant: sigma and q must stay constant
            raise TransformArgumentError(
                f"{api}: the {self.mechanism!r} accountant needs the same noise_multiplier and "
                f"sample_rate at every step (Opacus: {e}); use accountant='rdp' or 'prv' for a "
                "run whose noise or sample rate changes.") from e

    def epsilon(self, delta: float) -> float:
        """The ε spent so far for ``delta`` in (0, 1) (0.0 before the first step)."""
        api = transform_call("PrivacyLedger.epsilon", None, delta=delta)
        d = _check_delta(delta, api)
        if len(self) == 0:
            return 0.0
        return float(self.accountant.get_epsilon(delta=d))

    @property
    def history(self) -> List[Tuple[float, float, int]]:
        """``[(noise_multiplier, sample_rate, steps), ...]``: the runs recorded so far."""
        return [(float(s), float(q), int(n)) for s, q, n in self.accountant.history]

    def __len__(self) -> int:
        return sum(int(run[2]) for run in self.accountant.history)

    def __repr__(self) -> str:
        return f"PrivacyLedger(accountant={self.mechanism!r}, steps={len(self)})"
