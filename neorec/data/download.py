"""`neorec data download movielens`: MovieLens latest-small from GroupLens, downloaded with resumption,
verified, and extracted atomically into `<dest>/ml-latest-small` (dest: neorec/data/locations.py's
data_home(), ~/.cache/neorec/data by default).

- Resumable: the archive is written to `<dest>/.ml-latest-small.zip.part`. A download that stops (the
  connection drops, Ctrl-C) keeps the bytes it has; the next run asks for the rest with an HTTP Range
  request, and starts over when the server sends the whole file instead (it ignores Range) or cannot
  continue from there (416).
- Verified before anything is extracted. The official archive: its size and SHA-256, pinned below
  (the figures TensorFlow Datasets records for this URL in url_checksums/movielens.txt; GroupLens's
  file of 2018-09-26). An archive from another URL (`Archive(url)`: a mirror, or a test's server):
  the MD5 that is served beside it at `<url>.md5`, as GroupLens serves one beside each of its archives
  (fetched with the archive, so it shows that the download arrived intact, not who made it). Then
  either: a zip whose entries read back with the CRC32s it records (zipfile.testzip), holding
  ml-latest-small/{ratings,movies,tags,links}.csv, each with its MovieLens header.
- An archive that fails a check is removed, so that the next run downloads it again; nothing is
  extracted from it.
- Atomic: the files are written to `<dest>/.ml-latest-small.extract/`, each fsynced, and the folder is
  renamed to `<dest>/ml-latest-small` once complete: a reader sees the whole folder or none.
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import os
import re
import shutil
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple, NoReturn

from neorec import __version__
from neorec.data.locations import MOVIELENS_NAME, data_home, movielens_root
from neorec.errors import MachineError, NeorecError
from neorec.utils.files import check_zip, fsync_dir, write_atomic
from neorec.utils.progress import progress_bar

MOVIELENS_URL = "https://files.grouplens.org/datasets/movielens/ml-latest-small.zip"
MOVIELENS_SIZE = 978_202  # bytes
MOVIELENS_SHA256 = "696d65a3dfceac7c45750ad32df2c259311949efec81f0f144fdfb91ebc9e436"
HEADERS = {  # file of the archive's ml-latest-small/ folder -> its first line
    "ratings.csv": "userId,movieId,rating,timestamp",
    "movies.csv": "movieId,title,genres",
    "tags.csv": "userId,movieId,tag,timestamp",
    "links.csv": "movieId,imdbId,tmdbId",
}
README = "README.txt"  # the licence; extracted too when the archive holds it
TIMEOUT_S = 60  # seconds a connection may wait for the server's next bytes
_CHUNK = 1 << 16
_BYTES = {"unit": "B", "unit_scale": True, "unit_divisor": 1024}  # the progress bar counts KiB, MiB
_AGAIN = "removed it: rerun the command to download it again"


class DownloadError(MachineError):
    """A download failed or arrived damaged: the network or the server failed, not the command's input
    (exit 1); rerunning the command continues or repeats it."""


@dataclass(frozen=True)
class Archive:
    """Where an archive is downloaded from, and what it must match: its size and SHA-256 when known
    (the official archive), else (sha256 None) the MD5 served at `url + ".md5"`."""

    url: str
    size: int | None = None
    sha256: str | None = None


OFFICIAL = Archive(MOVIELENS_URL, MOVIELENS_SIZE, MOVIELENS_SHA256)


class Downloaded(NamedTuple):
    folder: Path  # <dest>/ml-latest-small
    fetched: bool  # False: the folder was already there, nothing was downloaded
    verified: str  # what the archive was checked against ("" when nothing was downloaded)


def archive_at(url: str | None) -> Archive:
    """The official archive, or the archive at `url` (http or https), checked against its .md5."""
    if url is None or url == MOVIELENS_URL:
        return OFFICIAL
    if not re.match(r"https?://[^/\s]+", url):
        raise NeorecError(f"--url {url!r}: expected an http:// or https:// address of ml-latest-small.zip")
    return Archive(url)


def download_movielens(
    dest: str | Path | None = None, archive: Archive = OFFICIAL, progress: bool = True
) -> Downloaded:
    """MovieLens latest-small in `<dest>/ml-latest-small` (dest default: data_home()): downloaded,
    verified and extracted (see the module docstring), or left as it is when that folder exists."""
    dest = Path(dest) if dest is not None else data_home()
    folder = dest / MOVIELENS_NAME
    if folder.exists():
        missing = [name for name in HEADERS if not (folder / name).is_file()]
        if missing:
            raise NeorecError(
                f"{folder}: exists but lacks {', '.join(missing)}; move it away and rerun the command"
            )
        return Downloaded(folder, False, "")
    dest.mkdir(parents=True, exist_ok=True)
    part = dest / f".{MOVIELENS_NAME}.zip.part"
    md5 = published_md5(archive.url) if archive.sha256 is None else None
    fetch(archive, part, progress)
    verified = verify(archive, part, md5)
    extract(part, folder)
    part.unlink()
    fsync_dir(dest)
    return Downloaded(folder, True, verified)


# ---- the transfer ---------------------------------------------------------------------------------------
def fetch(archive: Archive, part: Path, progress: bool = True) -> None:
    """Bring `part` to the whole archive: continue it from its length with a Range request, or start
    over where that cannot be done. A transfer that stops keeps what arrived and raises DownloadError."""
    have = part.stat().st_size if part.is_file() else 0
    if archive.size is not None and have > archive.size:
        have = 0  # longer than the archive: not a part of it
    if archive.size is not None and have == archive.size:
        return  # whole: verify() checks it
    response, have, total = _request(archive.url, have)
    if response is None:
        return  # the server says the part is whole already
    with response, open(part, "r+b" if part.exists() else "wb") as f:
        f.truncate(have)  # a server that ignored Range sends the file from byte 0 again
        f.seek(have)
        got = have
        bar = progress_bar(total, f"{MOVIELENS_NAME}.zip", progress, initial=have, **_BYTES)
        try:
            while chunk := _read(response, archive.url, part, got, total):
                f.write(chunk)  # a failing disk raises its OSError: the command reports it (errors.py)
                got += len(chunk)
                if bar is not None:
                    bar.update(len(chunk))
        finally:
            if bar is not None:
                bar.close()
            f.flush()
            os.fsync(f.fileno())  # what arrived survives a crash, to be continued
    expected = total if total is not None else archive.size
    if expected is not None and got < expected:  # the body ended early without an error
        raise _stopped(archive.url, part, got, expected, "the server closed the connection")


def _request(url: str, have: int) -> tuple[http.client.HTTPResponse | None, int, int | None]:
    """(response, the byte it starts at, the archive's length if the server says) for the bytes from
    `have` on; (None, have, have) when the server answers that `have` bytes are the whole file."""
    headers = {"User-Agent": f"neorec/{__version__}"}
    if have:
        headers["Range"] = f"bytes={have}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416 and have:  # Range Not Satisfiable: the part is the whole file, or not a part of it
            m = re.fullmatch(r"bytes \*/(\d+)", e.headers.get("Content-Range", "").strip())
            return (None, have, have) if m and int(m.group(1)) == have else _request(url, 0)
        raise DownloadError(
            f"{url}: the server answered HTTP {e.code} {e.reason}; is the address right?"
        ) from None
    except (OSError, http.client.HTTPException) as e:  # no network, a refused connection, a timeout, TLS
        raise DownloadError(
            f"cannot reach {url}: {_reason(e)}; check the network (behind a proxy: set https_proxy)"
        ) from None
    if have and response.status == 206:
        m = re.fullmatch(r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("Content-Range", "").strip())
        if m and int(m.group(1)) == have:
            return response, have, int(m.group(2)) if m.group(2) != "*" else None
        response.close()  # a range other than the one asked for: start over
        return _request(url, 0)
    length = response.headers.get("Content-Length")
    return response, 0, int(length) if length and length.isdigit() else None


def _read(response: http.client.HTTPResponse, url: str, part: Path, got: int, total: int | None) -> bytes:
    try:
        return response.read(_CHUNK)
    except (OSError, http.client.HTTPException) as e:  # a dropped connection, a timeout, a truncated body
        raise _stopped(url, part, got, total, _reason(e)) from None


def _stopped(url: str, part: Path, got: int, total: int | None, why: str) -> DownloadError:
    of = f" of {total}" if total is not None else ""
    return DownloadError(
        f"the download of {url} stopped after {got}{of} bytes ({why}); rerun the same command to continue it "
        f"from {part}"
    )


def _reason(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e.reason, str):
        e = e.reason  # the socket's error behind urllib's
    if isinstance(e, http.client.IncompleteRead):
        return "the connection closed before the end of the file"
    return " ".join(str(e).split())[:160] or type(e).__name__


def published_md5(url: str) -> str:
    """The MD5 served beside `url` at `url + ".md5"`: GroupLens writes `MD5 (name) = <hex>`; the
    md5sum form `<hex>  name` is read too."""
    try:
        with urllib.request.urlopen(url + ".md5", timeout=TIMEOUT_S) as response:
            text = response.read(4096).decode("ascii", "replace")
    except urllib.error.HTTPError as e:
        e.close()
        raise DownloadError(
            f"{url}.md5: the server answered HTTP {e.code} {e.reason}; an archive from another address than "
            "GroupLens's is checked against the MD5 served beside it"
        ) from None
    except (OSError, http.client.HTTPException) as e:
        raise DownloadError(f"cannot reach {url}.md5: {_reason(e)}; check the network") from None
    m = re.search(r"\b[0-9a-fA-F]{32}\b", text)
    if m is None:
        raise DownloadError(f"{url}.md5 holds no MD5 digest (32 hex digits)")
    return m.group(0).lower()


# ---- checks and extraction ---------------------------------------------------------------------------------
def verify(archive: Archive, part: Path, md5: str | None) -> str:
    """Check the downloaded archive (its digest, then its zip structure and files); one that fails is
    removed and raises DownloadError. Returns what it was checked against, in words."""
    size = part.stat().st_size
    if archive.size is not None and size != archive.size:
        _refuse(part, f"{archive.url}: the download is {size} bytes, the archive {archive.size}; {_AGAIN}")
    kind, want = ("sha256", archive.sha256) if archive.sha256 is not None else ("md5", md5)
    got = _digest(part, kind)
    if got != want:
        _refuse(part, (
            f"{archive.url}: the download does not match the archive ({kind} {got}, expected {want}): it was "
            f"damaged on the way, or the server sent another file; {_AGAIN}"
        ))  # fmt: skip
    try:
        check_zip(part, "the downloaded archive", _AGAIN, DownloadError, folders=True)  # entries against CRC32s
        with zipfile.ZipFile(part) as zf:
            names = set(zf.namelist())
            for name, header in HEADERS.items():
                member = f"{MOVIELENS_NAME}/{name}"
                if member not in names:
                    raise DownloadError(
                        f"{archive.url}: the archive lacks {member}: not MovieLens latest-small; {_AGAIN}"
                    )
                with zf.open(member) as f:
                    first = f.readline(4096).decode("utf-8-sig", "replace").strip()
                if first != header:
                    raise DownloadError(
                        f"{archive.url}: {member} starts with {first[:80]!r}, not the MovieLens header {header!r}; {_AGAIN}"
                    )
    except DownloadError:
        part.unlink(missing_ok=True)
        raise
    if kind == "sha256":
        return f"the size and SHA-256 of the official archive: {want[:16]}..."
    return f"the MD5 served at {archive.url}.md5: {want}"


def _refuse(part: Path, message: str) -> NoReturn:
    part.unlink(missing_ok=True)
    raise DownloadError(message)


def _digest(path: Path, kind: str) -> str:
    h = hashlib.new(kind)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def extract(archive: Path, folder: Path) -> None:
    """The MovieLens files of a verified `archive` into `folder`, atomically: written (each fsynced) into
    a temporary folder beside it, which is renamed to `folder` once complete. A failure removes the
    temporary folder and leaves no `folder`."""
    tmp = folder.with_name(f".{folder.name}.extract")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run that stopped while extracting
    tmp.mkdir()
    try:
        with zipfile.ZipFile(archive) as zf:
            names = set(zf.namelist())
            for name in [*HEADERS, README]:
                member = f"{MOVIELENS_NAME}/{name}"
                if member in names:
                    with zf.open(member) as src:
                        write_atomic(tmp / name, functools.partial(_copy, src), "MovieLens file")
        fsync_dir(tmp)
        os.rename(tmp, folder)
        fsync_dir(folder.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _copy(src: BinaryIO, dst: BinaryIO) -> None:
    shutil.copyfileobj(src, dst, _CHUNK)


def result_text(result: Downloaded) -> str:
    """What `neorec data download movielens` prints: where the data is and how a config reads it."""
    if result.fetched:
        text = f"MovieLens latest-small in {result.folder} (checked against {result.verified})"
    else:
        text = f"{result.folder}: already there; nothing downloaded"
    if movielens_root(None).resolve() == result.folder.resolve():
        return f"{text}\n`neorec train --config movielens` reads it there (data.movielens.root unset)"
    return f"{text}\nread it with --set data.movielens.root={result.folder}"
