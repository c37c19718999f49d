"""Real models: functrans against torch.func, eager, one torch thread.

    python -m benchmarks.real_models                       # every model, the markdown table
    python -m benchmarks.real_models --models gpt2,bert --repeats 7 --markdown real.md

The models and workloads are those of ``tests/models/real/`` (``zoo.py``: HF transformers'
GPT-2, BERT, DistilBERT, Llama, T5, BART, ViT and timm's ResNet with GroupNorm, ResNet with
BatchNorm replaced / in eval mode, ViT, ConvNeXt, from tiny configs).  Workloads: per-sample
gradients (``vmap(grad)`` over ``functional_call``), an ensemble of two models
(``stack_module_state`` + ``vmap``), ``vmap(jvp)`` and ``vmap(vjp)`` of the logits w.r.t. the
input embeddings or pixels, and, for the attention models, ``jacfwd`` of the logits and the
``hessian`` of a scalar at one example.

For each cell, before anything is timed, functrans runs under ``strict_fallback()`` inside
``record_fallbacks()`` and torch.func runs as is; each result is compared with the plain eager
loop (one example or one model at a time).  The outcome says what happened: ``ok`` (both agree
with the loop), ``torch.func fails`` (with its error; functrans's time is still reported),
``functrans FAILS`` / ``DIFFERS`` (a bug: the command exits with status 1).  Where
torch.func fails, it is run again with sdpa's math kernel forced for the whole call
(``sdpa_kernel([SDPBackend.MATH])``, the workaround a torch.func user has), and the ratio is
against that when it agrees with the loop (the outcome says so).  Timing: one torch
thread, both libraries in the same process, one warm-up call each, then ``--repeats`` rounds
in which each library is timed once (alternating which goes first); the median per call is
reported with the ratio functrans / torch.func (below 1: functrans is faster).  The loop
column is the plain eager loop, for scale (none for the hessian, whose check computes only
three Hessian-vector products).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional, Tuple

import torch

import functrans as ft
from tests.models.real import zoo
from tests.support.oracles import assert_same

TOL = dict(rtol=1e-4, atol=1e-5)
TOL_SECOND_ORDER = dict(rtol=1e-3, atol=1e-4)   # as tests/models/real: float32 second order
ATTENTION_ONLY = {"jacfwd", "hessian"}


def _workloads(spec: zoo.Spec) -> Dict[str, Tuple[Callable, Callable]]:
    """name -> (run(lib), loop()): one call of the workload, and the plain eager reference."""
    model = spec.make(0)
    models = [spec.make(0), spec.make(1)]
    xs, ys = spec.batch()
    es, ts, cts = zoo.embeds_and_directions(spec, model, xs)
    e = es[0]
    out = {
        "per-sample grads": (lambda lib: zoo.per_sample_grads(lib, spec, model, xs, ys),
                             lambda: zoo.loop_per_sample_grads(spec, model, xs, ys)),
        "ensemble": (lambda lib: zoo.ensemble(lib, spec, models, xs),
                     lambda: zoo.loop_ensemble(spec, models, xs)),
        "vmap(jvp)": (lambda lib: zoo.jvp_embeds(lib, spec, model, es, ts),
                      lambda: zoo.loop_jvp_embeds(spec, model, es, ts)),
        "vmap(vjp)": (lambda lib: zoo.vjp_embeds(lib, spec, model, es, cts),
                      lambda: zoo.loop_vjp_embeds(spec, model, es, cts)),
    }
    if spec.attention:
        n = e.numel()
        vs = torch.randn(3, *e.shape, generator=torch.Generator().manual_seed(3))
        out["jacfwd"] = (lambda lib: zoo.jacfwd_logits(lib, spec, model, e),
                         lambda: zoo.loop_jacobian_logits(spec, model, e))
        # checked by its products with three random directions (the full loop Hessian of an
        # image is hundreds of double-backward passes); timed whole
        out["hessian"] = (
            lambda lib: zoo.hessian_energy(lib, spec, model, e),
            lambda: zoo.loop_hessian_energy(spec, model, e, vs))
        out["hessian"] += ((lambda h: (h.reshape(n, n) @ vs.reshape(3, n).T).T.reshape(
            vs.shape)),)
    return out


def _time(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _short(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    first = first.replace(" that does not support it because it has not been implemented "
                          "yet.", "")   # PyTorch's no-forward-formula message, shortened
    return f"{type(e).__name__}: {first[:100]}"


def run_cell(run: Callable, loop: Callable, check: Optional[Callable], repeats: int) -> dict:
    import torch.func as tf
    tol = TOL if check is None else TOL_SECOND_ORDER
    row: dict = {}
    expected = loop()
    view = check or (lambda r: r)
    try:
        with ft.record_fallbacks() as report, ft.config.strict_fallback():
            got = run(ft)
        assert not report, str(report)
        assert_same(view(got), expected, **tol)
    except Exception as e:   # noqa: BLE001 - reported in the table, and fails the command
        row["outcome"] = f"functrans FAILS: {_short(e)}"
        return row
    tf_ok, run_tf = True, lambda: run(tf)
    try:
        got_tf = run(tf)
        try:
            assert_same(view(got_tf), expected, **tol)
        except AssertionError as e:
            row["tf_note"] = f"torch.func DIFFERS from the loop: {_short(e)}"
            tf_ok = False
    except Exception as e:   # noqa: BLE001 - torch.func's failure is an outcome
        row["tf_note"] = f"torch.func fails: {_short(e)}"
        tf_ok = False
        # the user's workaround: sdpa's math kernel forced for the whole call
        try:
            with zoo._math_attention():
                got_tf = run(tf)
            assert_same(view(got_tf), expected, **tol)
            row["tf_note"] += " (ratio: torch.func with sdpa_kernel(MATH))"
            tf_ok, run_tf = True, lambda: _with_math_attention(lambda: run(tf))
        except Exception:   # noqa: BLE001 - no ratio then
            pass
    t_ft: List[float] = []
    t_tf: List[float] = []
    t_loop: List[float] = []
    for i in range(repeats):
        order = [("ft", lambda: run(ft)), ("tf", run_tf)] if tf_ok else \
            [("ft", lambda: run(ft))]
        if i % 2:
            order.reverse()
        for who, fn in order:
            (t_ft if who == "ft" else t_tf).append(_time(fn))
        if check is None:   # (a checked view: the loop computes less than the workload)
            t_loop.append(_time(loop))
    row["ft"] = statistics.median(t_ft)
    if t_loop:
        row["loop"] = statistics.median(t_loop)
    if tf_ok:
        row["tf"] = statistics.median(t_tf)
    row["outcome"] = row.get("tf_note", "ok")
    return row


def _with_math_attention(fn: Callable[[], object]) -> object:
    with zoo._math_attention():
        return fn()


def table(models: List[str], repeats: int, workloads: Optional[List[str]] = None
          ) -> Tuple[str, bool]:
    """The markdown table, and whether a functrans cell failed; ``workloads``: only these."""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    lines = [f"Real models, eager, CPU, 1 torch thread, torch {torch.__version__}; median of "
             f"{repeats} after a warm-up. ratio = functrans / torch.func (< 1: functrans "
             "faster); loop = the plain eager loop.", "",
             "| model | workload | outcome | functrans ms | torch.func ms | ratio | loop ms |",
             "|---|---|---|---:|---:|---:|---:|"]
    failed = False
    for name in models:
        try:
            spec = zoo.spec(name)
        except ImportError as e:
            lines.append(f"| {name} | – | SKIPPED: {e} | | | | |")
            continue
        for wl, entry in _workloads(spec).items():
            if workloads is not None and wl not in workloads:
                continue
            run, loop = entry[0], entry[1]
            check = entry[2] if len(entry) > 2 else None
            # warm-up: the first calls import and build caches
            for lib_call in (lambda: run(ft), loop):
                try:
                    lib_call()
                except Exception:   # noqa: BLE001 - run_cell reports it
                    pass
            row = run_cell(run, loop, check, repeats)
            failed |= row["outcome"].startswith("functrans")
            ms = lambda k: f"{1e3 * row[k]:.1f}" if k in row else "–"   # noqa: E731
            ratio = f"{row['ft'] / row['tf']:.2f}" if "tf" in row else "–"
            lines.append(f"| {name} | {wl} | {row['outcome']} | {ms('ft')} | {ms('tf')} | "
                         f"{ratio} | {ms('loop')} |")
            print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines), failed


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(zoo.MODELS),
                   help="comma-separated names (default: all): " + ", ".join(zoo.MODELS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workloads", help="comma-separated workload names (default: all)")
    p.add_argument("--markdown", help="also write the table to this file")
    args = p.parse_args(argv)
    text, failed = table([m for m in args.models.split(",") if m], args.repeats,
                         args.workloads.split(",") if args.workloads else None)
    return emit(text, args.markdown, failed)


def emit(text: str, markdown: Optional[str], failed: bool) -> int:
    """Print the table, write it to ``markdown`` if given; the command's exit status."""
    print(text)
    if markdown:
        with open(markdown, "w") as fh:
            fh.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
