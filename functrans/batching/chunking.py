"""``chunk_size="auto"``: the chunk chosen from a measured memory budget.

What this module owns:

- ``choose()``: the number of examples a vmap runs at a time under ``chunk_size="auto"``
  (``None``: the whole batch at once), and the ``ChunkChoice`` it records.
- ``peak_bytes()``: the peak memory of one batched call, measured on fake tensors.
- ``budget()``: the bytes a chunk may use: ``functrans.config.max_memory`` /
  ``memory_limit``, by default ``config.memory_fraction`` of the free memory of the device the
  inputs live on (CUDA: ``torch.cuda.mem_get_info`` plus what torch's caching allocator holds
  unused; CPU: ``MemAvailable`` in ``/proc/meminfo``, else ``psutil``, else 4 GiB).
- ``last_choice()`` and ``recording()``: the decisions, inspectable (the chunk, the measured
  bytes per example, or why the measurement failed).
- ``signature()``: the key under which a vmap (or a jacrev / jacfwd) caches its choices, so
  that a repeated call with the same shapes and budget does not probe again.

Note [how chunk_size="auto" measures]
The batched call is run on fake tensors (``FakeTensorMode``: shapes, dtypes and devices, no
memory, no kernels): the mapped inputs become fake tensors of the probe's batch size, tensors
the function closes over are converted on first use.  The fake mode is ``_LiveBytes``, a
``FakeTensorMode`` that also counts: every physical op ends in it, whichever route it took
(the vmap level's mode, a BatchedTensor's own ``__torch_dispatch__`` in a backward pass,
forward-AD's tangent ops, a decomposition's inner ops), and it keeps the bytes of the live
storages those ops created:

* an output whose storage is new (it aliases no fake input of the op) adds its storage's
  ``nbytes``; an output that aliases an input (a view, an in-place op's result) shares that
  input's allocation record;
* every tensor holding a record has a ``weakref.finalize``; when the last one dies the record's
  bytes leave the live total (CPython frees on the last reference, so this is the order real
  memory is freed in);
* the peak is the highest live total after any op.

Not seen: memory a kernel allocates inside itself (workspaces), storages of real tensors the
trace did not create (the function's closed-over weights, a vjp's saved activations: those
exist before and after any chunk), and the allocator's rounding.  The chunk is then chosen by
probing: the whole batch first (if its peak fits the budget, nothing is chunked); otherwise one
example, a straight line through the two (fixed bytes + bytes per example), the largest chunk
the line fits in the budget together with the earlier chunks' results (measured too: the bytes
still live when the whole-batch probe returns), and that chunk probed again (shrunk in
proportion while it overshoots, at most ``_REFINE`` times; 1 at the least).  The results of
all chunks and their concatenation (twice the results) are the floor of any chunked run: a
budget below it still gets the chunk above, with the reason saying so.  Each probe calls the
function once more, on fake tensors: its Python side effects happen again (its tensors' values
are not touched, and the CPU and CUDA random states are restored afterwards).

A nested ``chunk_size="auto"`` met inside a probe runs unchunked: that over-estimates the outer
chunk's memory (chunking only lowers it), so the outer choice stays within the budget.  A vmap
with ``"auto"`` that runs inside another vmap (``vmap(jacrev(f, chunk_size="auto"))``, the
inner pass of ``hessian``) is not probed and runs unchunked: the outer level's mode sits below
the fake mode on the mode stack, so the outer level's physical ops would run on real tensors,
unseen (put ``"auto"`` on the outermost vmap: its probe sees every level inside it).  When a
probe fails (an op without a fake/meta kernel, a data-dependent shape, ``.item()``, any
error), the batch runs unchunked, as with ``chunk_size=None``, and the reason is recorded in
the ``ChunkChoice``: never an error, never another answer.  Under ``functrans.compile`` the
probes run with make_fx's proxy modes off (they are not part of the graph) and the chunk chosen
at trace time is baked into the graph.

Imports: config.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.utils._pytree import tree_flatten

from .. import config

_REFINE = 4
_CACHE_SIZE = 64
_FAKE_LOG = logging.getLogger("torch._subclasses.fake_tensor")
_is_alias_of: Callable[[torch.Tensor, torch.Tensor], bool] = getattr(torch._C, "_is_alias_of")
_CPU_UNKNOWN = 4 * 2 ** 30
_tls = threading.local()


@dataclasses.dataclass(frozen=True)
class ChunkChoice:
    """One ``chunk_size="auto"`` decision.

    Attributes:
        api: the call (``"jacrev(f, argnums=0)"`` for the vmap inside jacrev: its own echo).
        batch_size: the examples to run.
        chunk_size: the chosen chunk (``None``: the whole batch at once).
        budget: the bytes a chunk may use (``budget()``).
        peak_bytes: the measured peak of the whole batch, or ``None``.
        result_bytes: the bytes of the whole batch's results (live when the call returns).
        chunk_peak_bytes: the measured peak of one chunk of ``chunk_size``, or ``None``.
        estimated_peak_bytes: the peak of the run as chosen: the whole batch's, or the
            chunk's with the earlier chunks' results beside it, and at least twice the results
            (all chunks' results and their concatenation).
        per_example_bytes, fixed_bytes: the straight line through the probes, or ``None``.
        reason: why the choice was made (a fallback's names the failure).
    """
    api: str
    batch_size: int
    chunk_size: Optional[int]
    budget: int
    peak_bytes: Optional[int] = None
    result_bytes: Optional[int] = None
    chunk_peak_bytes: Optional[int] = None
    estimated_peak_bytes: Optional[int] = None
    per_example_bytes: Optional[float] = None
    fixed_bytes: Optional[float] = None
    reason: str = ""

    @property
    def fell_back(self) -> bool:
        """Whether the measurement failed (and the batch runs unchunked)."""
        return self.reason.startswith("fallback")


def last_choice() -> Optional[ChunkChoice]:
    """The last ``chunk_size="auto"`` decision made in this thread (``None``: none yet)."""
    return getattr(_tls, "last", None)


@contextlib.contextmanager
def recording() -> Iterator[List[ChunkChoice]]:
    """Collect every ``chunk_size="auto"`` decision made in this thread within the block.

    Example:
        >>> import torch, functrans
        >>> from functrans.batching import chunking
        >>> with chunking.recording() as seen, functrans.config.max_memory(4096):
        ...     y = functrans.vmap(lambda r: r.exp() * 2, chunk_size="auto")(torch.ones(64, 16))
        >>> seen[0].chunk_size < 64, seen[0].chunk_peak_bytes <= 4096
        (True, True)
    """
    stack = _records()
    seen: List[ChunkChoice] = []
    stack.append(seen)
    try:
        yield seen
    finally:
        stack.remove(seen)


def _records() -> List[List[ChunkChoice]]:
    if not hasattr(_tls, "records"):
        _tls.records = []
    records: List[List[ChunkChoice]] = _tls.records
    return records


def _record(choice: ChunkChoice) -> ChunkChoice:
    _tls.last = choice
    for seen in _records():
        seen.append(choice)
    return choice


def probing() -> bool:
    """Whether a probe runs in this thread (a nested ``"auto"`` then runs unchunked)."""
    return getattr(_tls, "probing", False)


def free_memory(device: torch.device) -> int:
    """Free bytes on ``device``: CUDA from ``mem_get_info`` plus torch's cached, unused blocks;
    any other device from the host's available memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device)
                   - torch.cuda.memory_allocated(device))
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil  # type: ignore[import-untyped]  # optional: not a package module
        return int(psutil.virtual_memory().available)
    except ImportError:
        return _CPU_UNKNOWN


def budget(device: torch.device) -> int:
    """The bytes one chunk may use on ``device`` (see the module docstring)."""
    limit = config.memory_limit_setting()
    if isinstance(limit, int):
        return limit
    fraction = config.memory_fraction if limit is None else limit
    return max(1, int(fraction * free_memory(device)))


class _LiveBytes(FakeTensorMode):  # type: ignore[no-untyped-call]
    """A fake mode that also counts the bytes of the live storages its ops create (Note [how
    chunk_size="auto" measures])."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.live = 0
        self.peak = 0
        self.records: Dict[int, List[int]] = {}   # id(fake tensor) -> [nbytes, holders]

    def _release(self, key: int, record: List[int]) -> None:
        if self.records.get(key) is record:
            del self.records[key]
        record[1] -= 1
        if record[1] == 0:
            self.live -= record[0]

    def _hold(self, t: torch.Tensor, record: List[int]) -> None:
        record[1] += 1
        self.records[id(t)] = record
        weakref.finalize(t, self._release, id(t), record)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, FakeTensor)]
        if not outs:
            return out
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, FakeTensor)]
        for o in outs:
            if id(o) in self.records:       # an in-place op's result: already held
                continue
            source = next((a for a in ins if _is_alias_of(o, a)), None)
            if source is None:
                record = [o.untyped_storage().nbytes(), 0]
                self.live += record[0]
                self._hold(o, record)
            elif id(source) in self.records:
                self._hold(o, self.records[id(source)])
        self.peak = max(self.peak, self.live)
        return out


def _rng_state() -> Any:
    cpu = torch.get_rng_state()
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    cuda = torch.cuda.get_rng_state_all() if initialized else None
    return cpu, cuda


def peak_bytes(run: Callable[[List[Any], int], Any], flat_args: Sequence[Any],
               flat_dims: Sequence[Optional[int]], size: int) -> int:
    """The peak bytes of ``run(args, size)`` on fake tensors: the mapped inputs narrowed to
    ``size`` examples and made fake, the others passed as they are (converted on first use)."""
    return measure(run, flat_args, flat_dims, size)[0]


def measure(run: Callable[[List[Any], int], Any], flat_args: Sequence[Any],
            flat_dims: Sequence[Optional[int]], size: int) -> Tuple[int, int]:
    """``peak_bytes()``, and the bytes still live when ``run`` returned (its results)."""
    cpu, cuda = _rng_state()
    mode = _LiveBytes()
    old = probing()
    _tls.probing = True
    quiet = _FAKE_LOG.disabled
    _FAKE_LOG.disabled = True    # a failing meta kernel is logged there; the probe says why
    try:
        narrowed = [a.narrow(d, 0, size) if d is not None and isinstance(a, torch.Tensor) else a
                    for a, d in zip(flat_args, flat_dims)]
        # under functrans.compile's make_fx the probe is not part of the trace; the guards'
        # storage checks read fake storages' data pointers, which torch warns about
        with disable_proxy_modes_tracing(), warnings.catch_warnings(), mode:
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            # plain tensors become fake; a subclass (an outer vmap's BatchedTensor) stays, and
            # its physical ops meet the fake mode
            fake = [mode.from_tensor(a) if type(a) in (torch.Tensor, torch.nn.Parameter) else a
                    for a in narrowed]
            out = run(fake, size)
            held = mode.live
            del out
        return mode.peak, held
    finally:
        _tls.probing = old
        _FAKE_LOG.disabled = quiet
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def signature(tree: Any) -> Tuple[Any, ...]:
    """A hashable key for a call's arguments: per leaf, a tensor's type, shape, dtype, device
    and requires_grad (not its values), another leaf's type and value (its id if unhashable),
    with the grad mode."""
    leaves, spec = tree_flatten(tree)
    key: List[Any] = [str(spec), torch.is_grad_enabled()]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key.append((type(leaf).__name__, tuple(leaf.shape), leaf.dtype, str(leaf.device),
                        leaf.requires_grad))
        else:
            try:
                hash(leaf)
                key.append((type(leaf).__name__, leaf))
            except TypeError:
                key.append((type(leaf).__name__, id(leaf)))
    return tuple(key)


def _device(flat_args: Sequence[Any], flat_dims: Sequence[Optional[int]]) -> torch.device:
    for a, d in zip(flat_args, flat_dims):
        if d is not None and isinstance(a, torch.Tensor):
            return a.device
    return torch.device("cpu")


def _why(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def choose(api: str, run: Callable[[List[Any], int], Any], flat_args: Sequence[Any],
           flat_dims: Sequence[Optional[int]], batch_size: int,
           unmeasurable: Optional[str] = None, cache: Optional[Dict[Any, Any]] = None,
           key: Any = None) -> Optional[int]:
    """The chunk for ``chunk_size="auto"``: ``None`` (the whole batch) or the most examples
    whose measured peak fits ``budget()``.  ``run(args, size)`` runs one batched call of
    ``size`` examples on ``args`` (the flat arguments); ``unmeasurable`` says why the call
    cannot be probed (then it runs unchunked).  Records a ``ChunkChoice``.

    With a ``cache`` (a vmap's, or a jacrev's), a choice is kept under ``key`` (the call's
    ``signature()``) and the budget, to within 1/8 of a power of two: a later call with the same
    signature and budget takes it without probing (its ``reason`` ends in ``(cached)``).  A
    stale entry (the function closes over a tensor that changed shape) can only make the chunk
    fit worse, never change a result."""
    if probing():
        return None        # a nested "auto" inside a probe: unchunked (an over-estimate)
    limit = budget(_device(flat_args, flat_dims))
    if cache is not None:
        slot = (key, round(math.log2(max(limit, 1)) * 8))
        hit = cache.get(slot)
        if hit is not None:
            return _record(dataclasses.replace(hit, reason=hit.reason + " (cached)")).chunk_size
        choice = _choose(api, run, flat_args, flat_dims, batch_size, unmeasurable, limit)
        if len(cache) >= _CACHE_SIZE:
            try:                    # the oldest entry (another thread may change the dict)
                cache.pop(next(iter(cache)), None)
            except (StopIteration, RuntimeError):
                pass
        cache[slot] = choice
        return choice.chunk_size
    return _choose(api, run, flat_args, flat_dims, batch_size, unmeasurable, limit).chunk_size


def _choose(api: str, run: Callable[[List[Any], int], Any], flat_args: Sequence[Any],
            flat_dims: Sequence[Optional[int]], batch_size: int, unmeasurable: Optional[str],
            limit: int) -> ChunkChoice:
    info: Any = dict(api=api, batch_size=batch_size, budget=limit)
    if unmeasurable:
        return _record(ChunkChoice(chunk_size=None, reason=f"fallback: {unmeasurable}; the "
                                   "batch runs unchunked", **info))
    try:
        whole, results = measure(run, flat_args, flat_dims, batch_size)
        info.update(peak_bytes=whole, result_bytes=results)
        if whole <= limit or batch_size == 1:
            why = "the whole batch fits" if whole <= limit else "one example"
            return _record(ChunkChoice(chunk_size=None, reason=why, estimated_peak_bytes=whole,
                                       **info))
        one = peak_bytes(run, flat_args, flat_dims, 1)
        per = max((whole - one) / (batch_size - 1), 1.0)
        fixed = max(one - per, 0.0)
        per_result = results / batch_size
        info.update(per_example_bytes=per, fixed_bytes=fixed)

        def total(chunk: int, measured: int) -> float:
            # the chunk's own peak, with the earlier chunks' results held beside it
            return measured + (batch_size - chunk) * per_result

        room = limit - fixed - batch_size * per_result
        chunk = int(min(batch_size - 1, max(1, room // max(per - per_result, 1.0))))
        measured = peak_bytes(run, flat_args, flat_dims, chunk)
        for _ in range(_REFINE):
            if total(chunk, measured) <= limit or chunk == 1:
                break
            chunk = max(1, min(chunk - 1, int(chunk * limit / total(chunk, measured))))
            measured = peak_bytes(run, flat_args, flat_dims, chunk)
        estimate = max(total(chunk, measured), 2 * results)
        why = "measured" if estimate <= limit else (
            "measured; the results alone, held twice while the chunks are concatenated, "
            "exceed the budget" if 2 * results > limit else
            "measured; even one example exceeds the budget")
        return _record(ChunkChoice(chunk_size=chunk, chunk_peak_bytes=measured,
                                   estimated_peak_bytes=int(estimate), reason=why,
                                   **info))
    except Exception as e:       # any failure of the fake trace: run unchunked, say why
        return _record(ChunkChoice(chunk_size=None, reason=f"fallback: the fake trace failed "
                                   f"({_why(e)}); the batch runs unchunked", **info))
