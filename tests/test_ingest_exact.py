"""Criteo TSV ingestion gives the bytes it gave before its block parser: recorded digests.

Each case preprocesses generated Criteo files (or reads them with CriteoTSVSource) in a fresh folder,
with relative paths so that the manifest is the same wherever the test runs, and compares the sha256
of every file written (or of every batch read, and the lines skipped) with a digest recorded from the
line-by-line implementation that came before the block parser (`python tests/test_ingest_exact.py`
prints them). A file that fails names the same `file:line` and message as before.

The generated lines cover what a block may hold: empty fields, signed and 18-digit dense values, hex
values of 1 to 8 digits in either case, CRLF line ends, and bad lines of every reason (label, field
count, dense, categorical, line length), so the fast path and the line-by-line path both run.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from neorec.data.criteo import CriteoTSVSource
from neorec.data.preprocess import preprocess_criteo
from neorec.errors import DataError

FIXTURE = Path(__file__).parent / "fixtures" / "criteo_20.tsv"


def plain_lines(n: int, seed: int) -> list[bytes]:
    """Lines as the Criteo logs hold them: dense counts (some empty, a few -1), 8-digit hex or empty."""
    rng = np.random.default_rng(seed)
    labels = rng.random(n) < 0.25
    dense = np.floor(np.exp(rng.normal(1.5, 2.0, (n, 13)))).astype(np.int64) - 1
    dense_empty = rng.random((n, 13)) < 0.2
    hexes = rng.integers(0, 1 << 32, (n, 26), dtype=np.uint64)
    hex_empty = rng.random((n, 26)) < 0.1
    lines = []
    for i in range(n):
        d = ["" if dense_empty[i, j] else str(dense[i, j]) for j in range(13)]
        c = ["" if hex_empty[i, j] else f"{int(hexes[i, j]):08x}" for j in range(26)]
        lines.append("\t".join([str(int(labels[i])), *d, *c]).encode())
    return lines


def edge_lines(n: int, seed: int) -> list[bytes]:
    """Valid lines with the format's edge cases: signs, 18 digits, short and upper-case hex values."""
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(n):
        fields = [str(rng.integers(0, 2))]
        for _ in range(13):
            r = rng.random()
            if r < 0.15:
                fields.append("")
            elif r < 0.2:
                fields.append(
                    str(rng.choice(["-1", "-0", "+7", "0", "9" * 18, "-" + "9" * 17, "+" + "1" * 17]))
                )
            else:
                fields.append(str(int(rng.integers(-2, 10 ** int(rng.integers(1, 10))))))
        for _ in range(26):
            r = rng.random()
            digits = f"{int(rng.integers(0, 1 << 32)):08x}"[: int(rng.integers(1, 9)) if r < 0.2 else 8]
            fields.append("" if r < 0.1 else digits.upper() if r > 0.95 else digits)
        lines.append("\t".join(fields).encode())
    return lines


BAD_VALUES = [  # (field, value): one bad line of each reason
    (0, b"2"),
    (0, b""),
    (3, b"12a"),
    (5, b"0x10"),
    (7, b"1" * 19),
    (7, b"1e3"),
    (20, b"xyz"),
    (30, b"123456789"),
    (None, b"too\tfew\tfields"),
    (None, b""),
    (None, b"1" * 5000),
    (25, b"ab\r"),
]


def with_bad_lines(lines: list[bytes], every: int, seed: int) -> list[bytes]:
    """Every `every`-th line (from a seeded start) replaced by a bad line, the reasons in turn."""
    rng = np.random.default_rng(seed)
    lines = list(lines)
    for k, i in enumerate(range(int(rng.integers(0, every)), len(lines), every)):
        field, value = BAD_VALUES[k % len(BAD_VALUES)]
        if field is None:
            lines[i] = value
        else:
            parts = lines[i].split(b"\t")
            parts[field] = value
            lines[i] = b"\t".join(parts)
    return lines


def write(path: Path, lines: list[bytes], eol: bytes = b"\n", end: bytes = b"\n") -> str:
    data = eol.join(lines) + end
    if path.suffix == ".gz":
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path.name


def inputs(folder: Path) -> dict[str, str]:
    """The generated input files of the cases, by role; their names are relative to `folder`."""
    plain = plain_lines(6000, seed=1)
    edge = edge_lines(3000, seed=2)
    return {
        "plain": write(folder / "plain.tsv", plain),
        "plain_gz": write(folder / "plain.tsv.gz", plain[:2500]),
        "edge": write(folder / "edge.tsv", edge, end=b"\n\n \n"),
        "crlf": write(folder / "crlf.tsv", edge[:1000], eol=b"\r\n", end=b"\r\n"),
        "bad": write(folder / "bad.tsv", with_bad_lines(plain[:4000], 97, seed=3)),
        "bad_edge": write(folder / "bad_edge.tsv", with_bad_lines(edge, 211, seed=4), end=b""),
        "fixture": write(folder / "fixture.tsv", FIXTURE.read_bytes().splitlines()),
        "eval": write(folder / "eval.tsv", plain_lines(700, seed=5)),
    }


ROWS_26 = [7, 1000, 3, 65536, 99991, 1 << 20, 2, 17, 1000, 12345, 3, 1 << 31, 5, 77, 1000, 40_000_000] + [
    1000
] * 10
PREPROCESS_CASES = {  # name: (input roles, eval input roles, keyword arguments)
    "plain_modulo": (["plain"], [], dict(table_rows=40_000_000, shard_lines=2500)),
    "plain_hash_26_rows": (
        ["plain", "plain_gz"],
        [],
        dict(hashing="hash", table_rows=ROWS_26, shard_lines=1024),
    ),
    "edge_crlf_eval_files": (["edge", "crlf"], ["eval"], dict(table_rows=1000, shard_lines=1000)),
    "bad_skip": (
        ["bad", "bad_edge"],
        [],
        dict(bad_lines="skip", table_rows=999_983, eval_every=7, shard_lines=700),
    ),
    "vocab": (["plain", "plain_gz", "edge"], ["eval"], dict(vocab_threshold=2, shard_lines=1500)),
    "vocab_skip": (["bad"], [], dict(vocab_threshold=1, bad_lines="skip", shard_lines=999)),
    "raw_features": (
        ["plain", "fixture"],
        [],
        dict(raw_features=["C3", "C26"], table_rows=100, shard_lines=4096),
    ),
    "long_limit": (
        ["edge"],
        [],
        dict(bad_lines="skip", max_line_bytes=300, table_rows=1000, shard_lines=800),
    ),
}
FAIL_CASES = {  # name: (input roles, keyword arguments)
    "bad_fail": (["plain", "bad"], dict(shard_lines=1000)),
    "bad_edge_fail": (["bad_edge"], dict(shard_lines=100_000, eval_every=3)),
    "bad_gz_fail": (["plain_gz", "bad"], dict(shard_lines=3000, vocab_threshold=1)),
}
READER_CASES = {  # name: (train roles, eval roles, keyword arguments of CriteoTSVSource)
    "plain": (["plain", "plain_gz"], [], dict(table_rows=40_000_000)),
    "edge_hash": (["edge", "crlf"], ["eval"], dict(table_rows=ROWS_26, hashing="hash")),
    "bad_skip": (["bad", "bad_edge"], [], dict(table_rows=1000, bad_lines="skip", eval_every=4)),
    "raw": (["plain"], [], dict(table_rows=50, raw_features=["C1", "C9"], max_line_bytes=400)),
    "bad_fail": (["plain", "bad_edge"], [], dict(table_rows=1000, eval_every=5)),
}


def tree_digest(folder: Path) -> str:
    """One sha256 over the relative path and content of every file under `folder`. The input sizes that
    the manifest records (and its crc32) are left out: a .gz input's size depends on the zlib version;
    so are the checksums a vocabulary's settings.json records of its files (their bytes are digested)."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name in ("manifest.json", "settings.json"):
                obj = json.loads(data)
                obj.pop("crc32", None)
                obj.get("settings", obj).pop("sizes")
                if p.name == "settings.json":  # a vocabulary's: its files' checksums, digested as files
                    obj.pop("files", None)
                data = json.dumps(obj, sort_keys=True).encode()
            h.update(str(p.relative_to(folder)).encode() + b"\0" + data)
    return h.hexdigest()


def run_preprocess(folder: Path, files: dict[str, str], name: str, workers: int = 1) -> str:
    roles, eval_roles, kw = PREPROCESS_CASES[name]
    out = f"out-{name}-{workers}"
    preprocess_criteo([files[r] for r in roles], out, eval_paths=[files[r] for r in eval_roles], workers=workers,
                      progress=False, **kw)  # fmt: skip
    return tree_digest(folder / out)


def run_fail(files: dict[str, str], name: str, workers: int = 1) -> str:
    roles, kw = FAIL_CASES[name]
    try:
        preprocess_criteo(
            [files[r] for r in roles], f"fail-{name}-{workers}", workers=workers, progress=False, **kw
        )
    except DataError as e:
        return str(e)
    return "no error"


def run_reader(files: dict[str, str], name: str) -> str:
    roles, eval_roles, kw = READER_CASES[name]
    source = CriteoTSVSource([files[r] for r in roles], [files[r] for r in eval_roles] or None, **kw)
    h = hashlib.sha256()
    try:
        batches = [*source.train_batches(333), *source.eval_batches(1000)]
    except DataError as e:
        return str(e)
    for batch in batches:
        for t in (batch.labels, batch.dense, batch.sparse.values, batch.sparse.lengths):
            h.update(t.numpy().tobytes())
    h.update(repr(sorted((k, sorted(v.items())) for k, v in source.skipped.items())).encode())
    return h.hexdigest()


# Recorded from the line-by-line implementation (`python tests/test_ingest_exact.py`).
GOLDEN: dict[str, str] = {
    "preprocess/plain_modulo": "4984e19b2af40ce84cd4f3ff415859aa642b34263daf8ab16f6d8a200fa8ec61",
    "preprocess/plain_hash_26_rows": "a3022889ac182b23dd0e8bb95d90c838f5028cba17ad28c867fe3c8d0f3701fb",
    "preprocess/edge_crlf_eval_files": "1d3819a573ee89e915411a3595aee2b7a9bccf111ed2cf0d376eaddc37a17a10",
    "preprocess/bad_skip": "06fadf8994023fa2e8ca7863095c0e1c081fee0a7074f6dfc198822d5093cf74",
    "preprocess/vocab": "2b060c57a20f9106b95bcf7609bc55376293e7b292ef3207ee0421776d52f049",
    "preprocess/vocab_skip": "487ea2987873d86c7a80a7febc21c1f630356f2f61b1b5df19f2386a45b4aa6f",
    "preprocess/raw_features": "2bcfaa02abc46871eb3c6c0401164c225a0e2b5d2840b7ab37857ac99aeed94c",
    "preprocess/long_limit": "8026ece886cd0feb965759bc1a07d91d12a99fd2798bed084141110b4277e4e3",
    "fail/bad_fail": "bad.tsv:370: dense feature I5 = '0x10' is not an integer (or empty); data.criteo.bad_lines=skip (or --bad-lines skip) skips and counts such lines",
    "fail/bad_edge_fail": "bad_edge.tsv:576: dense feature I3 = '12a' is not an integer (or empty); data.criteo.bad_lines=skip (or --bad-lines skip) skips and counts such lines",
    "fail/bad_gz_fail": "bad.tsv:370: dense feature I5 = '0x10' is not an integer (or empty); data.criteo.bad_lines=skip (or --bad-lines skip) skips and counts such lines",
    "reader/plain": "a8821e2d977990755143a1eafbf1cdb8a0e335e380298dcddd0bffc0d85b404e",
    "reader/edge_hash": "7ce949aed41900e70764db68ee11c226cd3aca6d302f64735674a4031f7e4726",
    "reader/bad_skip": "0218aca86d85117cb3d1f5a8e201c45bdb9973cde876e5ded41d9f6903d533b7",
    "reader/raw": "3bfcfce5436d27e087c71c29928cba46305a0cdccb53737b7c719becdf7c89a6",
    "reader/bad_fail": "bad_edge.tsv:154: label '2' is not 0 or 1; data.criteo.bad_lines=skip (or --bad-lines skip) skips and counts such lines",
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    folder = tmp_path_factory.mktemp("ingest")
    return folder, inputs(folder)


@pytest.mark.parametrize("name", PREPROCESS_CASES)
def test_preprocessing_writes_the_recorded_bytes(files, name, monkeypatch):
    folder, names = files
    monkeypatch.chdir(folder)
    assert run_preprocess(folder, names, name) == GOLDEN[f"preprocess/{name}"]


@pytest.mark.parametrize("name", FAIL_CASES)
def test_bad_lines_stop_at_the_recorded_line(files, name, monkeypatch):
    folder, names = files
    monkeypatch.chdir(folder)
    assert run_fail(names, name) == GOLDEN[f"fail/{name}"]


@pytest.mark.parametrize("name", READER_CASES)
def test_the_reader_yields_the_recorded_batches(files, name, monkeypatch):
    folder, names = files
    monkeypatch.chdir(folder)
    assert run_reader(names, name) == GOLDEN[f"reader/{name}"]


@pytest.fixture
def forked_workers(monkeypatch):
    """workers=N's processes from tests/forked.py's server (it has imported torch and neorec once)."""
    import types

    from forked import context

    from neorec.data import workers

    namespace = types.SimpleNamespace(
        get_context=lambda method: context(), get_all_start_methods=lambda: ["spawn"]
    )
    monkeypatch.setattr(workers, "multiprocessing", namespace)


@pytest.mark.parametrize("name", ["bad_skip", "vocab_skip", "plain_hash_26_rows"])
def test_pieces_of_one_file_in_two_workers_write_the_recorded_bytes(files, name, monkeypatch, forked_workers):
    """Pieces start in every 64 KiB of a file (8 MiB otherwise), so that every shard is cut into
    several, parsed by two workers in any order."""
    from neorec.data import tsv_index

    folder, names = files
    monkeypatch.chdir(folder)
    monkeypatch.setattr(tsv_index, "INDEX_BLOCK", 64 << 10)
    assert run_preprocess(folder, names, name, workers=2) == GOLDEN[f"preprocess/{name}"]
    assert run_fail(names, "bad_fail", workers=2) == GOLDEN["fail/bad_fail"]


if __name__ == "__main__":  # print the digests of this implementation, to record them above
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        names = inputs(Path(tmp))
        digests = {f"preprocess/{n}": run_preprocess(Path(tmp), names, n) for n in PREPROCESS_CASES}
        digests |= {f"fail/{n}": run_fail(names, n) for n in FAIL_CASES}
        digests |= {f"reader/{n}": run_reader(names, n) for n in READER_CASES}
    for key, value in digests.items():
        print(f"    {key!r}: {value!r},", file=sys.stdout)
