"""The library examples run the way docs/library.md tells users to run them: examples/two_tower.py in
one process, examples/two_tower_sharded.py under torchrun with 2 gloo processes. The sharded run,
and the same model under torch's DistributedDataParallel, must train the model the single process
trains (same losses, same checkpointed tables), and every code block of docs/library.md must be the
examples' code, so the page cannot drift from them."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from forked import run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DOC = ROOT / "docs" / "library.md"
STEPS = 30
SMALL = ["--steps", str(STEPS), "--log-every", "1"]


def _run(args: list[str]) -> str:
    """`python *args` from the repository root, in a process of its own forked from one that has
    imported torch (tests/forked.py); its stdout (stderr in the failure message)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the tiny model gains nothing from threads
    p = run_python(args, cwd=ROOT, env=env, timeout=300)
    assert p.returncode == 0, f"python {' '.join(args)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}"
    return p.stdout


def _losses(stdout: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step\s+\d+\s+loss\s+(\S+)$", stdout, flags=re.MULTILINE)]


def _examples():
    """The example scripts as modules (two_tower_sharded imports two_tower as a neighbour)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    import two_tower
    import two_tower_sharded

    return two_tower, two_tower_sharded


def _trained_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The checkpoint loaded into a one-process model: tables (weights, adagrad state) and towers."""
    from neorec.checkpoint import load_checkpoint
    from neorec.embedding import FusedEmbeddingCollection

    tt, _ = _examples()
    model, optimizers = tt.build(FusedEmbeddingCollection(tt.TABLES, tt.OPTIMIZER, seed=7))
    load_checkpoint(checkpoint, model.embeddings, model, optimizers, restore_rng=False)
    return model.state_dict()


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[str, Path]:
    out = tmp_path_factory.mktemp("two_tower")
    return _run(["examples/two_tower.py", *SMALL, "--out", str(out)]), out


def test_single_process_example_learns_and_reloads_its_checkpoint(single):
    stdout, out = single
    losses = _losses(stdout)
    assert len(losses) == STEPS
    assert sum(losses[-10:]) / 10 < losses[0] - 0.15  # from ~0.66 (chance) towards the click structure
    assert "loaded it into a fresh model: equal" in stdout  # the script compares every tensor itself
    assert [p.name for p in out.iterdir()] == [f"step-{STEPS:08d}"]


@pytest.mark.distributed
def test_sharded_example_under_torchrun_trains_the_single_process_model(single, tmp_path):
    stdout, single_out = single
    sharded = _run([  # torchrun's agent; the workers it starts are real `python examples/two_tower_sharded.py`
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        f"--log-dir={tmp_path / 'agent'}",  # not a /tmp/torchelastic_* of its own
        "examples/two_tower_sharded.py", *SMALL, "--out", str(tmp_path),
    ])  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(_losses(sharded)), torch.tensor(_losses(stdout)), rtol=0, atol=1e-5
    )
    assert "loaded under another plan and into one process: same scores" in sharded
    # the checkpoint of 2 processes (3 sharding kinds) holds what the one-process run's holds
    name = f"step-{STEPS:08d}"
    one, two = _trained_state(single_out / name), _trained_state(tmp_path / name)
    assert one.keys() == two.keys() and any(k.endswith("category.momentum1") for k in one)
    for key in one:  # to 1e-4 of each tensor's largest value (the runs round floats differently)
        err = float((two[key].double() - one[key].double()).abs().max())
        assert err <= 1e-4 * float(one[key].double().abs().max()), f"{key}: max difference {err}"


def _ddp_run(topo, steps: int, batch_size: int) -> list[float]:
    """The sharded example's model with torch's DistributedDataParallel averaging the towers'
    gradients in place of DenseGradSync; the global batch's loss of every step."""
    import torch.distributed as dist
    import torch.nn.functional as F

    from neorec.distributed import Comms, ShardedEmbeddingCollection

    tt, sharded = _examples()
    embeddings = ShardedEmbeddingCollection(tt.TABLES, tt.OPTIMIZER, sharded.PLAN, Comms(topo), seed=0)
    model, optimizers = tt.build(embeddings)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    b, losses = batch_size // topo.world_size, []
    for step in range(steps):
        sparse, labels = tt.make_batch(step, batch_size)
        mine = slice(topo.rank * b, (topo.rank + 1) * b)
        loss = F.binary_cross_entropy_with_logits(
            ddp(sparse.slice_samples(mine.start, mine.stop)), labels[mine]
        )
        optimizers["dense"].zero_grad()
        loss.backward()
        optimizers["dense"].step()
        optimizers["embedding"].step()
        dist.all_reduce(mean := loss.detach().clone())
        losses.append(mean.item() / topo.world_size)
    return losses


@pytest.mark.distributed
def test_torch_ddp_on_the_towers_trains_the_single_process_model_too(single, tmp_path):
    """What docs/library.md says of DistributedDataParallel around the model."""
    from dist_helpers import spawn

    steps = 10
    results = spawn(2, _ddp_run, (steps, 256), tmp_path=tmp_path)
    expected = torch.tensor(_losses(single[0])[:steps])
    for rank in (0, 1):
        torch.testing.assert_close(torch.tensor(results[rank]), expected, rtol=0, atol=1e-5)


def test_every_code_block_of_the_library_page_is_example_code():
    text = DOC.read_text()
    sources = {p.name: [line.strip() for line in p.read_text().splitlines()] for p in EXAMPLES.glob("*.py")}
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) >= 6
    for block in blocks:
        lines = [line.strip() for line in textwrap.dedent(block).splitlines()]
        found = [
            name
            for name, src in sources.items()
            if any(src[i : i + len(lines)] == lines for i in range(len(src) - len(lines) + 1))
        ]
        assert found, f"this block of {DOC.name} is in no file of examples/:\n{block}"
    for command in (
        "python examples/two_tower.py",
        "torchrun --standalone --nproc-per-node 2 examples/two_tower_sharded.py",
    ):
        assert command in text  # what the tests above run
