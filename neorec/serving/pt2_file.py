"""The files of a pt2 export folder, and reading one back (neorec/serving/pt2_export.py writes it).

    DIR/model.pt2            a `torch.export` program (pt2_model.ScoringProgram) saved with
                             `torch.export.save`; the export header (config, features, tables,
                             quantization, held-out metrics, input layout) rides along as the extra
                             file `neorec.json`
    DIR/weights.safetensors  the tables (`tables/<table>/weight`, or quantized `codes`, `scale`, `bias`) and
                             the dense weights (`dense/<state_dict key>`), crc32 of each in the metadata

Loading (`read_pt2`) checks every zip entry of model.pt2 against its CRC32 (torch.export.load does
not), then the weights file against the size and crc32 the header records, before anything scores;
damage stops with an ExportError naming the file.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import torch

from neorec.serving.file_format import ExportError
from neorec.serving.pt2_model import PT2_FORMAT
from neorec.serving.safetensors_file import read_safetensors
from neorec.utils.files import check_zip, file_crc32

MODEL_FILE = "model.pt2"
WEIGHTS_FILE = "weights.safetensors"
HEADER_FILE = "neorec.json"  # the extra file inside model.pt2
_AGAIN = "export the model again with `neorec export RUN --format pt2 --out DIR`"


def is_pt2(path: str | Path) -> bool:
    """A pt2 export folder or its model.pt2."""
    path = Path(path)
    return (path / MODEL_FILE).is_file() or (path.suffix == ".pt2" and path.is_file())


def read_pt2(path: str | Path) -> tuple[dict, torch.nn.Module, Path]:
    """(header, the program's module, model.pt2's path) of a pt2 folder or model.pt2, after checking
    model.pt2's zip entries and the weights file beside it."""
    path = Path(path)
    file = path / MODEL_FILE if path.is_dir() else path
    if not zipfile.is_zipfile(file):  # checked first: torch logs a traceback for a damaged archive
        raise ExportError(
            f"pt2 export {file} is not a pt2 archive (a zip file): it is truncated or corrupted, or another "
            f"kind of file; {_AGAIN}"
        )
    check_zip(file, "pt2 export", _AGAIN, ExportError)
    extra = {HEADER_FILE: ""}
    try:
        program = torch.export.load(file, extra_files=extra)
    except (OSError, RuntimeError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise ExportError(f"pt2 export {file} cannot be loaded ({type(e).__name__}: {e})") from None
    try:
        header = json.loads(extra[HEADER_FILE])
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or header.get("format") != PT2_FORMAT:
        raise ExportError(
            f"{file} is a torch.export program but not one written by `neorec export --format pt2`"
        )
    check_weights(file.parent, header)
    return header, program.module(), file


def check_weights(folder: Path, header: dict) -> None:
    """weights.safetensors in `folder` has the size and crc32 that model.pt2's header records (an
    export written before they were recorded: each tensor's crc32 in its metadata is checked)."""
    path = folder / WEIGHTS_FILE
    entry = header.get("weights")
    if entry is None:
        read_safetensors(path)
        return
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), int) for k in ("bytes", "crc32")):
        raise ExportError(
            f"pt2 export {folder / MODEL_FILE}: its header's 'weights' entry is malformed; {_AGAIN}"
        )
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ExportError(
            f"weights file {path} of the pt2 export cannot be read ({e.strerror or e}); {_AGAIN}"
        ) from None
    if size != entry["bytes"]:
        raise ExportError(
            f"weights file {path} has {size} bytes but {folder / MODEL_FILE} records {entry['bytes']}: it is "
            f"truncated or was replaced; {_AGAIN}"
        )
    if file_crc32(path) != entry["crc32"]:
        raise ExportError(
            f"weights file {path}: checksum mismatch (its crc32 differs from the one {MODEL_FILE} records): "
            f"the file is corrupted; {_AGAIN}"
        )
