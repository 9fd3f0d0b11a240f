"""Training with train.device: cuda (one GPU, one process). Needs a CUDA device, except the first
test, which checks that a machine without one refuses the setting before any work."""

from __future__ import annotations

import pytest
import torch

from neorec.checkpoint.load import latest_checkpoint
from neorec.config.load import load_config
from neorec.errors import ConfigError
from neorec.train.trainer import Trainer

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=12000", "data.synthetic.eval_samples=3000", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=5",
]  # fmt: skip


def run(tmp_path, name: str, extra=()):
    return Trainer(load_config("default", TINY + list(extra)), tmp_path / name).fit()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_before_work(tmp_path):
    with pytest.raises(ConfigError, match="train.device is cuda"):
        Trainer(load_config("default", [*TINY, "train.device=cuda"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


@needs_cuda
@pytest.mark.parametrize("arch", ["dlrm", "dcnv2"])
def test_cuda_training_follows_cpu_training(tmp_path, arch):
    """Same data and seed on both devices: the loss curves agree closely (different kernels and
    summation orders, so not bitwise) and both learn."""
    extra = [f"model.arch={arch}", "data.synthetic.generator=host"]  # the same samples
    extra += ["model.low_rank=4"] if arch == "dcnv2" else []  # low-rank cross weights: dcnv2 only
    cpu = run(tmp_path, "cpu", extra)
    gpu = run(tmp_path, "gpu", [*extra, "train.device=cuda"])
    assert len(gpu.losses) == len(cpu.losses) == 47
    for a, b in zip(gpu.losses[:10], cpu.losses[:10], strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), (gpu.losses[:10], cpu.losses[:10])
    assert gpu.eval["auc"] > 0.65 and abs(gpu.eval["auc"] - cpu.eval["auc"]) < 0.01, (gpu.eval, cpu.eval)


@needs_cuda
def test_cuda_training_is_deterministic_and_resumes(tmp_path):
    """Two runs give bitwise the same losses; a run stopped after a checkpoint and resumed ends with
    bitwise the same model as one that was not stopped."""
    extra = ["train.device=cuda", "train.max_steps=20", "checkpoint.every_steps=7", "embedding.optimizer.name=adam"]
    a, b = run(tmp_path, "a", extra), run(tmp_path, "b", extra)
    assert a.losses == b.losses
    short = run(tmp_path, "c", [*extra[:1], "train.max_steps=14", *extra[2:]])
    assert latest_checkpoint(tmp_path / "c" / "checkpoints").name == "step-00000014"
    cfg = load_config("default", TINY + extra)
    resumed = Trainer(cfg, tmp_path / "c", resume=True).fit()
    assert short.losses + resumed.losses == a.losses
    final = torch.load(tmp_path / "c" / "model.pt", weights_only=True)
    for key, value in torch.load(tmp_path / "a" / "model.pt", weights_only=True).items():
        assert torch.equal(value, final[key]), key


@needs_cuda
@pytest.mark.parametrize("tier", ["dram", "ssd"])
def test_cuda_training_through_a_gpu_cache(tmp_path, tier):
    """embedding.tier dram or ssd on a GPU: a cache of 20% of the rows in GPU memory over host memory
    or over the tables' files trains as the tables in GPU memory do (both through the Triton kernels,
    the cached groups on the cache's records: bitwise the same losses), and logs its hit rate and
    the MiB it moved from its tier."""
    plain = run(tmp_path, "plain", ["train.device=cuda", "train.max_steps=30"])
    cached = run(tmp_path, "cached", ["train.device=cuda", "train.max_steps=30", f"embedding.tier={tier}",
                                      "embedding.cache.fraction=0.2", f"embedding.cache.directory={tmp_path / 'tables'}"])  # fmt: skip
    assert cached.losses == plain.losses
    lines = (tmp_path / "cached" / "metrics.jsonl").read_text().splitlines()
    assert any('"cache"' in line and "hit_rate" in line and f"mib_from_{tier}" in line for line in lines)


@needs_cuda
def test_cuda_training_over_ssd_files_resumes_bitwise(tmp_path):
    """A GPU cache over SSD files: a run stopped after a checkpoint and resumed (its files made
    afresh, the rows loaded from the checkpoint) ends with bitwise the same losses and model as one
    that was not stopped."""
    extra = ["train.device=cuda", "checkpoint.every_steps=7", "embedding.optimizer.name=adam",
             "embedding.tier=ssd", "embedding.cache.fraction=0.2"]  # fmt: skip
    a = run(tmp_path, "a", [*extra, "train.max_steps=20", f"embedding.cache.directory={tmp_path / 'a-tables'}"])
    stopped = [*extra, f"embedding.cache.directory={tmp_path / 'c-tables'}"]
    short = run(tmp_path, "c", [*stopped, "train.max_steps=14"])
    assert latest_checkpoint(tmp_path / "c" / "checkpoints").name == "step-00000014"
    resumed = Trainer(load_config("default", TINY + stopped + ["train.max_steps=20"]), tmp_path / "c", resume=True).fit()
    assert short.losses + resumed.losses == a.losses
    final = torch.load(tmp_path / "c" / "model.pt", weights_only=True)
    for key, value in torch.load(tmp_path / "a" / "model.pt", weights_only=True).items():
        assert torch.equal(value, final[key]), key


@needs_cuda
@pytest.mark.parametrize("optimizer", ["rowwise_adagrad", "adam"])
def test_steady_state_gpu_steps_never_wait_on_the_host(tmp_path, optimizer):
    """After a few warm-up steps, training steps on one GPU (data drawn on the device, Triton lookup
    and fused update, dense Adam) run under torch.cuda.set_sync_debug_mode("error"): nothing in a
    step reads a value or a size back to the host."""
    from neorec.data.device_feed import DeviceFeed
    from neorec.train.pipeline import pipelined

    cfg = load_config("default", TINY + ["train.device=cuda", f"embedding.optimizer.name={optimizer}"])
    trainer = Trainer(cfg, tmp_path / "run")
    feed = DeviceFeed(trainer.data.train_batches(0, None), trainer.device, depth=2)
    batches = (local for _, local in pipelined(feed, lambda b: b, trainer.embeddings, 1))
    for _ in range(3):
        trainer.train_step(next(batches), is_local=True)
    ready = [next(batches) for _ in range(3)]  # drawn before the check: the first pass draws blocks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [trainer.train_step(b, is_local=True) for b in ready]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(bool(torch.isfinite(x)) for x in losses)


@needs_cuda
def test_a_second_run_loads_the_kernels_the_first_compiled_into_train_kernel_cache(tmp_path):
    """Each run in a process of its own (Triton keeps the kernels a process compiled in memory too):
    the first compiles the engine's kernels into train.kernel_cache/triton, the second loads them
    from there and adds nothing."""
    import os
    import subprocess
    import sys

    from tiny_cli import sets

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}
    kept = tmp_path / "kernels" / "triton"

    def train(name: str) -> set:
        argv = [*sets([*TINY, "train.device=cuda", "train.max_steps=4", f"train.kernel_cache={tmp_path / 'kernels'}"])]
        p = subprocess.run([sys.executable, "-m", "neorec", "train", *argv, "--output-dir", str(tmp_path / name)],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
        return {f.relative_to(kept) for f in kept.rglob("*") if f.is_file()}

    first = train("first")
    assert any(f.suffix == ".cubin" for f in first), sorted(map(str, first))[:20]
    assert train("second") == first
