"""GPU bugs caught without a GPU: what a program makes the host wait for, and on which device.

Two audits, used by tests/device_audit/:

* **Host syncs.**  ``SyncRecorder`` is a dispatch mode that records every op that forces a
  device-to-host synchronisation on a GPU: a value read back (``_local_scalar_dense``, which
  ``.item()``, ``bool()``, ``int()`` and ``is_nonzero`` reach), an output shape that depends on
  the data (``nonzero``, ``masked_select``, ``unique*``, ``bincount``, ``repeat_interleave`` of
  tensor repeats, a boolean index), ``equal`` (a Python bool), a copy to the CPU, and (through
  patched ``Tensor`` methods) ``tolist()``, ``numpy()`` and ``__array__``, which read a CPU
  tensor's memory without dispatching anything.  Each record is a *kind* ("value read",
  "data-dependent shape", ...).  ``extra_syncs(program, reference)`` runs both under a
  recorder and returns the kinds the program issues that the reference (the plain per-example
  program: a for-loop over examples, or ``torch.autograd.grad`` per example) does not.  A
  recorder pushed before the transform sits below functrans's own dispatch modes, so it sees
  the physical ops the rules run, which are what a GPU executes.

* **Devices.**  ``install_fake_gpu()`` registers PyTorch's PrivateUse1 backend as the device
  ``fakegpu`` with a Python device guard, and ``fake_gpu_mode()`` is a FakeTensorMode in which
  tensors live there: shapes, dtypes and devices are computed, values are not, no GPU needed.
  A rule that builds an index or helper tensor on the CPU and mixes it with a GPU input fails
  there as on a real GPU ("found at least two devices"; torch 2.11: "found two different
  devices"), and a value read raises.  Why not the
  alternatives: fake ``cuda`` tensors abort the process as soon as autograd records a node (a
  CPU-only build has no CUDA device guard) and cannot run ``copy_``; the ``meta`` device accepts
  CPU index tensors in ``index_select``/``gather``, which CUDA refuses.  The fake GPU runs
  autograd, so every transform is audited there.  Installing it is process-wide and permanent
  (``torch.accelerator`` then reports it), and must happen before autograd first runs, so the
  audit runs in its own process: ``python -m tests.support.device_audit --json FILE [--full]``.
  ``same_metadata`` compares what such runs can compare: structure, shapes, dtypes, devices.

Imports: (tests only) torch, torch.utils._python_dispatch, torch._subclasses.fake_tensor.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import warnings
from typing import Callable, Dict, Iterator, List, Optional

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tests.support.opinfo_sweep import _first_line as first_line

aten = torch.ops.aten

# Kinds of host sync, by op (the overload packet's name).
VALUE_READ = "value read (.item(), bool(), int(), float())"
DATA_SHAPE = "output shape depends on the data"
EQUAL = "torch.equal (a Python bool)"
TO_HOST = "copy to the CPU"
HOST_READ = "tolist()/numpy() of a tensor"

_KIND_BY_OP: Dict[str, str] = {
    "_local_scalar_dense": VALUE_READ, "item": VALUE_READ, "is_nonzero": VALUE_READ,
    "nonzero": DATA_SHAPE, "nonzero_numpy": DATA_SHAPE, "argwhere": DATA_SHAPE,
    "masked_select": DATA_SHAPE, "_unique": DATA_SHAPE,
    "_unique2": DATA_SHAPE, "unique_dim": DATA_SHAPE, "unique_consecutive": DATA_SHAPE,
    "unique_dim_consecutive": DATA_SHAPE, "bincount": DATA_SHAPE,
    "equal": EQUAL,
}


def sync_kind(func, args, kwargs) -> Optional[str]:
    """The kind of host sync ``func(*args, **kwargs)`` forces on a GPU, or None."""
    name = func.overloadpacket.__name__
    kind = _KIND_BY_OP.get(name)
    if kind is not None:
        return kind
    if name == "repeat_interleave" and func is aten.repeat_interleave.Tensor \
            and kwargs.get("output_size") is None:
        return DATA_SHAPE
    if name in ("index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices):
            return DATA_SHAPE
    if name in ("_to_copy", "copy_"):
        src = args[1] if name == "copy_" else args[0]
        dst = args[0].device if name == "copy_" else kwargs.get("device")
        if isinstance(src, torch.Tensor) and dst is not None and src.device.type != "cpu" \
                and torch.device(dst).type == "cpu":
            return TO_HOST
    return None


class SyncRecorder(TorchDispatchMode):
    """Records the kinds of host sync issued under it (``.kinds``: kind -> example op names)."""

    def __init__(self):
        super().__init__()
        self.kinds: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            self.kinds[kind][str(func)] += 1
        return func(*args, **kwargs)


_HOST_READERS = ("tolist", "numpy", "__array__")


@contextlib.contextmanager
def recording_syncs() -> Iterator[SyncRecorder]:
    """A ``SyncRecorder`` plus the Python-level readers of tensor memory that dispatch nothing
    (``Tensor.tolist``, ``numpy``, ``__array__``), recorded as ``HOST_READ``."""
    rec = SyncRecorder()
    saved = {name: torch.Tensor.__dict__.get(name) for name in _HOST_READERS}

    def reader(name):
        original = getattr(torch.Tensor, name)

        def read(self, *a, **k):
            rec.kinds[HOST_READ][f"Tensor.{name}"] += 1
            return original(self, *a, **k)
        return read

    for name in _HOST_READERS:
        setattr(torch.Tensor, name, reader(name))
    try:
        with rec:
            yield rec
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, value)


def syncs_of(fn: Callable[[], object]) -> Dict[str, collections.Counter]:
    with recording_syncs() as rec:
        fn()
    return dict(rec.kinds)


def extra_syncs(program: Callable[[], object], reference: Callable[[], object]) -> Dict[str, dict]:
    """The kinds of host sync ``program()`` issues that ``reference()`` does not, with the ops
    that issued them (empty: no extra sync)."""
    got, ref = syncs_of(program), syncs_of(reference)
    return {k: dict(v) for k, v in got.items() if k not in ref}


# ---------------------------------------------------------------------------------------------
# Devices without a GPU.

FAKE_GPU = "fakegpu"


def install_fake_gpu() -> str:
    """Register PyTorch's PrivateUse1 backend as the device ``fakegpu``, with a Python device
    guard (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``).
    Process-wide and for good (PyTorch cannot undo it, and it makes ``torch.accelerator`` report
    a device), so only the audit's own subprocess calls it.  Returns the device name."""
    from torch.utils import backend_registration as br
    if torch._C._get_privateuse1_backend_name() != FAKE_GPU:
        br._setup_privateuseone_for_python_backend(FAKE_GPU, backend_module=_FakeGPUModule())
    return FAKE_GPU


class _FakeGPUModule:
    """``torch.fakegpu``: what PyTorch asks of a device module (``torch.utils.checkpoint``
    saves and restores its random state, autocast asks for its dtypes)."""

    def is_initialized(self) -> bool:
        return True

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def _is_in_bad_fork(self) -> bool:
        return False

    def manual_seed_all(self, seed: int) -> None:
        pass

    def get_amp_supported_dtype(self):
        return [torch.float16, torch.bfloat16]

    def device(self, index):
        return contextlib.nullcontext()

    def get_rng_state(self, device=None):
        return torch.zeros(0, dtype=torch.uint8)

    def set_rng_state(self, state, device=None) -> None:
        pass


def fake_gpu_mode():
    """A FakeTensorMode in which tensors live on the fake GPU (real inputs are converted)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode(allow_non_fake_inputs=True)


def on_device(tree, device: str):
    """Every tensor of ``tree`` remade on ``device`` (inside a fake mode): shape, strides, dtype
    and requires_grad kept; no values (a fake tensor has none)."""
    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        return out.requires_grad_(t.requires_grad)
    return pytree.tree_map(move, tree)


def same_metadata(actual, expected, device: Optional[str] = None) -> Optional[str]:
    """None when both trees have the same structure and every tensor leaf the same shape,
    dtype and device (``device`` for every leaf of ``actual``, when given); else what
    differs."""
    a, sa = pytree.tree_flatten(actual)
    e, se = pytree.tree_flatten(expected)
    if sa != se:
        return f"structure {sa} != {se}"
    for i, (x, y) in enumerate(zip(a, e)):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return f"leaf {i}: {type(x).__name__} != {type(y).__name__}"
        if isinstance(x, torch.Tensor):
            for what in ("shape", "dtype"):
                if getattr(x, what) != getattr(y, what):
                    return f"leaf {i}: {what} {getattr(x, what)} != {getattr(y, what)}"
            want = torch.device(device) if device is not None else y.device
            if x.device.type != want.type:
                return f"leaf {i}: device {x.device} != {want}"
    return None


# ---------------------------------------------------------------------------------------------
# The OpInfo audits: one op's samples under vmap, against the for-loop of the op.

AUDIT_SAMPLES = 2     # samples per op
AUDIT_IN_DIMS = 2     # in_dims choices per sample (all-0 and all--1 first), plus vmap of vmap


@dataclasses.dataclass
class OpAudit:
    op: str
    skipped: Optional[str] = None
    checked: int = 0                  # checks compared (the loop ran on the same inputs)
    problems: List[str] = dataclasses.field(default_factory=list)


# Samples the audits pass over, by op.  histc with min == max takes its range from the data:
# eager's kernel reads it on the host too (CUDA's histc copies min()/max() to the CPU inside the
# kernel, below the recorder), and so does the rule (a range that is not finite is eager's
# error), so the audits check the samples with a given range.  OpInfo's sample order differs
# between torch versions (2.11 lists min == max first, 2.13 a given range first).
_AUDIT_SAMPLE_FILTER = {
    "histc": lambda sample: sample.kwargs.get("min", 0) != sample.kwargs.get("max", 0),
}


def _checks(op, full: bool):
    """(flat sample, in_dims, nested) triples of the op, as the OpInfo sweep draws them."""
    from tests.support import opinfo_sweep as sweep
    reason = sweep.skip_reason(op)
    if reason:
        return None, reason
    torch.manual_seed(0)
    flats = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            keep = _AUDIT_SAMPLE_FILTER.get(op.name, lambda sample: True)
            for sample in op.sample_inputs("cpu", torch.float32, requires_grad=False):
                if not keep(sample):
                    continue
                flat, _ = sweep.flatten_sample(op, sample)
                if flat is not None and sweep._is_deterministic_or_fails(flat) \
                        and flat.randomness == "error":
                    flats.append(flat)
                if len(flats) == (sweep.FULL_SAMPLES if full else AUDIT_SAMPLES):
                    break
        except Exception as e:                    # the sweep reports these; nothing to audit
            return None, f"sample generation failed: {type(e).__name__}"
    if not flats:
        return None, "no deterministic float32 sample"
    out = []
    for k, flat in enumerate(flats):
        choices = sweep.choices_for(len(flat.tensors), 26 if full else AUDIT_IN_DIMS, salt=k)
        out += [(flat, dims, False) for dims in choices] + [(flat, choices[0], True)]
    return out, None


def _batch(op, flat, dims, nested):
    from tests.support import opinfo_sweep as sweep
    levels = 2 if nested else 1
    sizes = [sweep.SIZE, sweep.OUTER_SIZE][:levels]
    fixes = sweep.DOMAIN.get(op.name, {})
    return [t if d is None else sweep.build_batch(t, [d] * levels, sizes, fixes.get(j),
                                                  itertools.count())
            for j, (t, d) in enumerate(zip(flat.tensors, dims))]


def _programs(flat, dims, nested):
    """(functrans's vmap of the op, the for-loop of the op) over the same batch."""
    from tests.support import opinfo_sweep as sweep
    from tests.support.oracles import loop_oracle
    import functrans
    inner = functrans.vmap(flat.call, in_dims=dims)
    program = functrans.vmap(inner, in_dims=dims) if nested else inner
    size = sweep.OUTER_SIZE if nested else sweep.SIZE
    example = flat.call
    if nested:
        example = lambda *a: loop_oracle(flat.call, dims, sweep.SIZE, *a)  # noqa: E731
    return program, lambda *a: loop_oracle(example, dims, size, *a)


def _describe(op, flat, dims, nested) -> str:
    shapes = [tuple(t.shape) for t in flat.tensors]
    return f"{op.name} shapes={shapes} in_dims={dims}{' (vmap of vmap)' if nested else ''}"


def audit_host_syncs(op, full: bool = False) -> OpAudit:
    """functrans's vmap of the op issues no kind of host sync its for-loop does not."""
    from tests.support import opinfo_sweep as sweep
    res = OpAudit(sweep.op_id(op))
    checks, res.skipped = _checks(op, full)
    for flat, dims, nested in checks or ():
        batch = _batch(op, flat, dims, nested)
        program, loop = _programs(flat, dims, nested)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                ref = syncs_of(lambda: loop(*batch))
                got = syncs_of(lambda: program(*batch))
            except Exception:                 # a failing run is the sweep's business
                continue
        res.checked += 1
        extra = {k: dict(v) for k, v in got.items() if k not in ref}
        if extra:
            res.problems.append(f"{_describe(op, flat, dims, nested)}: functrans syncs the host "
                                f"where the loop does not: {extra}")
    return res


def audit_fake_gpu(op, full: bool = False) -> OpAudit:
    """functrans's vmap of the op runs on the fake GPU wherever its for-loop does, with the
    loop's output shapes, dtypes and devices (``install_fake_gpu`` must have run)."""
    from tests.support import opinfo_sweep as sweep
    res = OpAudit(sweep.op_id(op))
    checks, res.skipped = _checks(op, full)
    for flat, dims, nested in checks or ():
        batch = _batch(op, flat, dims, nested)
        program, loop = _programs(flat, dims, nested)
        with warnings.catch_warnings(), fake_gpu_mode():
            warnings.simplefilter("ignore")
            gpu_batch = on_device(batch, FAKE_GPU)
            try:
                expected = loop(*gpu_batch)
            except Exception:                 # the op itself cannot run on a fake device
                continue
            try:
                actual, error = program(*gpu_batch), None
            except Exception as e:
                error = first_line(e)
        if error is not None and _fails_on_cpu(program, batch):
            continue                          # not a device matter: the OpInfo sweep reports it
        res.checked += 1
        if error is not None:
            res.problems.append(f"{_describe(op, flat, dims, nested)}: functrans fails on the "
                                f"GPU where the loop runs (and on the CPU it runs): {error}")
            continue
        diff = same_metadata(actual, expected)
        if diff:
            res.problems.append(f"{_describe(op, flat, dims, nested)}: {diff}")
    return res


def _fails_on_cpu(program, batch) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            program(*batch)
        except Exception:
            return True
    return False


# ---------------------------------------------------------------------------------------------
# The program audits: every transform and the models users run (tests/support/device_programs.py).
# Host syncs: functrans beside torch.func on the CPU; where torch.func cannot run a program (GRU
# per-sample gradients, checkpoint inside grad) functrans must issue no host sync at all.
# Devices: functrans on the fake GPU beside functrans on the CPU (whose values the other tests
# check against torch.func): the same shapes and dtypes, every output on the GPU.  torch.func is
# not run on the fake GPU: its vmap(hessian) aborts the process there.

def audit_program_syncs(make) -> Optional[str]:
    """What a program's functrans run makes the host wait for that torch.func's does not."""
    import functrans
    import torch.func
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = syncs_of(make(functrans, cpu))
        try:
            ref = syncs_of(make(torch.func, cpu))
        except Exception:
            ref = {}
    extra = {k: dict(v) for k, v in got.items() if k not in ref}
    return f"functrans syncs the host where torch.func does not: {extra}" if extra else None


def audit_program_device(make) -> Optional[str]:
    """A program's functrans run on the fake GPU fails, or differs from its run on the CPU in
    shapes or dtypes, or leaves an output off the GPU (``install_fake_gpu`` must have run)."""
    import functrans
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = make(functrans, torch.device("cpu"))()
        with fake_gpu_mode():
            try:
                got = make(functrans, torch.device(FAKE_GPU))()
            except Exception as e:
                return f"functrans fails on the GPU: {first_line(e)}"
    return same_metadata(got, expected, device=FAKE_GPU)


# ---------------------------------------------------------------------------------------------
# Which ops, the planted bugs that prove the audits catch what they are for, and the runner.

# Beyond the OpInfo fast subset: the families whose rules build index, scalar or helper tensors,
# or check values (the likely places for a CPU-made tensor or a host sync).
EXTRA_OPS = (
    "index_select", "gather", "scatter", "scatter_add", "scatter_reduce", "index_add",
    "index_copy", "index_fill", "index_put", "take_along_dim", "take", "put", "masked_scatter",
    "nn.functional.embedding", "nn.functional.cross_entropy", "nn.functional.nll_loss",
    "nn.functional.mse_loss", "nn.functional.conv1d", "nn.functional.conv2d",
    "nn.functional.max_pool2d", "nn.functional.avg_pool2d", "nn.functional.layer_norm",
    "nn.functional.group_norm", "nn.functional.batch_norm", "nn.functional.pad",
    "nn.functional.interpolate", "searchsorted", "bucketize", "sort", "topk", "kthvalue",
    "cross", "linalg.solve", "linalg.inv", "histc", "histogram", "linspace", "logspace",
    "as_strided_scatter", "diagonal_scatter", "select_scatter", "slice_scatter", "renorm",
    "cdist", "nn.functional.grid_sample", "nn.functional.unfold", "trace",
)


def audit_ops(full: bool):
    from tests.support import opinfo_sweep as sweep
    if full:
        return sweep.select_ops(True)
    wanted = set(sweep.FAST_OPS) | set(EXTRA_OPS)
    return [op for op in sweep.all_ops() if op.name in wanted]


@contextlib.contextmanager
def planted_rule(op, rule):
    """``rule`` in place of ``op``'s batching rule for the block (the audits' own tests)."""
    from functrans.batching import registry
    saved = registry._registrations.get(op)
    registry.register_batch_rule(op, rule)
    try:
        yield
    finally:
        if saved is None:
            registry.unregister_batch_rule(op)
        else:
            registry._registrations[op] = saved
            registry._entries.clear()


def cpu_made_tensor_rule(info, in_dims, x):
    """A planted device bug: a helper tensor made on the CPU (``torch.zeros(n)``) mixed into
    the result."""
    return torch.exp(x) + torch.zeros(x.shape[-1], dtype=x.dtype), in_dims[0]


def value_read_rule(info, in_dims, x):
    """A planted host sync: a value read back to decide something."""
    if bool(torch.isfinite(x).all()):
        return torch.exp(x), in_dims[0]
    return torch.exp(x), in_dims[0]


def run_fake_gpu_audit(full: bool) -> dict:
    """Every device audit, on the fake GPU: ops, programs, benchmark workloads, and the planted
    bug.  Run in a fresh process (``main``): the fake GPU must be installed before autograd
    first runs, and stays installed."""
    install_fake_gpu()
    from tests.support import device_programs
    from tests.support import opinfo_sweep as sweep
    out = {"ops": {}, "programs": {}, "workloads": {}, "planted": None}
    for op in audit_ops(full):
        r = audit_fake_gpu(op, full)
        out["ops"][r.op] = dataclasses.asdict(r)
    for name, make in device_programs.PROGRAMS.items():
        if name in device_programs.NOT_ON_A_FAKE_DEVICE:
            continue
        out["programs"][name] = audit_program_device(make)
    for w in _workloads():
        out["workloads"][w.id] = audit_program_device(_workload_program(w))
    exp = next(op for op in sweep.all_ops() if op.name == "exp")
    with planted_rule(aten.exp.default, cpu_made_tensor_rule):
        out["planted"] = dataclasses.asdict(audit_fake_gpu(exp))
    return out


def _workloads():
    """The benchmark's small rows that run without optional packages."""
    from benchmarks.workloads import WORKLOADS
    return [w for w in WORKLOADS if w.tier == "small" and w.requires is None]


def audit_workload_syncs(w) -> Optional[str]:
    """What a benchmark row's functrans column makes the host wait for that its Python loop
    over examples does not."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = w.build(torch.device("cpu"))
        extra = extra_syncs(row.impls["functrans"], row.impls["loop"])
    return f"functrans syncs the host where the loop does not: {extra}" if extra else None


def _workload_program(w):
    """A benchmark row as a program: ``lib`` picks the column (functrans or torch.func)."""
    def make(lib, device):
        from tests.support.device_programs import remake_on
        original = torch.nn.Module.to

        def to(module, *args, **kwargs):      # the rows call model.to(device)
            dev = args[0] if args else kwargs.get("device")
            if isinstance(dev, (str, torch.device)) and torch.device(dev).type == FAKE_GPU:
                return remake_on(module, dev)
            return original(module, *args, **kwargs)

        torch.nn.Module.to = to
        try:
            row = w.build(torch.device(device))
        finally:
            torch.nn.Module.to = original
        return row.impls["functrans" if lib.__name__ == "functrans" else "torch.func"]
    return make


def main(argv=None) -> int:
    import argparse
    import json
    parser = argparse.ArgumentParser(description="the fake-GPU device audit (a JSON report)")
    parser.add_argument("--full", action="store_true", help="every op of op_db")
    parser.add_argument("--json", required=True, help="where to write the report")
    args = parser.parse_args(argv)
    report = run_fake_gpu_audit(args.full)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
