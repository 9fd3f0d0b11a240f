"""The AOTInductor export: one `.pt2` package of compiled code that
`torch._inductor.aoti_load_package` loads and runs without neorec, and reading it back.

The package holds the pt2 export's scoring program (pt2_model.ScoringProgram, traced by
pt2_export.export_program) compiled ahead of time by AOTInductor into a shared library for this
machine's CPU, with the tables and dense weights built into the library as constants. The export
header (config, features, tables, quantization, held-out metrics, input layout) rides along as the
extra file `neorec.json` (the zip entry `<archive>/extra/neorec.json`).

    model = torch._inductor.aoti_load_package("model.pt2")
    probabilities = model(dense, ids, offsets, weights)   # the pt2 program's inputs and output

The package is written by neorec.utils.files.write_atomic (temporary name, fsync, rename). Reading
(`read_aoti`) checks every zip entry against its CRC32 and the header before the library is loaded;
damage stops with an ExportError naming the file.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

from neorec.serving.file_format import ExportError
from neorec.serving.pt2_file import HEADER_FILE, WEIGHTS_FILE
from neorec.utils.files import check_zip, write_atomic

AOTI_FORMAT = "neorec-aoti"  # the "format" of an AOTInductor package's header
_HEADER_ENTRY = f"/extra/{HEADER_FILE}"  # after the archive's own top folder
_COMPILED = "/data/aotinductor/"  # where a package keeps its compiled files
_AGAIN = "export the model again with `neorec export RUN --format aoti --out FILE.pt2`"


def is_aoti(path: str | Path) -> bool:
    """An AOTInductor package: a readable zip archive with compiled AOTInductor files."""
    path = Path(path)
    if not path.is_file() or not zipfile.is_zipfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as zf:
            return any(_COMPILED in name for name in zf.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def check_not_damaged(path: str | Path) -> None:
    """Refuse a `.pt2` file that is not a readable zip archive, unless it is the model.pt2 of a pt2
    export (a folder, weights.safetensors beside it; pt2_file reads and words that one): a package
    cut short or damaged."""
    path = Path(path)
    if path.suffix != ".pt2" or not path.is_file() or (path.parent / WEIGHTS_FILE).is_file():
        return
    if not zipfile.is_zipfile(path):
        raise ExportError(
            f"AOTInductor package {path} is not a readable zip archive: it is truncated or corrupted, or "
            f"another kind of file (a --format pt2 export is a folder, not a .pt2 file); {_AGAIN}"
        )


def check_package_path(out: str | Path) -> None:
    """`--out` names a `.pt2` file (what aoti_load_package and torch's own packager expect)."""
    out = Path(out)
    if out.is_dir():
        raise ExportError(
            f"--out {out}: is a folder; --format aoti writes one file, e.g. {out / 'model.pt2'}"
        )
    if out.suffix != ".pt2":
        raise ExportError(
            f"--out {out}: an AOTInductor package is a .pt2 file (torch's packager and loader expect the "
            f"suffix); give e.g. {out.with_suffix('.pt2')}"
        )


def compile_package(program: torch.export.ExportedProgram) -> list[Any]:
    """The files AOTInductor compiles `program` into (C++ wrapper and kernels, the shared library
    with the weights as constants), ready to package. Needs a C++ compiler."""
    from torch._inductor import aot_compile

    args, kwargs = program.example_inputs
    try:
        with warnings.catch_warnings():  # torch's own deprecation notices from inside the compile
            warnings.simplefilter("ignore", FutureWarning)
            files = aot_compile(
                program.module(check_guards=False), args, kwargs, options={"aot_inductor.package": True}
            )
    except Exception as e:  # noqa: BLE001 - the compiler's own errors (no g++, a failed build) vary
        reason = str(e).strip().splitlines()[-1][:400] if str(e).strip() else type(e).__name__
        raise ExportError(
            f"AOTInductor could not compile the scoring program ({type(e).__name__}: {reason}); it needs a C++ "
            "compiler (g++ or clang++, found on PATH or named by the CXX environment variable); --format pt2 "
            "needs none"
        ) from None
    if not isinstance(files, list):
        raise ExportError(f"AOTInductor returned {type(files).__name__}, not the list of files to package")
    return files


def write_aoti(out: str | Path, header: dict, program: torch.export.ExportedProgram) -> int:
    """Compile `program` and write the package `out` (a .pt2 file) with `header`; returns its bytes."""
    from torch.export.pt2_archive._package import package_pt2

    out = Path(out)
    check_package_path(out)
    files = compile_package(program)
    full = {**header, "format": AOTI_FORMAT}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(
        out,
        lambda f: package_pt2(f, aoti_files=files, extra_files={HEADER_FILE: json.dumps(full, indent=1)}),
        "export file",
        "an earlier export of that name, if any, is intact",
    )
    return out.stat().st_size


def read_header(path: Path) -> dict:
    """The header of the package `path` (its zip entries already checked)."""
    with zipfile.ZipFile(path) as zf:
        names = [n for n in zf.namelist() if n.endswith(_HEADER_ENTRY) and n.count("/") == 2]
        if len(names) != 1:
            raise ExportError(
                f"{path} is an AOTInductor package but not one written by `neorec export --format aoti` (no "
                f"extra/{HEADER_FILE} in it)"
            )
        text = zf.read(names[0])
    try:
        header = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != AOTI_FORMAT:
        raise ExportError(
            f"{path}: its extra/{HEADER_FILE} is not the header of `neorec export --format aoti`; {_AGAIN}"
        )
    return header


def read_aoti(path: str | Path) -> tuple[dict, Any]:
    """(header, the loaded model) of an AOTInductor package, after checking its zip entries."""
    path = Path(path)
    check_zip(path, "AOTInductor package", _AGAIN, ExportError)
    header = read_header(path)
    from torch._inductor import aoti_load_package

    try:
        model = aoti_load_package(str(path))
    except (OSError, RuntimeError, KeyError, ValueError) as e:
        reason = str(e).strip().splitlines()[0][:400] if str(e).strip() else type(e).__name__
        raise ExportError(
            f"AOTInductor package {path} cannot be loaded ({type(e).__name__}: {reason}); it runs on a CPU like "
            f"the one that compiled it, with a torch that reads its format; {_AGAIN}"
        ) from None
    return header, model
