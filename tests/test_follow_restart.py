"""Restarts of a followed stream: `neorec train --follow` killed with SIGKILL at random moments and
started again with the same command ends with the model, partition and sliding-window metrics and
snapshots of a run never stopped, and picks up a partition that landed while it was down."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch
from forked import run_neorec, start_neorec

from neorec.data.drifting import DriftSpec, write_day
from neorec.serving.file_format import read_export
from neorec.serving.snapshots import latest_snapshot

SPEC = DriftSpec(rows=400, vocab=300, shift=100, row_group=128)


def command(stream: Path, out: Path) -> list[str]:
    return [
        "train", "--config", "continuous", "--follow", str(stream), "--until", "day-003", "--output-dir", str(out),
        "--set", "data.batch_size=100", "--set", "data.follow.poll_seconds=0.05", "--set", "data.follow.idle_timeout=null",
        "--set", "checkpoint.every_steps=3", "--set", "snapshot.every_steps=4", "--set", "train.log_every=2",
        "--set", "data.follow.window_batches=3",
        "--set", "train.progress=false", "--set", "logging.tensorboard=false", "--set", "logging.plot=false",
        "--set", "train.threads=1",
    ]  # fmt: skip


def metrics_lines(out: Path, split: str) -> list[dict]:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "time"} for r in lines if r["split"] == split]


def partition_lines(out: Path) -> list[dict]:
    return metrics_lines(out, "partition")


def kill_after_progress(argv: list[str], out: Path, rng: random.Random) -> None:
    """Start the command, wait until it has saved a checkpoint newer than the ones there before, and
    kill it with SIGKILL a random moment later (maybe while saving, publishing or waiting for data)."""
    before = set((out / "checkpoints").glob("step-*")) if (out / "checkpoints").is_dir() else set()
    proc = start_neorec(argv)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if set((out / "checkpoints").glob("step-*")) - before:
            break
        time.sleep(0.02)
    time.sleep(rng.uniform(0.0, 0.4))
    proc.kill()
    proc.wait(timeout=30)


def test_killed_at_random_moments_a_stream_ends_as_if_never_stopped(tmp_path):
    rng = random.Random(int(time.time()))  # a new moment every run; the seed is in the failure message
    seed_note = f"random seed {rng.random()}"
    whole = tmp_path / "whole"
    for day in range(4):
        write_day(SPEC, whole, day)
    ref = run_neorec(command(whole, tmp_path / "ref"), timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]

    stream = tmp_path / "stream"
    for day in range(3):
        write_day(SPEC, stream, day)
    out = tmp_path / "run"
    argv = command(stream, out)
    kill_after_progress(argv, out, rng)
    write_day(SPEC, stream, 3)  # lands while the job is down
    kill_after_progress(argv, out, rng)
    done = run_neorec(argv, timeout=300)
    assert done.returncode == 0, f"{seed_note}\n{done.stderr[-3000:]}"

    got = torch.load(out / "model.pt", weights_only=True)
    want = torch.load(tmp_path / "ref" / "model.pt", weights_only=True)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), seed_note
    assert [r["partition"] for r in partition_lines(out)] == ["day-000", "day-001", "day-002", "day-003"]
    for split in ("partition", "progressive"):  # the sliding window goes on across restarts too
        got_lines, want_lines = metrics_lines(out, split), metrics_lines(tmp_path / "ref", split)
        assert len(got_lines) == len(want_lines) == (4 if split == "partition" else 8), seed_note
        for a, b in zip(got_lines, want_lines, strict=True):
            assert a == b, f"{seed_note}: " + str({k: (a[k], b.get(k)) for k in a if a[k] != b.get(k)})
    snapshot = latest_snapshot(out / "snapshots")
    assert snapshot.name == "snapshot-00000016"
    header, tensors = read_export(snapshot / "model.nrx")
    reference = read_export(latest_snapshot(tmp_path / "ref" / "snapshots") / "model.nrx")[1]
    assert all(torch.equal(tensors[k], reference[k]) for k in reference), seed_note
    assert not list((out / "snapshots").glob(".tmp-*"))
