"""The pt2 export: a folder that standard tools read without neorec (its files and how they are read
back: neorec/serving/pt2_file.py). Here the model is traced into a `torch.export` program
(pt2_model.ScoringProgram) and the folder written.

The folder is written as a unit: model.pt2 and weights.safetensors are written by
neorec.utils.files.write_atomic (temporary name, fsync, rename) into a temporary folder beside it, the
weights first (the header inside model.pt2 records their size and crc32, "weights"), and that folder
then takes the place of any earlier export of the name.

Scoring in any Python with torch, no neorec:

    program = torch.export.load("DIR/model.pt2").module()
    probabilities = program(dense, ids, offsets, weights)   # see pt2_model for the layout

The batch dimension is dynamic (torch.export.Dim), so one program scores any batch size.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config

from neorec.embedding.tables import TableConfig
from neorec.serving.embeddings import TableWeights
from neorec.serving.file_format import ExportError
from neorec.serving.model import file_tensors
from neorec.serving.pt2_file import HEADER_FILE, MODEL_FILE, WEIGHTS_FILE
from neorec.serving.pt2_model import PT2_FORMAT, ScoringProgram, TableLookups
from neorec.serving.safetensors_file import write_safetensors
from neorec.utils.files import FileWriteError, file_crc32, foreign_files, replace_folder, write_atomic


def example_inputs(
    tables: list[TableConfig], feature_names: list[str], num_dense: int, weighted: bool, batch_size: int = 5
) -> tuple:
    """Inputs of the program's layout to trace it with: uneven bags, an empty one among them."""
    rows = {f: t.rows for t in tables for f in t.features}
    lengths = torch.tensor([2, 0, 1, 3, 1][:batch_size])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    n = int(lengths.sum())
    ids = [torch.arange(n, dtype=torch.int64) % rows[f] for f in feature_names]
    weights = [torch.ones(n) for _ in feature_names] if weighted else []
    return torch.zeros(batch_size, num_dense), ids, [offsets.clone() for _ in feature_names], weights


def export_program(
    model: torch.nn.Module,
    tables: list[TableConfig],
    weights: dict[str, TableWeights],
    num_dense: int,
    weighted: bool,
) -> torch.export.ExportedProgram:
    """`model` (an inference model from build_inference_model; its embeddings are replaced) over
    `weights`, exported with a dynamic batch size and dynamic id counts per feature."""
    lookups = TableLookups(tables, weights)
    program = ScoringProgram(model, lookups).eval()
    names = lookups.feature_names
    batch = torch.export.Dim("batch", min=1)
    counts = [torch.export.Dim(f"num_ids_{k}", min=0) for k in range(len(names))]
    dynamic = (
        {0: batch},
        [{0: c} for c in counts],
        [{0: batch + 1} for _ in names],
        [{0: c} for c in counts] if weighted else [],
    )
    args = example_inputs(tables, names, num_dense, weighted)
    # Size-oblivious tracing: without it a size check in the traced ops (as for any batch traced at
    # size > 1) guards the program to batches of 2 or more samples; with it, one sample scores too.
    with torch.no_grad(), fx_config.patch(backed_size_oblivious=True):
        return torch.export.export(program, args, dynamic_shapes=dynamic, strict=False)


def write_pt2(
    out: str | Path,
    header: dict,
    program: torch.export.ExportedProgram,
    dense: dict[str, torch.Tensor],
    weights: dict[str, TableWeights],
) -> int:
    """Write the folder `out` (model.pt2 and weights.safetensors) as a unit; returns their total bytes.

    Both files are written into a temporary folder beside `out`, which then takes `out`'s place
    (utils/files.replace_folder), so that an earlier export of that name stays whole until the new one
    is complete: a failed write (a full disk, a file-size limit) or a killed process leaves it as it was."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; --format pt2 writes a folder (model.pt2, weights.safetensors)")
    ours = {MODEL_FILE, WEIGHTS_FILE, MODEL_FILE + ".tmp", WEIGHTS_FILE + ".tmp"}
    others = foreign_files(out, ours.__contains__)
    if others:
        raise ExportError(
            f"{out} holds other files ({', '.join(others[:3])}); --format pt2 writes the whole folder: give a new "
            "folder, or one an earlier pt2 export wrote"
        )
    place = out.absolute()
    staging = place.with_name(f".{place.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)  # of an export killed before it finished
    staging.mkdir(parents=True)
    try:
        size = _write_files(staging, header, program, dense, weights)
    except FileWriteError as e:  # named as the file of `out` it was to become
        shutil.rmtree(staging, ignore_errors=True)
        raise FileWriteError(str(e).replace(str(staging), str(out), 1)) from e.__cause__
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_folder(staging, place)
    return size


def _write_files(
    out: Path,
    header: dict,
    program: torch.export.ExportedProgram,
    dense: dict[str, torch.Tensor],
    weights: dict[str, TableWeights],
) -> int:
    """weights.safetensors, then model.pt2 (its header records the weights' size and crc32), into the
    folder `out`; returns their total bytes."""
    quant = header.get("quantization")
    metadata = {
        "format": "neorec-weights",
        "quantization": json.dumps(quant),
        "tables": json.dumps(header["tables"]),
        "inputs": json.dumps(header["inputs"]),
        "layout": (
            "tables/<table>/codes (uint8 [rows, ceil(dim * bits / 8)]: 8 / bits codes a byte, low bits first), "
            "scale and bias ([rows]): row ~ scale * codes + bias"
            if quant
            else "tables/<table>/weight [rows, dim]"
        )
        + "; dense/<key>: the dense model's state dict",
    }
    size = write_safetensors(out / WEIGHTS_FILE, file_tensors(dense, weights), metadata)
    weights_entry = {"name": WEIGHTS_FILE, "bytes": size, "crc32": file_crc32(out / WEIGHTS_FILE)}
    full = {**header, "format": PT2_FORMAT, "weights": weights_entry}
    archive = io.BytesIO()  # torch's archive writer is never left half-written by a failed file write
    torch.export.save(program, archive, extra_files={HEADER_FILE: json.dumps(full, indent=1)})
    write_atomic(
        out / MODEL_FILE, lambda f: f.write(archive.getbuffer()), "export file",
        "an earlier export of that name, if any, is intact",
    )  # fmt: skip
    return size + archive.getbuffer().nbytes
