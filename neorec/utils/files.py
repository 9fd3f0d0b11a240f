"""Files on disk: one writer for every file neorec writes, checksums on every file it reads back, and
names read from files kept inside their folder (docs/integrity.md lists every file).

- `write_atomic(path, write, what)`: write(file) into `<name>.tmp`, flush, fsync, rename onto `path`,
  fsync of the folder, so that a reader sees the old file or the new one, never part of one. A write
  that fails (disk full, a file-size limit, an I/O error, an exception of `write`) removes the
  temporary file; a failure of the disk raises FileWriteError naming the file and what is written.
- JSON read back carries a checksum of its own: `write_json` adds a top-level "crc32", the crc32 of
  the canonical JSON (sorted keys, no spaces, ASCII) of everything else, which `read_json` checks.
- Zip archives (torch.save, torch.export.save): `check_zip` checks every entry against its CRC32,
  which torch.load does not.
- `plain_name`: a file or feature name read from a file is a bare name, never a path.

Nothing here knows checkpoints, exports or runs: callers pass what the file is (`what`), what to do
about damage (`hint`) and the error type their command reports.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import zipfile
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

from neorec.errors import MACHINE_ERRNOS, PATH_ERRNOS, NeorecError

CHECKSUM_KEY = "crc32"
_SPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # a write stopped for want of room
_CHUNK = 8 << 20  # bytes per read when checksumming


class FileWriteError(NeorecError, OSError):
    """A file could not be written (disk full, a file-size limit, an I/O error). Names the file; the
    file written before under that name, if any, is untouched."""


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(
    path: str | Path,
    write: Callable[[BinaryIO], None],
    what: str = "file",
    keeps: str = "the file written before under that name, if any, is intact",
    error: type[Exception] = FileWriteError,
    *,
    hidden: bool = False,
) -> None:
    """write(file) into `path.tmp` (`.path.tmp` when `hidden`: for folders whose readers list every
    file but hidden ones) opened for reading too, then flush, fsync, rename it to `path` and fsync
    the folder. A failed write (an OSError: ENOSPC, EFBIG, EIO; or torch's zip writer's RuntimeError,
    see _from_writing) removes the partial file, to give the space back, and raises `error` worded
    "cannot write {what} {path}: ...; {keeps}"; any other exception (e.g. a RuntimeError of computing
    what `write` writes) removes it and goes on, unworded."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp" if hidden else f"{path.name}.tmp")
    try:
        with open(tmp, "w+b") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, NeorecError) or not _from_writing(e):  # already worded (a nested write), or not ours
            raise
        cause = _os_error(e) or e  # torch.save raises RuntimeError during the OSError of the write
        raise write_error(path, e, what, keeps, error) from cause
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


_TORCH_WRITER = ("PytorchStreamWriter", "unexpected pos")  # torch's zip writer's own failures


def _from_writing(e: OSError | RuntimeError) -> bool:
    """Whether `e`, raised inside write_atomic, is a failure of the writing: an OSError, or a
    RuntimeError of torch's zip writer (torch.save, torch.export.save), which it raises during the
    OSError of a file object's write, or with a message of its own where it writes itself."""
    return isinstance(e, OSError) or _os_error(e) is not None or any(w in str(e) for w in _TORCH_WRITER)


def write_error(
    path: str | Path, e: BaseException, what: str, keeps: str, error: type[Exception] = FileWriteError
) -> Exception:
    """The `error` for a failed write of `path`: "cannot write {what} {path}: {reason}; {keeps}"."""
    cause = _os_error(e) or e
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e).strip().splitlines()[-1]
    if not isinstance(cause, OSError) or cause.errno in _SPACE_ERRNOS:
        reason += " (is the disk full, or a file-size limit set?)"
    return error(f"cannot write {what} {path}: {reason}; {keeps}")


def replace_folder(new: Path, place: Path) -> None:
    """Put the folder `new` in the place of the folder `place` (absent or an earlier version), durably.
    Where Linux's renameat2 can exchange the two in one step, a reader of `place` sees the old folder
    or the new one, at any moment; elsewhere the old one is renamed aside first, for a moment without
    a folder at `place` (never a part of one). The old folder is then removed."""
    if place.is_dir() and _exchange(new, place):
        shutil.rmtree(new, ignore_errors=True)  # now the old folder
    else:
        aside = place.with_name(f".{place.name}.old")
        shutil.rmtree(aside, ignore_errors=True)
        if place.is_dir():
            os.replace(place, aside)
        os.replace(new, place)
        shutil.rmtree(aside, ignore_errors=True)
    fsync_dir(place.parent)


def foreign_files(folder: Path, ours: Callable[[str], bool]) -> list[str]:
    """The names in `folder` (when it is one) that `ours` does not claim, sorted: what replacing the
    folder whole (replace_folder) would remove besides an earlier version of itself."""
    return sorted(p.name for p in folder.iterdir() if not ours(p.name)) if folder.is_dir() else []


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (renameat2 with RENAME_EXCHANGE); False where that is not available."""
    try:
        import ctypes

        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not glibc 2.28+ (or not Linux)
        return False
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    return renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind `e` (itself, or what it was raised from or during)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def write_text(path: str | Path, text: str, what: str) -> None:
    """A text file, through write_atomic."""
    write_atomic(path, lambda f: f.write(text.encode()), what)


def file_crc32(path: str | Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def size_and_crc32(path: str | Path) -> list[int]:
    """[size, crc32] of a file, as the JSON file that lists it records them."""
    return [Path(path).stat().st_size, file_crc32(path)]


def check_recorded(
    path: Path, recorded: Sequence[int | None], record: str | Path, hint: str, error: type[Exception] = NeorecError,
    what: str = "",
) -> None:  # fmt: skip
    """The file has the [size, crc32] that `record` (the file that lists it, or words for it) records; a
    crc32 of None is not checked. An `error` naming the file, `record` and `hint` if not: the file
    cannot be read, has another size (truncated or replaced) or another crc32 (damaged). `what` comes
    before the file's path in the message ("checkpoint file ")."""
    size, crc32 = recorded
    try:
        actual = Path(path).stat().st_size
        crc_differs = actual == size and crc32 is not None and file_crc32(path) != crc32
    except OSError as e:  # raised from it: a failing disk (EIO) exits 1, as errors.failure says
        raise error(f"{what}{path}: cannot read ({e.strerror or e}), though {record} lists it; {hint}") from e
    if actual != size:
        raise error(
            f"{what}{path}: has {actual} bytes but {record} records {size}: the file is truncated or was "
            f"replaced; {hint}"
        )
    if crc_differs:
        raise error(
            f"{what}{path}: checksum mismatch (its crc32 differs from the one {record} records): the file is "
            f"damaged; {hint}"
        )


# ---- JSON with a checksum ------------------------------------------------------------------------------
def json_crc32(obj: Any) -> int:
    """crc32 of the canonical JSON of `obj`: what a file's "crc32" key records for the rest of it."""
    return zlib.crc32(json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode())


def json_text(obj: dict, indent: int | None = 1, sort_keys: bool = False) -> str:
    """`obj` as JSON text with its "crc32" key (the last key, unless `sort_keys`)."""
    body = {k: v for k, v in obj.items() if k != CHECKSUM_KEY}
    full = {**body, CHECKSUM_KEY: json_crc32(body)}
    return json.dumps(full, indent=indent, sort_keys=sort_keys) + "\n"


def write_json(path: str | Path, obj: dict, what: str, indent: int | None = 1, sort_keys: bool = False) -> None:
    """`obj` with its checksum, through write_atomic."""
    write_text(path, json_text(obj, indent, sort_keys), what)


def read_json(
    path: str | Path,
    what: str,
    hint: str,
    error: type[Exception] = NeorecError,
    *,
    required: bool = False,
    keys: tuple[str, ...] | None = None,
) -> dict:
    """The JSON object of `path` without its "crc32" key, after checking it (load_json, then
    check_json). Errors are `error`s naming the file, with `hint` (what to do about damage)."""
    return check_json(load_json(path, what, hint, error), path, what, hint, error, required=required, keys=keys)


def read_json_of_files(
    path: str | Path,
    what: str,
    hint: str,
    error: type[Exception],
    records_files: Callable[[dict], bool],
    keys: tuple[str, ...] | None = None,
) -> dict:
    """read_json of a file that records other files' sizes and crc32s (`records_files` says whether it
    does). One without its own "crc32" key is read as written by hand or before checksums, which
    record no files: one that records files but has no crc32 was damaged or edited, and is refused."""
    data = load_json(path, what, hint, error)
    signed = CHECKSUM_KEY in data
    data = check_json(data, path, what, hint, error, keys=keys)
    if not signed and records_files(data):
        raise error(
            f"{what} {path} has no checksum (key {CHECKSUM_KEY!r}) though it records its files' crc32s, "
            f"as only a file with one does: the file is damaged or was edited; {hint}"
        )
    return data


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's mapping, refusing a key given twice (a hand-edited file's mistake)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def load_json(path: str | Path, what: str, hint: str, error: type[Exception] = NeorecError) -> dict:
    """The JSON object of `path` as it is (its checksum not yet checked)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise error(f"{what} {path} cannot be read: {e.strerror or e}") from None
    try:
        data = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        why = "it is empty" if not raw else f"not valid JSON: {e}"
        raise error(f"{what} {path} cannot be read: it is damaged or truncated ({why}); {hint}") from None
    except _DuplicateKey as e:  # json.loads would keep the last one silently
        raise error(
            f"{what} {path}: key {e.args[0]!r} appears twice in one object; keep one of them"
        ) from None
    if not isinstance(data, dict):
        raise error(f"{what} {path} is damaged: expected a JSON object, got {type(data).__name__}; {hint}")
    return data


def check_json(
    data: dict,
    path: str | Path,
    what: str,
    hint: str,
    error: type[Exception] = NeorecError,
    *,
    required: bool = False,
    keys: tuple[str, ...] | None = None,
) -> dict:
    """`data` without its "crc32" key, which must match the rest. `required`: a file without the key
    is refused (neorec wrote it); otherwise (a file that may be written by hand, or by an older neorec)
    it is accepted when it holds no key besides `keys`: a damaged "crc32" key is an unknown one."""
    crc = data.pop(CHECKSUM_KEY, None)
    if crc is None:
        if required:
            raise error(f"{what} {path} has no checksum (key {CHECKSUM_KEY!r}): the file is damaged; {hint}")
        unknown = sorted(set(data) - set(keys)) if keys is not None else []
        if unknown:
            raise error(
                f"{what} {path}: unknown key(s) {unknown} (allowed: {', '.join(keys or ())}): a mistyped key, or "
                f"the file is damaged; {hint}"
            )
    elif isinstance(crc, bool) or not isinstance(crc, int) or crc != json_crc32(data):
        raise error(
            f"{what} {path}: checksum mismatch (the crc32 of its content differs from the one it records): "
            f"the file is damaged; {hint}"
        )
    return data


# ---- zip archives ----------------------------------------------------------------------------------------
def check_zip(
    path: str | Path, what: str, hint: str, error: type[Exception] = NeorecError, *, folders: bool = False
) -> None:
    """Every entry of the zip archive `path` (a torch.save or torch.export.save file; any archive with
    `folders`) reads back with the CRC32 its directory records, and none is a folder unless `folders`;
    a truncated or damaged archive raises `error` naming the file."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()
            # torch's reader (miniz) reads an entry flagged as a folder (a name ending in "/", or the DOS
            # folder bit of its attributes) as empty and leaves its tensor's memory unfilled; torch never
            # writes folders, and testzip does not look at the flag
            entries = [] if folders else zf.infolist()
            folder = next((i.filename for i in entries if i.is_dir() or i.external_attr & 0x10), None)
    except OSError as e:  # the file cannot be read at all (permissions, a failing disk): no damage found
        if e.errno not in PATH_ERRNOS | MACHINE_ERRNOS:  # EINVAL: a seek to where a damaged directory points
            raise error(f"{what} {path} is damaged or truncated (not a readable zip archive: {e}); {hint}") from None
        fix = "; check its permissions" if e.errno in (errno.EACCES, errno.EPERM) else ""
        raise error(f"cannot read {what} {path}: {e.strerror or e}{fix}") from e  # exit 1 for EIO (errors.failure)
    except Exception as e:  # noqa: BLE001 - any other failure to read the archive is damage
        raise error(f"{what} {path} is damaged or truncated (not a readable zip archive: {e}); {hint}") from None
    if folder is not None:
        raise error(
            f"{what} {path}: its entry {folder!r} is marked as a folder in the archive's directory: the file is "
            f"damaged; {hint}"
        )
    if bad is not None:
        raise error(
            f"{what} {path}: its entry {bad!r} does not read back (checksum mismatch or a damaged header): the "
            f"file is damaged; {hint}"
        )


# ---- names read from files ---------------------------------------------------------------------------------
def plain_name(name: object, where: str, error: type[Exception] = NeorecError) -> str:
    """`name` when it is a bare name: a non-empty string without '/', '\\', '..' or NUL, so that joined
    to a folder it stays in that folder. `where` says whose name it is ("<file>: feature")."""
    if not isinstance(name, str) or not name or any(s in name for s in ("/", "\\", "..", "\0")):
        raise error(
            f"{where} {name!r} is not a plain name: it becomes part of a path, so it must not be empty nor "
            "hold '/', '\\', '..' or NUL"
        )
    return name
