"""The structure of a checkpoint's manifest.json (neorec/checkpoint/save.py): every value's type and
range, checked by load.read_manifest before any file it names is opened and before anything is said.
A manifest whose checksum matches can still be wrong (written by hand, or by a tool that recomputed
its "crc32"): it is refused with a CheckpointError naming the file and the key path (exit 2).

    step, world_size, local_world_size   whole numbers: step >= 0, 1 <= local_world_size <= world_size
    plan              null, or a plan (neorec/distributed/plan.py) whose ranks lie in [0, world_size)
    tables            TableConfigs (strict: "50" is not 50), distinct names
    optimizer         an EmbeddingOptimizerConfig
    embedding_steps   {table: whole number >= 0}
    state             the trainer's position: epoch, batches, batch_size, seed, metrics_lines,
                      loss_window, id_map_counts, snapshot_due, eval_pending, samples_trained, the reader's
                      position; each of the right type when present
    dense, files      {name (a plain name), bytes, crc32} (files: also rank); distinct names
    pieces            {table, state, rows [a, b], cols [c, d], file, offset, shape, dtype}: inside
                      its table (0 <= a <= b <= rows, 0 <= c <= d <= dim), shape [b - a] or
                      [b - a, d - c], a known dtype, and its bytes inside its file
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from neorec.checkpoint.files import DTYPES, CheckpointError
from neorec.distributed.plan import ShardingPlan
from neorec.embedding.tables import EmbeddingOptimizerConfig, TableConfig
from neorec.errors import ConfigError
from neorec.utils.files import plain_name
from neorec.utils.json_checks import JsonChecks, is_whole, key_path, shown

MANIFEST_KEYS = (
    "format", "version", "step", "saved_at", "world_size", "local_world_size", "plan", "tables", "optimizer",
    "embedding_steps", "state", "dense", "files", "pieces",
)  # fmt: skip
OPTIONAL_KEYS = ("saved_at", "plan", "state")
MAX_COUNT = 2**63 - 1  # steps, rows, bytes: int64
MAX_PROCESSES = 1 << 20  # no run has near this many processes; a larger world size is damage
CRC32_MAX = 2**32 - 1
FILE_KEYS = ("name", "bytes", "crc32")
PIECE_KEYS = ("table", "state", "rows", "cols", "file", "offset", "shape", "dtype")
_READER_WHOLE = {
    "epoch": 0,
    "samples": 0,
    "seed": 0,
    "world_size": 1,
    "shuffle_window": 1,
    "train_samples": 0,
}


def check_manifest_structure(manifest: dict[str, Any], where: str, hint: str) -> None:
    """Every value of a checkpoint manifest (see the module doc); CheckpointError naming `where` (the
    file) and the key path. Its tables and optimizer are replaced by their validated configs' dumps
    (defaults filled in)."""
    c = JsonChecks(where, hint, CheckpointError)
    for key in MANIFEST_KEYS:
        if key not in OPTIONAL_KEYS:
            c.field(manifest, key)
    c.only(manifest, MANIFEST_KEYS)
    c.whole(manifest["step"], "step", 0, MAX_COUNT)
    if "saved_at" in manifest:
        c.text(manifest["saved_at"], "saved_at")
    world = c.whole(manifest["world_size"], "world_size", 1, MAX_PROCESSES)
    c.whole(manifest["local_world_size"], "local_world_size", 1, world)
    if manifest.get("plan") is not None:
        _check_plan(c, manifest["plan"], world)
    tables = _check_tables(c, c.items(manifest["tables"], "tables"))
    optimizer = _model(c, EmbeddingOptimizerConfig, manifest["optimizer"], "optimizer")
    # as read, with the defaults of keys an older neorec did not write
    manifest["tables"] = [t.model_dump(mode="json") for t in tables.values()]
    manifest["optimizer"] = optimizer.model_dump(mode="json")
    for name, n in c.mapping(manifest["embedding_steps"], "embedding_steps").items():
        if name not in tables:
            c.fail("embedding_steps", f"names table {shown(name)}, which the manifest does not list")
        c.whole(n, key_path("embedding_steps", name), 0, MAX_COUNT)
    if manifest.get("state") is not None:
        _check_state(c, c.mapping(manifest["state"], "state"))
    _check_file(c, c.mapping(manifest["dense"], "dense"), "dense")
    files: dict[str, int] = {}
    for i, entry in enumerate(c.items(manifest["files"], "files")):
        key = f"files[{i}]"
        name = _check_file(c, c.mapping(entry, key), key)
        c.whole(c.field(entry, "rank", key), f"{key}.rank", 0, world - 1)
        if name in files or name == manifest["dense"]["name"]:
            c.fail(f"{key}.name", f"is {shown(name)}, which another file has too")
        files[name] = entry["bytes"]
    for i, piece in enumerate(c.items(manifest["pieces"], "pieces")):
        _check_piece(c, piece, f"pieces[{i}]", tables, files)


def _check_plan(c: JsonChecks, plan: Any, world: int) -> None:
    try:
        parsed = ShardingPlan.from_dict(plan, "plan")
    except ConfigError as e:
        c.fail("plan", f"is malformed: {str(e).removeprefix('plan: ')}")
    for name, table in parsed.tables.items():
        bad = [r for r in table.ranks if not 0 <= r < world]
        if bad or (table.node is not None and not 0 <= table.node < world):
            c.fail(
                key_path("plan.tables", name),
                f"names ranks or a node outside the {world} processes of the run",
            )


def _model(c: JsonChecks, model: type[BaseModel], value: Any, key: str) -> BaseModel:
    """`value` read as `model`, strictly (a string is not a number); the first problem named."""
    c.mapping(value, key)
    try:
        return model.model_validate(value, strict=True)
    except ValidationError as e:
        first = e.errors()[0]
        at = key
        for part in first["loc"]:
            at = key_path(at, part)
        got = f" is {shown(first['input'])}" if first["type"] != "missing" else ""
        c.fail(at, f"{got} ({first['msg']})".strip())


def _check_tables(c: JsonChecks, items: list) -> dict[str, TableConfig]:
    tables: dict[str, TableConfig] = {}
    for i, entry in enumerate(items):
        table = _model(c, TableConfig, entry, f"tables[{i}]")
        assert isinstance(table, TableConfig)
        c.whole(table.rows, f"tables[{i}].rows", 1, MAX_COUNT)
        c.whole(table.dim, f"tables[{i}].dim", 1, MAX_COUNT)
        if table.name in tables:
            c.fail(f"tables[{i}].name", f"is {shown(table.name)}, which an earlier table has too")
        tables[table.name] = table
    return tables


def _check_state(c: JsonChecks, state: dict) -> None:
    """The trainer's position (train/checkpointing.py), where the keys it writes are present: a library
    save may hold any JSON data there (the trainer refuses a state without its position to resume)."""
    for key, low in (("epoch", 0), ("batches", 0), ("batch_size", 1), ("seed", 0), ("metrics_lines", 0),
                     ("samples_trained", 0)):  # fmt: skip
        if state.get(key) is not None:
            c.whole(state[key], f"state.{key}", low, MAX_COUNT)
    if state.get("loss_window") is not None:  # [sum, number] of the losses since the last log step
        window = state["loss_window"]
        if not isinstance(window, list) or len(window) != 2:
            c.wrong("state.loss_window", window, "[loss sum, steps]")
        c.number(window[0], "state.loss_window[0]")
        c.whole(window[1], "state.loss_window[1]", 0, MAX_COUNT)
    if state.get("id_map_counts") is not None:  # {table: {counter: count}}: the id maps' log continues them
        for table, counts in c.mapping(state["id_map_counts"], "state.id_map_counts").items():
            for name, count in c.mapping(counts, f"state.id_map_counts.{table}").items():
                c.whole(count, f"state.id_map_counts.{table}.{name}", 0, MAX_COUNT)
    if state.get("snapshot_due") is not None:  # a snapshot of the step was to be published after it
        c.flag(state["snapshot_due"], "state.snapshot_due")
    if state.get("eval_pending") is not None:  # an evaluation a stop cut short, done first on resume
        batches = c.mapping(state["eval_pending"], "state.eval_pending").get("max_batches")
        if batches is not None:
            c.whole(batches, "state.eval_pending.max_batches", 1, MAX_COUNT)
    if state.get("reader") is not None:
        reader = c.mapping(state["reader"], "state.reader")
        for key, low in _READER_WHOLE.items():
            if key in reader:
                c.whole(reader[key], f"state.reader.{key}", low, MAX_COUNT)
        if "shuffle" in reader:
            c.flag(reader["shuffle"], "state.reader.shuffle")
    if state.get("progressive") is not None:
        ranks = c.mapping(state["progressive"], "state.progressive").get("ranks", [])
        for i, rank in enumerate(c.items(ranks, "state.progressive.ranks")):
            c.mapping(rank, f"state.progressive.ranks[{i}]")
    for i, clock in enumerate(c.items(state.get("partition_clocks") or [], "state.partition_clocks")):
        c.whole(clock, f"state.partition_clocks[{i}]")
    for name, n in c.mapping(state.get("partition_id_map") or {}, "state.partition_id_map").items():
        c.number(n, key_path("state.partition_id_map", name))  # id-map counts summed over ranks: floats


def _check_file(c: JsonChecks, entry: dict, key: str) -> str:
    """A file entry's name (a plain name: files stay inside the checkpoint), size and crc32."""
    for field in FILE_KEYS:
        c.field(entry, field, key)
    name = plain_name(entry["name"], f"{c.where}: {key}: file name", CheckpointError)
    c.whole(entry["bytes"], f"{key}.bytes", 0, MAX_COUNT)
    c.whole(entry["crc32"], f"{key}.crc32", 0, CRC32_MAX)
    return name


def _check_piece(
    c: JsonChecks, piece: Any, key: str, tables: dict[str, TableConfig], files: dict[str, int]
) -> None:
    c.mapping(piece, key)
    for field in PIECE_KEYS:
        c.field(piece, field, key)
    name = piece["table"]
    if not isinstance(name, str) or name not in tables:
        c.wrong(f"{key}.table", name, "a table the manifest lists")
    table = tables[name]
    c.text(piece["state"], f"{key}.state")
    (r0, r1), (c0, c1) = (
        _range(c, piece, f"{key}.{k}", n) for k, n in (("rows", table.rows), ("cols", table.dim))
    )
    file = plain_name(piece["file"], f"{c.where}: {key}: file", CheckpointError)
    if file not in files:
        c.wrong(f"{key}.file", file, "a file the manifest lists")
    offset = c.whole(piece["offset"], f"{key}.offset", 0, MAX_COUNT)
    dtype = c.text(piece["dtype"], f"{key}.dtype", tuple(DTYPES))
    shape = piece["shape"]
    if shape not in ([r1 - r0], [r1 - r0, c1 - c0]) or not all(is_whole(n) for n in shape):
        c.wrong(f"{key}.shape", shape, f"[{r1 - r0}] or [{r1 - r0}, {c1 - c0}] (its rows and columns)")
    size = torch.empty(0, dtype=DTYPES[dtype]).element_size()
    for n in shape:
        size *= n
    if offset + size > files[file]:
        c.fail(
            key,
            f"lies at bytes [{offset}, {offset + size}) of {file}, which has {files[file]}: the manifest is damaged",
        )


def _range(c: JsonChecks, piece: dict, key: str, limit: int) -> tuple[int, int]:
    """[a, b] with 0 <= a <= b <= limit."""
    value = piece[key.rsplit(".", 1)[1]]
    if not isinstance(value, list) or len(value) != 2 or not all(is_whole(v) for v in value):
        c.wrong(key, value, "[start, end], two whole numbers")
    a, b = value
    if not 0 <= a <= b <= limit:
        c.wrong(key, value, f"a range inside [0, {limit}] (its table's)")
    return a, b
