"""Every Python example in the README runs (in order, one namespace, as a reader would paste
them), and the per-sample-gradient and ensemble examples give what they claim."""
import pathlib
import re
import warnings

import torch

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_examples_run(capsys):
    blocks = _blocks()
    assert len(blocks) >= 4
    ns = {}
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback-report example falls back on purpose
        for code in blocks:
            exec(compile(code, str(README), "exec"), ns)
    assert "aten.histogram" in capsys.readouterr().out   # the printed fallback report
    grads = ns["grads"]
    assert grads["0.weight"].shape == (64, 32, 8)
    # the ensemble's per-member outputs equal its members run one by one
    ens, xs = ns["ens"], ns["xs"]
    out = ens(xs)
    members = ens.members()
    torch.testing.assert_close(out, torch.stack([m(xs) for m in members]), rtol=1e-5,
                               atol=1e-6)
    # the DP-SGD example produced one noisy gradient per parameter
    assert set(ns["noisy"]) == {n for n, _ in ns["model"].named_parameters()}


def test_the_default_run_leaves_the_sweeps_to_their_marker():
    # the README's `bash scripts/test.sh -m sweep` runs the long sweeps; the default run must not
    import tomllib
    from pathlib import Path
    conf = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    ini = conf["tool"]["pytest"]["ini_options"]
    assert "-m 'not sweep'" in ini["addopts"]
    assert any(m.startswith("sweep:") for m in ini["markers"])
