"""examples/ddp_torchdata.py: a torchdata.nodes pipeline feeding DP-SGD under
DistributedDataParallel(static_graph=True).

* the pipeline alone, in process: each step, the ranks' local batches are disjoint and their
  union is the single process's batch (one seeded permutation per epoch, shared by the ranks);
* the README's two commands, run as a user would (torchrun with 2 gloo processes on CPU, then
  plain python as the 1-process reference): the same final parameters.
"""
import importlib.util
import os
import pathlib
import re
import shlex
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchdata")

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "ddp_torchdata.py"


def _example():
    spec = importlib.util.spec_from_file_location("ddp_torchdata_example", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _Indices:
    """A map-style dataset whose example i is (tensor(i),): batches show which examples."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return (torch.tensor(i),)


def _epochs(loader, epochs):
    """[epoch][step] -> list of example indices, over ``epochs`` passes of the loader."""
    return [[batch[0].tolist() for batch in loader] for _ in range(epochs)]


@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_shards_are_disjoint_and_their_union_is_the_global_batch(world):
    ex = _example()
    n, batch, seed, epochs = 100, 12, 7, 3
    data = _Indices(n)
    one = _epochs(ex.make_loader(data, global_batch=batch, rank=0, world_size=1, seed=seed),
                  epochs)
    ranks = [_epochs(ex.make_loader(data, global_batch=batch, rank=r, world_size=world,
                                    seed=seed), epochs) for r in range(world)]
    for epoch in range(epochs):
        # the single process: consecutive slices of one permutation drawn from seed + epoch
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        assert one[epoch] == [perm[k * batch:(k + 1) * batch].tolist()
                              for k in range(n // batch)]
        for r in range(world):
            assert len(ranks[r][epoch]) == n // batch           # same number of steps
        for step, global_batch in enumerate(one[epoch]):
            shards = [ranks[r][epoch][step] for r in range(world)]
            assert all(len(s) == batch // world for s in shards)
            union = [i for s in shards for i in s]
            assert len(set(union)) == len(union)                  # disjoint
            assert sorted(union) == sorted(global_batch)          # = the global batch
    # the shuffle: a new order every epoch, the same order for the same seed, another for
    # another seed
    assert one[0] != one[1]
    again = _epochs(ex.make_loader(data, global_batch=batch, rank=0, world_size=1, seed=seed), 2)
    assert again == one[:2]
    other = _epochs(ex.make_loader(data, global_batch=batch, rank=0, world_size=1,
                                   seed=seed + 1), 1)
    assert other[0] != one[0]


def test_pipeline_batches_hold_the_dataset_rows_and_refuse_an_indivisible_batch():
    ex = _example()
    data = ex.SyntheticDataset(64, seed=3)
    x, y = next(iter(ex.make_loader(data, global_batch=8, rank=1, world_size=2, seed=0)))
    assert x.shape == (4, 16) and y.shape == (4,)
    rows = [int((data.x == row).all(1).nonzero()) for row in x]   # each row is a dataset row
    assert torch.equal(data.y[rows], y)
    with pytest.raises(ValueError, match="--batch-size=10 .* divisible .* 3"):
        ex.make_loader(data, global_batch=10, rank=0, world_size=3, seed=0)


def _readme_command(prefix):
    """The README's command line that starts with ``prefix`` (the user's command)."""
    text = (ROOT / "README.md").read_text()
    lines = [ln.split("#")[0].strip() for ln in text.splitlines()
             if ln.strip().startswith(prefix)]
    assert lines, f"the README shows no command starting with {prefix!r}"
    return shlex.split(lines[0])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(argv, out):
    """Run a README command with ``--out`` redirected to ``out``; its stdout."""
    i = argv.index("--out")
    argv = argv[:i + 1] + [str(out)] + argv[i + 2:]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, f"{shlex.join(argv)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _torchrun():
    exe = pathlib.Path(sys.executable).parent / "torchrun"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def test_torchrun_two_processes_equal_one_process(tmp_path):
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is unavailable")
    two = _readme_command("torchrun --nproc_per_node=2 examples/ddp_torchdata.py")
    # the README's command, with this environment's torchrun and a port nobody else uses
    two = _torchrun() + [f"--master_port={_free_port()}"] + two[1:]
    one = _readme_command("python examples/ddp_torchdata.py")
    one = [sys.executable] + one[1:]
    log2 = _run(two, tmp_path / "two.pt")
    log1 = _run(one, tmp_path / "one.pt")
    p2, p1 = torch.load(tmp_path / "two.pt"), torch.load(tmp_path / "one.pt")

    # each rank took half of every batch; the runs printed the same per-epoch losses
    assert "256 examples on rank 0 of 2" in log2 and "512 examples on rank 0 of 1" in log1
    assert "parameters identical on every rank" in log2
    losses = [[float(v) for v in re.findall(r"loss (\d+\.\d+)", log)] for log in (log1, log2)]
    assert len(losses[0]) >= 3 and losses[0] == pytest.approx(losses[1], abs=2e-4), (log1, log2)
    assert losses[0][-1] < losses[0][0]
    # Equal up to float summation order only: one process sums the 32 clipped gradients (and
    # then the noise) at once; two sum 16 each, rank 0 adds the noise to its part, and DDP adds
    # the two parts (the scale by 2 and DDP's division by 2 are exact).  Observed: 1.5e-7.
    init = _example().make_model(0).state_dict()
    assert p1.keys() == p2.keys() == init.keys()
    for k in p1:
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-5, atol=1e-6)
        assert (p1[k] - init[k]).abs().max() > 1e-2   # training moved it: the check has teeth
