"""The one writer and the checksums under every file (neorec/utils/files.py, docs/integrity.md): a write
interrupted by an exception or by SIGKILL leaves the old file or nothing under the final name; every
one-bit flip of a checksummed JSON file is refused; every one-bit flip of model.pt (plain or streamed
save) is refused or changes nothing that loads; names read from files stay plain names.

Also the helpers the other fault tests import: `damaged` (the damage done to each file kind) and
`run_cli` / `assert_one_error` (a command exits 2 with one `neorec: error:` line naming the file)."""

from __future__ import annotations

import json
import os
import signal
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from neorec.checkpoint.stream import load_model_state, save_model_state
from neorec.cli import main as cli_main
from neorec.distributed.plan import ShardingPlan, TablePlan
from neorec.errors import ConfigError, NeorecError
from neorec.serving.file_format import read_export, write_export
from neorec.utils import files
from neorec.utils.files import FileWriteError, check_zip, plain_name, read_json, write_atomic, write_json


# ---- helpers of every fault test ----------------------------------------------------------------------
def flipped(data: bytes, at: int, bit: int = 0x10) -> bytes:
    at = at % len(data)
    return data[:at] + bytes([data[at] ^ bit]) + data[at + 1 :]


@contextmanager
def damaged(path: Path, change: Callable[[bytes], bytes]) -> Iterator[None]:
    """`path` with its bytes changed by `change` inside the block, restored after it."""
    good = path.read_bytes()
    path.write_bytes(change(good))
    try:
        yield
    finally:
        path.write_bytes(good)


def zip_damage(path: Path, entry: str) -> dict[str, Callable[[bytes], bytes]]:
    """Damage to a zip archive (model.pt, model.pt2): a data byte of `entry`, its name in its local
    header, the central directory, the end record; cut in half, and empty. (A flip where no reader
    looks changes nothing: test_every_one_bit_flip_of_model_pt_is_refused_or_changes_nothing.)"""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(entry)
        start_dir = zf.start_dir
    data = path.read_bytes()
    name_len, extra_len = int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little"), 0
    extra_len = int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little")
    start = info.header_offset + 30 + name_len + extra_len
    return {
        "data byte": lambda d: flipped(d, start + info.compress_size // 2, 0x01),
        "local header": lambda d: flipped(d, info.header_offset + 30 + name_len - 1),
        "central directory": lambda d: flipped(d, start_dir + 42, 0x01),  # where the first entry starts
        "end record": lambda d: flipped(d, d.rindex(b"PK\x05\x06") + 1, 0x01),
        "truncated": lambda d: d[: len(d) // 2],
        "empty": lambda d: b"",
    }


def json_damage() -> dict[str, Callable[[bytes], bytes]]:
    """Damage to a JSON file: a digit of a value, a letter of a key, its syntax; cut, and empty."""

    def digit(d: bytes) -> bytes:
        at = next(i for i in range(len(d) // 3, len(d)) if chr(d[i]).isdigit() and chr(d[i - 1]).isdigit())
        return flipped(d, at, 0x01)

    def key_letter(d: bytes) -> bytes:
        return flipped(d, d.index(b'"', d.index(b'"') + 1) - 1, 0x01)  # last letter of the first key

    return {
        "value digit": digit,
        "key letter": key_letter,
        "syntax": lambda d: flipped(d, 0, 0x01),  # "{" -> "z"
        "truncated": lambda d: d[: len(d) // 2],
        "empty": lambda d: b"",
    }


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """neorec's command line in this process: (exit code, stderr)."""
    capsys.readouterr()
    code = cli_main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_one_error(code: int, err: str, *names: str, damage: str = "") -> str:
    """Exit 2 with exactly one `neorec: error:` line, naming `names`, and no traceback (`damage`:
    what was done to the file, for the failure's message)."""
    lines = [line for line in err.splitlines() if line.startswith("neorec: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (damage, err)
    for name in names:
        assert name in lines[0], (damage, name, lines[0])
    return lines[0]


# ---- the writer ------------------------------------------------------------------------------------------
def test_write_interrupted_by_an_exception_keeps_the_old_file(tmp_path):
    path = tmp_path / "f.bin"
    write_atomic(path, lambda f: f.write(b"old"), "test file")

    def failing(f) -> None:
        f.write(b"new, half of it")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, failing, "test file")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]

    def disk_full(f) -> None:
        f.write(b"new")
        raise OSError(28, "No space left on device")

    with pytest.raises(FileWriteError, match=r"cannot write test file .*f\.bin: No space left on device"):
        write_atomic(path, disk_full, "test file")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def _killed_during(k: int, write: Callable[[], None]) -> bool:
    """Run `write` in a forked child that SIGKILLs itself at its k-th write() into a file opened by
    neorec.utils.files.write_atomic (half of that write done), or just before the rename when k is 0;
    True when the child was killed."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            torch.set_num_threads(1)
            count = [0]
            real_open = open

            class Dying:
                def __init__(self, f) -> None:
                    self.f = f

                def write(self, data) -> int:
                    count[0] += 1
                    if count[0] == k:
                        view = memoryview(data).cast("B")
                        self.f.write(view[: len(view) // 2])
                        self.f.flush()
                        os.kill(os.getpid(), signal.SIGKILL)
                    return self.f.write(data)

                def __getattr__(self, name):
                    return getattr(self.f, name)

                def __enter__(self):
                    return self

                def __exit__(self, *exc) -> None:
                    self.f.close()

            files.open = lambda *a, **kw: Dying(real_open(*a, **kw))  # type: ignore[attr-defined]
            if k == 0:
                files.os = SimpleNamespace(**{**vars(os), "replace": lambda *a: os.kill(os.getpid(), signal.SIGKILL)})
            write()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == -signal.SIGKILL


def _kill_at_every_write(path: Path, write: Callable[[], None], check_old: Callable[[], None]) -> int:
    """Kill a writer of `path` before its rename, then at its write() calls 1, 2, 3, 4, 6, 9, 13, ...
    (each about 1.5 times the last) until one finishes: after each kill `path` is the old file
    (check_old passes), never a part of the new one; the writer that finished wrote the new one."""
    old = path.read_bytes()
    kills, k = 0, 0
    while _killed_during(k, write):
        kills += 1
        assert path.read_bytes() == old, f"kill at write {k}"
        check_old()
        k = max(k + 1, k * 3 // 2)
    assert kills >= 2 and path.read_bytes() != old  # before the rename, and inside at least one write
    return kills


def test_sigkill_while_writing_model_pt_export_or_plan_leaves_the_old_file(tmp_path, monkeypatch):
    from neorec.checkpoint import stream

    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 1))
    state = model.state_dict()
    pt = tmp_path / "model.pt"
    save_model_state(state, pt, model)
    new = {k: v + 1 for k, v in state.items()}
    _kill_at_every_write(pt, lambda: save_model_state(new, pt, model), lambda: load_model_state(pt))
    assert torch.equal(load_model_state(pt)["0.bias"], new["0.bias"])

    monkeypatch.setattr(stream, "_STREAM_MIN_BYTES", 1024)  # a cached table's rows, streamed
    cached = _Cached()
    save_model_state({"table": cached.table}, pt, cached)
    cached.table += 1
    _kill_at_every_write(pt, lambda: save_model_state({"table": cached.table}, pt, cached), lambda: load_model_state(pt))
    assert torch.equal(load_model_state(pt)["table"], cached.table)

    nrx = tmp_path / "m.nrx"
    write_export(nrx, {"note": "old"}, state)
    _kill_at_every_write(nrx, lambda: write_export(nrx, {"note": "new"}, new), lambda: read_export(nrx))

    plan = tmp_path / "plan.json"
    ShardingPlan({"t": TablePlan("tw", [0])}).save(plan)
    bigger = ShardingPlan({f"t{i}": TablePlan("rw", [0, 1]) for i in range(40)})
    _kill_at_every_write(plan, lambda: bigger.save(plan), lambda: ShardingPlan.load(plan))
    assert ShardingPlan.load(plan).tables == bigger.tables  # the child that was not killed wrote it whole


# ---- checksums ----------------------------------------------------------------------------------------
def test_every_one_bit_flip_of_a_checksummed_json_file_is_refused(tmp_path):
    path = tmp_path / "x.json"
    write_json(path, {"tables": {"t0": {"kind": "rw", "ranks": [0, 1]}}, "step": 1250, "lr": 0.5}, "test file")
    good = path.read_bytes()
    assert read_json(path, "test file", "hint", required=True)["step"] == 1250
    for at in range(len(good)):
        for bit in range(8):
            path.write_bytes(flipped(good, at, 1 << bit))
            for kwargs in ({"required": True}, {"keys": ("tables", "step", "lr")}):
                with pytest.raises(NeorecError, match=r"x\.json"):
                    read_json(path, "test file", "hint", **kwargs)


def test_plan_and_calibration_files_written_by_hand_are_read_and_checked(tmp_path):
    from neorec.planner.hardware import CALIBRATED_CPU, load_calibration

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"tables": {"t": {"kind": "tw", "ranks": [1]}}}))  # no crc32: by hand
    assert ShardingPlan.load(plan).tables["t"].ranks == [1]
    plan.write_text(json.dumps({"tables": {}, "crc31": 5}))
    with pytest.raises(ConfigError, match=r"plan\.json: unknown key\(s\) \['crc31'\]"):
        ShardingPlan.load(plan)
    plan.write_text('{"tables": {"t": {"kind": "rw", "ranks": [0, 1]}, "t": {"kind": "tw", "ranks": [1]}}}')
    with pytest.raises(ConfigError, match=r"plan\.json: key 't' appears twice in one object"):
        ShardingPlan.load(plan)  # not the last one silently
    calibration = tmp_path / "calibration.json"
    calibration.write_text(json.dumps({"latency": 1e-5}))
    assert load_calibration(calibration)["latency"] == 1e-5
    write_json(calibration, {**CALIBRATED_CPU, "measured": {"world_size": 2}}, "calibration file")
    assert load_calibration(calibration) == CALIBRATED_CPU
    with damaged(calibration, json_damage()["value digit"]):
        with pytest.raises(ConfigError, match=r"calibration file .*calibration\.json: checksum mismatch"):
            load_calibration(calibration)


class _Cached(torch.nn.Module):
    """A model with a table whose entry save_model_state streams from its rows (as a cached table's)."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(3, 2)
        self.table = torch.randn(20, 16)

    def range_sources(self, prefix: str) -> dict:
        table = self.table

        class Rows:
            def read_range(self, a: int, b: int) -> torch.Tensor:
                return table[a:b].clone()

        return {prefix + "table": (Rows(), 0, table.shape[0])}


@pytest.mark.parametrize("streamed", [False, True])
def test_every_one_bit_flip_of_model_pt_is_refused_or_changes_nothing(tmp_path, monkeypatch, streamed):
    """A streamed save turns torch's CRC32s off; save_model_state writes them itself, so both files
    verify alike: a flip in any entry's bytes is refused, and a flip where no reader looks (alignment
    padding, timestamps) loads the same tensors. Every bit of the archive's directory is flipped: the
    folder flag of an entry's attributes makes torch read it as empty, unfilled memory."""
    from neorec.checkpoint import stream

    monkeypatch.setattr(stream, "_STREAM_MIN_BYTES", 1024)  # stream this small table
    model = _Cached()
    state = {**model.state_dict(), **({"table": model.table} if streamed else {"table": model.table.clone()})}
    path = tmp_path / "model.pt"
    save_model_state(state, path, model if streamed else torch.nn.Linear(3, 2))
    assert zipfile.ZipFile(path).testzip() is None
    assert all(torch.equal(v, torch.load(path, weights_only=True)[k]) for k, v in state.items())
    good = path.read_bytes()
    entries = []
    for info in zipfile.ZipFile(path).infolist():
        at = info.header_offset + 26
        start = info.header_offset + 30 + int.from_bytes(good[at : at + 2], "little") + int.from_bytes(good[at + 2 : at + 4], "little")
        entries.append(range(start, start + info.compress_size))
    directory = zipfile.ZipFile(path).start_dir
    flips = [(at, 0x04) for at in range(0, directory, 3)]  # every third byte: headers, padding, entries' data
    flips += [(at, 1 << bit) for at in range(directory, len(good)) for bit in range(8)]  # the directory: all
    for at, bit in flips:
        path.write_bytes(flipped(good, at, bit))
        try:
            got = load_model_state(path)
        except NeorecError as e:
            assert "model.pt" in str(e)
            continue
        assert not any(at in r for r in entries), f"a flip at byte {at}, in an entry's data, loaded"
        assert got.keys() == state.keys() and all(torch.equal(got[k], v) for k, v in state.items()), at


def test_check_zip_names_the_damaged_entry(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"w": torch.arange(100.0)}, path)
    for what, change in zip_damage(path, "m/data/0").items():
        with damaged(path, change):
            with pytest.raises(NeorecError, match=r"m\.pt") as e:
                check_zip(path, "model file", "hint")
            if what == "data byte":
                assert "its entry 'm/data/0' does not read back (checksum mismatch" in str(e.value)


@pytest.mark.parametrize("name", ["", "..", "../x.bin", "/etc/passwd", "a/b", "a\\b", "x\0y", "a..b", None, 3])
def test_names_read_from_files_must_be_plain(name):
    with pytest.raises(NeorecError, match="is not a plain name"):
        plain_name(name, "some file")
    assert plain_name("rank-00000.bin", "some file") == "rank-00000.bin"
