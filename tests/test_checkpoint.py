"""Sharded checkpoints: save on 2 gloo ranks, load on 4 ranks under another plan or in one process,
and keep training as if nothing happened; atomic saves; corrupted files; trainer resume; the CLI.

Tolerance of the resharded runs: as in test_distributed (1e-5 relative): fp32 exchanges change only
the order of float additions. A single-process trainer resume is bitwise."""

from __future__ import annotations

import json
import os
import signal
import textwrap

import pytest
import torch
from dist_helpers import build_model, fit_rank, make_batches, make_tables, optimizer_config, run_steps, spawn
from forked import run_python

from neorec.checkpoint import (
    CheckpointError,
    describe,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from neorec.config.load import load_config
from neorec.embedding.fused import FusedEmbeddingCollection
from neorec.errors import ConfigError
from neorec.train.checkpointing import TrainingDiverged
from neorec.train.trainer import Trainer

BEFORE, AFTER, BATCH = 5, 5, 16
OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam"]

# saved by 2 ranks: every kind
SAVE_PLAN = {
    "tables": {
        "t0": {"kind": "tw", "ranks": [1]},
        "t1": {"kind": "rw", "ranks": [0, 1]},
        "t2": {"kind": "cw", "ranks": [1, 0]},
        "t3": {"kind": "twrw", "node": 0},
        "t4": {"kind": "dp"},
        "t5": {"kind": "twcw", "node": 0},
    }
}
# loaded by 4 ranks: every table under another kind or other ranges
LOAD_PLAN_4 = {
    "tables": {
        "t0": {"kind": "rw", "ranks": [3, 1, 0]},
        "t1": {"kind": "cw", "ranks": [2, 0, 1, 3]},
        "t2": {"kind": "cw", "ranks": [3, 2, 1, 0]},
        "t3": {"kind": "dp"},
        "t4": {"kind": "twrw", "node": 0},
        "t5": {"kind": "tw", "ranks": [2]},
    }
}


def plans_for(optimizer_name: str) -> tuple[dict, dict]:
    """Rowwise adagrad keeps one accumulator per column slice: continuing under another column split
    is another algorithm (see pieces.py), so its column-split tables keep their split of 2 slices."""
    if optimizer_name != "rowwise_adagrad":
        return SAVE_PLAN, LOAD_PLAN_4
    load = {"tables": {**LOAD_PLAN_4["tables"], "t1": {"kind": "tw", "ranks": [0]}, "t2": {"kind": "cw", "ranks": [3, 2]},
                       "t5": {"kind": "cw", "ranks": [1, 0]}}}  # fmt: skip
    return SAVE_PLAN, load


def continue_training(model, embeddings, emb_opt, dense_opt, batches, rank, world, comms=None):
    """Steps over `batches` (global); returns the mean loss over ranks of each step."""
    return run_steps(model, embeddings, emb_opt, dense_opt, batches, rank, world, comms)


def build(topo, plan_dict, optimizer_name, comms_out: list | None = None):
    from neorec.distributed.comms import Comms
    from neorec.distributed.plan import ShardingPlan
    from neorec.distributed.sharded import ShardedEmbeddingCollection

    comms = Comms(topo)
    emb = ShardedEmbeddingCollection(
        make_tables(), optimizer_config(optimizer_name), ShardingPlan.from_dict(plan_dict), comms, seed=0
    )
    model = build_model(emb)
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    return comms, emb, model, emb.build_optimizer(), torch.optim.SGD(dense, lr=0.05, momentum=0.9)


def full_state(emb) -> dict:
    return {f"{t}.{k}": v.clone() for t, entries in emb.gather_tables().items() for k, v in entries.items()}


def save_then_continue(topo, plan_dict, optimizer_name, root):
    """Train BEFORE steps, save, train AFTER more: the reference for every resharded load."""
    comms, emb, model, emb_opt, dense_opt = build(topo, plan_dict, optimizer_name)
    batches = make_batches(emb.tables, BEFORE + AFTER, BATCH)
    continue_training(model, emb, emb_opt, dense_opt, batches[:BEFORE], topo.rank, topo.world_size, comms)
    saved = full_state(emb)
    save_checkpoint(root, BEFORE, emb, model, {"dense": dense_opt, "embedding": emb_opt}, {"note": "test"})
    losses = continue_training(
        model, emb, emb_opt, dense_opt, batches[BEFORE:], topo.rank, topo.world_size, comms
    )
    return losses, saved, full_state(emb)


def load_then_continue(topo, plan_dict, optimizer_name, root):
    comms, emb, model, emb_opt, dense_opt = build(topo, plan_dict, optimizer_name)
    manifest = load_checkpoint(
        latest_checkpoint(root), emb, model, {"dense": dense_opt, "embedding": emb_opt}
    )
    assert (
        manifest["step"] == BEFORE and manifest["state"] == {"note": "test"} and manifest["world_size"] == 2
    )
    loaded = full_state(emb)
    batches = make_batches(emb.tables, BEFORE + AFTER, BATCH)
    losses = continue_training(
        model, emb, emb_opt, dense_opt, batches[BEFORE:], topo.rank, topo.world_size, comms
    )
    return losses, loaded, full_state(emb)


def single_process_load_then_continue(optimizer_name, root):
    emb = FusedEmbeddingCollection(
        make_tables(), optimizer_config(optimizer_name), seed=5
    )  # other init: overwritten
    model = build_model(emb)
    emb_opt = emb.build_optimizer()
    dense = [p for n, p in model.named_parameters() if not n.startswith("embeddings.")]
    dense_opt = torch.optim.SGD(dense, lr=0.05, momentum=0.9)
    load_checkpoint(latest_checkpoint(root), emb, model, {"dense": dense_opt, "embedding": emb_opt})
    state = emb.state_dict()
    loaded = {k.removeprefix("tables."): v.clone() for k, v in state.items() if not k.endswith(".step")}
    batches = make_batches(emb.tables, BEFORE + AFTER, BATCH)
    losses = continue_training(model, emb, emb_opt, dense_opt, batches[BEFORE:], 0, 1)
    after = {k.removeprefix("tables."): v for k, v in emb.state_dict().items() if not k.endswith(".step")}
    return losses, loaded, after


def assert_states_close(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for key, value in want.items():
        torch.testing.assert_close(
            torch.as_tensor(got[key]), torch.as_tensor(value), rtol=1e-5, atol=1e-6, msg=f"{what}: {key}"
        )


@pytest.mark.distributed
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_save_two_ranks_load_four_ranks_and_one_process(optimizer_name, tmp_path):
    save_plan, load_plan = plans_for(optimizer_name)
    root = str(tmp_path / "ckpt")
    ref = spawn(2, save_then_continue, (save_plan, optimizer_name, root), tmp_path=tmp_path / "a")
    ref_losses, ref_saved, ref_after = ref[0]
    four = spawn(4, load_then_continue, (load_plan, optimizer_name, root), tmp_path=tmp_path / "b")
    for rank, (losses, loaded, after) in four.items():
        assert_states_close(loaded, ref_saved, f"4 ranks, rank {rank}, as loaded")
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert_states_close(after, ref_after, f"4 ranks, rank {rank}, after {AFTER} more steps")
    losses, loaded, after = single_process_load_then_continue(optimizer_name, root)
    assert_states_close(loaded, ref_saved, "one process, as loaded")  # per-row state: width-weighted mean
    if optimizer_name != "rowwise_adagrad":  # t2/t5 are column-split when saved: see plans_for
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        assert_states_close(after, ref_after, f"one process, after {AFTER} more steps")


# ---- single process: files, atomicity, errors ---------------------------------------------------
def trained_engine(steps: int = 3, optimizer_name: str = "adam"):
    emb = FusedEmbeddingCollection(make_tables(), optimizer_config(optimizer_name), seed=0)
    model = build_model(emb)
    emb_opt = emb.build_optimizer()
    dense_opt = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("embeddings.")])
    continue_training(model, emb, emb_opt, dense_opt, make_batches(emb.tables, steps, BATCH), 0, 1)
    return emb, model, {"dense": dense_opt, "embedding": emb_opt}


def test_round_trip_is_exact_and_keeps_the_last_k(tmp_path):
    emb, model, opts = trained_engine()
    for step in (1, 2, 3, 4):
        path = save_checkpoint(tmp_path, step, emb, model, opts, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]
    assert path == latest_checkpoint(tmp_path) and not list(tmp_path.glob(".*"))
    other, other_model, other_opts = trained_engine(1)
    load_checkpoint(path, other, other_model, other_opts)
    for (k, v), w in zip(emb.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    for (k, v), w in zip(model.state_dict().items(), other_model.state_dict().values(), strict=True):
        assert torch.equal(v, w), k
    assert other_opts["embedding"].num_steps == opts["embedding"].num_steps
    assert str(other_opts["dense"].state_dict()) == str(opts["dense"].state_dict())
    for step in (-1, 1.5, True):  # a negative step removed every later one, then could not be found
        with pytest.raises(CheckpointError, match="step must be a whole number"):
            save_checkpoint(tmp_path, step, emb, model, opts)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003", "step-00000004"]


def test_truncated_or_corrupted_files_name_the_file(tmp_path):
    emb, model, opts = trained_engine()
    path = save_checkpoint(tmp_path, 3, emb, model, opts)
    shard = path / "rank-00000.bin"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin: has \d+ bytes .*truncated"):
        load_checkpoint(path, *trained_engine(1))
    shard.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    with pytest.raises(CheckpointError, match=r"rank-00000\.bin: checksum mismatch"):
        load_checkpoint(path, *trained_engine(1))
    shard.write_bytes(good)
    dense = path / "dense.pt"
    dense.write_bytes(b"not a zip file at all" + dense.read_bytes()[21:])
    with pytest.raises(CheckpointError, match=r"dense\.pt: checksum mismatch"):
        load_checkpoint(path, *trained_engine(1))
    with pytest.raises(
        CheckpointError, match=r"dense\.pt cannot be loaded"
    ):  # unchecked: torch fails, we name it
        load_checkpoint(path, *trained_engine(1), verify=False)
    (path / "manifest.json").write_text("{ half a manifest")
    with pytest.raises(CheckpointError, match=r"manifest\.json cannot be read"):
        load_checkpoint(path, *trained_engine(1))


def test_checkpoint_of_another_model_names_the_table(tmp_path):
    emb, model, opts = trained_engine()
    path = save_checkpoint(tmp_path, 3, emb, model, opts)
    tables = [t.model_copy(update={"rows": 38}) if t.name == "t0" else t for t in make_tables()]
    with pytest.raises(CheckpointError, match=r"table 't0' is 37 x 8 in its manifest.json but 38 x 8"):
        load_checkpoint(path, FusedEmbeddingCollection(tables, optimizer_config("adam")))
    with pytest.raises(CheckpointError, match="'t0' was trained with another embedding optimizer, adam"):
        load_checkpoint(path, FusedEmbeddingCollection(make_tables(), optimizer_config("rowwise_adagrad")))


def test_save_failing_midway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from neorec.checkpoint import files

    emb, model, opts = trained_engine()
    first = save_checkpoint(tmp_path, 3, emb, model, opts)
    calls = {"n": 0}
    append = files.RawWriter.append

    def failing(self, tensor):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk full (simulated)")
        return append(self, tensor)

    monkeypatch.setattr(files.RawWriter, "append", failing)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, 4, emb, model, opts)
    assert latest_checkpoint(tmp_path) == first and list(tmp_path.glob(".step-00000004.tmp"))
    load_checkpoint(first, *trained_engine(1))
    monkeypatch.undo()
    save_checkpoint(tmp_path, 5, emb, model, opts)  # the next save clears the partial one
    assert [p.name for p in tmp_path.iterdir()] and not list(tmp_path.glob(".*"))


def test_save_killed_by_sigkill_leaves_the_previous_checkpoint(tmp_path):
    """A process SIGKILLed while writing its second checkpoint: the first still loads."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_checkpoint import trained_engine
        from neorec.checkpoint import files, save_checkpoint
        emb, model, opts = trained_engine()
        save_checkpoint({str(tmp_path)!r}, 3, emb, model, opts)
        append, calls = files.RawWriter.append, [0]
        def killing(self, tensor):
            calls[0] += 1
            if calls[0] == 7:
                os.kill(os.getpid(), signal.SIGKILL)
            return append(self, tensor)
        files.RawWriter.append = killing
        save_checkpoint({str(tmp_path)!r}, 4, emb, model, opts)
    """)
    p = run_python(["-c", script], timeout=120)  # a process of its own (tests/forked.py)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert latest_checkpoint(tmp_path).name == "step-00000003"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000003"]
    load_checkpoint(latest_checkpoint(tmp_path), *trained_engine(1))


def test_inspect_shows_step_tables_ranges_and_files(tmp_path, capsys):
    from neorec.cli import main

    emb, model, opts = trained_engine()
    save_checkpoint(tmp_path, 3, emb, model, opts, state={"epoch": 0, "batches": 3})
    text = describe(tmp_path, verify=True)
    assert "step        3" in text and "processes   1" in text and "epoch 0, batches 3" in text
    assert (
        "t1: 50 x 8 fp32, adam" in text
        and "rows [0, 50) cols [0, 8) in rank-00000.bin: weight, momentum1, momentum2" in text
    )
    assert "rank-00000.bin" in text and "ok" in text and "dense.pt" in text
    assert "as the manifest records them" not in text
    assert main(["checkpoint", "inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # without --verify the files are not read: the listing says so, so that no one takes it for a check
    assert "step-00000003" in out and "as the manifest records them; --verify reads the files" in out
    assert main(["checkpoint", "inspect", str(tmp_path / "nothing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


# ---- the trainer ---------------------------------------------------------------------------------
TINY = [
    "data.synthetic.preset=custom", "data.synthetic.rows=[50, 300, 7, 1000]", "data.synthetic.num_sparse=4",
    "data.synthetic.train_samples=3000", "data.synthetic.eval_samples=500", "data.batch_size=256",
    "train.progress=false", "logging.plot=false", "logging.tensorboard=false", "train.log_every=5",
    "train.epochs=2", "train.max_steps=20", "train.schedule.warmup_steps=3", "train.schedule.decay=cosine",
    "embedding.optimizer.name=adam", "embedding.optimizer.lr=0.01", "checkpoint.every_steps=7", "checkpoint.keep=2",
]  # fmt: skip


class _SteadyClock:
    """A perf_counter that moves 25 ms between calls: every batch's data wait is 25 ms."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.025
        return self.now


def test_trainer_resume_gives_bitwise_identical_weights(tmp_path, monkeypatch):
    """12 batches per epoch; saves at 7 and 14 (epoch 1, batch 2); killed at step 17, resumed. The
    resumed run's metrics.jsonl holds the lines up to the checkpoint, then its own (TensorBoard and
    curves.png keep working); its per-step figures are of the steps it trained."""
    import neorec.data.device_feed

    monkeypatch.setattr(neorec.data.device_feed, "time", _SteadyClock())
    cfg = load_config("default", [*TINY, "logging.tensorboard=true", "logging.plot=true"])
    whole = Trainer(cfg, tmp_path / "whole")
    full = whole.fit()
    assert [p.name for p in list_checkpoints(tmp_path / "whole" / "checkpoints")] == [
        "step-00000014",
        "step-00000020",
    ]

    crashing = Trainer(cfg, tmp_path / "run")
    step = Trainer.train_step

    def crash_at_17(self, *args, **kwargs):
        if len(crashing_losses) == 16:
            raise KeyboardInterrupt("killed")
        out = step(self, *args, **kwargs)
        crashing_losses.append(float(out))
        return out

    crashing_losses: list[float] = []
    monkeypatch.setattr(Trainer, "train_step", crash_at_17)
    with pytest.raises(KeyboardInterrupt):
        crashing.fit()
    monkeypatch.setattr(Trainer, "train_step", step)
    assert latest_checkpoint(tmp_path / "run" / "checkpoints").name == "step-00000014"
    resumed = Trainer(cfg, tmp_path / "run", resume=True).fit()
    assert resumed.losses == full.losses[14:]
    assert crashing_losses == full.losses[:16]
    final = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for key, value in torch.load(tmp_path / "whole" / "model.pt", weights_only=True).items():
        assert torch.equal(value, final[key]), key
    assert _metrics(tmp_path / "run") == _metrics(tmp_path / "whole")  # 5, 10, eval 12, 15, 20, eval 20
    assert (tmp_path / "run" / "curves.png").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()  # the killed run's step 15 is purged: the resumed run logged it again
    assert [e.step for e in events.Scalars("train/loss")] == [5, 10, 15, 20]
    wait = json.loads((tmp_path / "run" / "summary.json").read_text())["data_wait_ms_per_step"]
    lines = _metrics(tmp_path / "run")
    means = [sum(full.losses[s - 5 : s]) / 5 for s in (5, 10, 15, 20)]  # each log step: its 5 steps' mean
    assert [x["loss"] for x in lines if x["split"] == "train"] == pytest.approx(means, rel=1e-12)
    again = Trainer(cfg, tmp_path / "run", resume=True).fit()  # finished: nothing left to train
    assert again.losses == []
    assert _metrics(tmp_path / "run") == _metrics(tmp_path / "whole")
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()  # the step-20 evaluation again, once: TensorBoard holds what metrics.jsonl holds
    assert [e.step for e in events.Scalars("eval/auc")] == [x["step"] for x in lines if x["split"] == "eval"]
    # data waits per step of the steps each process trained: 25 ms a batch, and one more batch read
    # ahead by the pipeline (at least 25 ms, where a wait spread over steps not trained gives less)
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    waits = [x.get("data_wait_ms") for x in records]
    assert all(25.0 - 1e-9 <= w <= 50.0 + 1e-9 for w in waits if w is not None), waits
    # the resumed run trained 6 steps and read 7 batches (the figure rounded to 3 digits)
    assert 25.0 - 1e-3 <= wait <= 25.0 * 7 / 6 + 1e-3


def _metrics(run) -> list[dict]:
    """metrics.jsonl without the fields that depend on time."""
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in x.items() if k not in ("time", "samples_per_s", "data_wait_ms")} for x in lines]


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = load_config("default", TINY)
    trainer = Trainer(cfg, tmp_path / "run")
    step = Trainer.train_step
    calls = [0]

    def nan_at_15(self, *args, **kwargs):
        calls[0] += 1
        out = step(self, *args, **kwargs)
        return out * float("nan") if calls[0] == 15 else out

    monkeypatch.setattr(Trainer, "train_step", nan_at_15)
    words = r"loss became nan at step 15 \(the weights after step 14 gave it\).*last good checkpoint is "
    words += r".*step-00000007"
    with pytest.raises(TrainingDiverged, match=words):
        trainer.fit()
    root = tmp_path / "run" / "checkpoints"
    assert latest_checkpoint(root).name == "step-00000007" and (root / "diverged-step-00000014").is_dir()


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_restarts_a_sigkilled_worker_and_ends_with_identical_weights(tmp_path):
    """2 processes under torchrun --max-restarts: rank 1 is SIGKILLed after the first checkpoint;
    torchrun restarts both, `--resume` loads the newest checkpoint, and model.pt equals the
    uninterrupted run's (the same config and Trainer on 2 gloo processes), bit for bit."""
    import time

    from forked import start_python

    # 31 batches an epoch: the resumed run crosses into the second epoch; the kill after the first
    # checkpoint (step 4) comes long before the end
    more = ["train.max_steps=48", "checkpoint.every_steps=4", "data.synthetic.train_samples=8000"]
    config = [kv for kv in TINY if kv != "train.max_steps=20"] + more
    sets = [x for kv in config for x in ("--set", kv)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # restarts work on torchrun's shared store (topology.py)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)

    spawn(2, fit_rank, (config, str(tmp_path / "whole"), True), tmp_path=tmp_path / "pg")
    # `torchrun ...` in a process of its own forked from one that has imported torch (tests/forked.py);
    # its agent starts the workers, real `python -m neorec` processes, and restarts them
    run = start_python(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--max-restarts=2",
                        f"--log-dir={tmp_path / 'agent'}",  # not a /tmp/torchelastic_* of its own
                        "-m", "neorec", "train", "--resume", *sets, "--output-dir", str(tmp_path / "run")],
                       env=env, merge=True)  # fmt: skip
    ckpts, killed, deadline = tmp_path / "run" / "checkpoints", None, time.monotonic() + 240
    while killed is None and run.poll() is None and time.monotonic() < deadline:
        if latest_checkpoint(ckpts) is not None:
            workers = sorted(_children(run.pid))  # torchrun's agent starts the workers itself
            if len(workers) == 2:
                killed = workers[-1]
                os.kill(killed, signal.SIGKILL)
        time.sleep(0.02)
    out = run.communicate(timeout=300)[0]
    assert killed is not None, out
    assert run.returncode == 0, out
    assert "resumed from" in out, out
    final = torch.load(tmp_path / "run" / "model.pt", weights_only=True)
    for key, value in torch.load(tmp_path / "whole" / "model.pt", weights_only=True).items():
        assert torch.equal(value, final[key]), key


def test_resume_with_another_batch_size_is_refused(tmp_path):
    cfg = load_config("default", [*TINY, "train.max_steps=7"])
    Trainer(cfg, tmp_path / "run").fit()
    other = load_config("default", [*TINY, "data.batch_size=128"])
    with pytest.raises(ConfigError, match=r"batch_size 256, this run has 128.*data\.batch_size"):
        Trainer(other, tmp_path / "run", resume=True).fit()


def test_every_minutes_and_every_steps(tmp_path, monkeypatch):
    from neorec.checkpoint import periodic
    from neorec.config.schema import CheckpointConfig
    from neorec.distributed.topology import Topology

    now = [100.0]
    monkeypatch.setattr(periodic.time, "monotonic", lambda: now[0])
    every = periodic.PeriodicCheckpoints(
        CheckpointConfig(every_minutes=2, every_steps=50), tmp_path, Topology()
    )
    assert not every.due(1)
    now[0] += 119
    assert not every.due(2) and every.due(50)
    now[0] += 1
    assert every.due(3)
    emb, model, opts = trained_engine(1)
    every.save(3, emb, model, opts, {})
    assert not every.due(4) and every.last_step == 3
