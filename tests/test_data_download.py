"""`neorec data download movielens` against a local HTTP server (127.0.0.1, no internet): the archive is
verified and extracted atomically, a damaged one is refused leaving nothing half-written, a stopped
download continues with a Range request (or starts over where the server ignores Range), and the
errors of missing MovieLens or Criteo data say how to get it."""

from __future__ import annotations

import hashlib
import io
import re
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from neorec.cli import main
from neorec.data.download import Archive, DownloadError, download_movielens
from neorec.data.locations import SHARED_MOVIELENS, data_home, movielens_root
from neorec.data.movielens import MovieLensSource

DOCS = Path(__file__).parents[1] / "docs"
NUM_USERS, PER_USER, NUM_MOVIES = 8, 10, 12


def movielens_files() -> dict[str, str]:
    """A tiny MovieLens latest-small: its four CSV files with their real headers, and a README."""
    genres = ["Comedy", "Drama|Romance", "Action|Sci-Fi", "(no genres listed)"]
    movies = ["movieId,title,genres"] + [
        f"{m},Movie {m} ({1990 + m}),{genres[m % 4]}" for m in range(1, NUM_MOVIES + 1)
    ]
    ratings = ["userId,movieId,rating,timestamp"] + [
        f"{u},{1 + (u + i) % NUM_MOVIES},{0.5 + (u * 7 + i * 3) % 10 * 0.5},{964980000 + 100 * i + u}"
        for u in range(1, NUM_USERS + 1)
        for i in range(PER_USER)
    ]
    return {
        "ratings.csv": "\n".join(ratings) + "\n",
        "movies.csv": "\n".join(movies) + "\n",
        "tags.csv": "userId,movieId,tag,timestamp\n1,2,funny,964982000\n",
        "links.csv": "movieId,imdbId,tmdbId\n"
        + "".join(f"{m},{100000 + m},{m}\n" for m in range(1, NUM_MOVIES + 1)),
        "README.txt": "MovieLens latest-small, a test copy.\n",
    }


def make_zip(files: dict[str, str], stored: bool = False) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("ml-latest-small/", "")
        for name, text in files.items():
            zf.writestr(f"ml-latest-small/{name}", text)
    return out.getvalue()


def md5_file(body: bytes) -> bytes:
    """The digest file in GroupLens's form."""
    return f"MD5 (ml-latest-small.zip) = {hashlib.md5(body).hexdigest()}\n".encode()


class Server(ThreadingHTTPServer):
    files: dict[str, bytes]
    seen: list[tuple[str, str | None]]  # (path, Range header) of every request
    ranges = True  # honour Range requests (False: answer 200 with the whole file)
    cut_next = False  # the next archive request gets half its body, then the connection closes


class Handler(BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        srv, asked = self.server, self.headers.get("Range")
        srv.seen.append((self.path, asked))
        body = srv.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        start = int(re.fullmatch(r"bytes=(\d+)-", asked).group(1)) if asked and srv.ranges else 0
        if start >= len(body) > 0 and asked:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(body)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
        self.send_header("Content-Length", str(len(body) - start))
        self.end_headers()
        if srv.cut_next and self.path.endswith(".zip"):
            srv.cut_next = False
            self.wfile.write(body[start : start + (len(body) - start) // 2])
            self.close_connection = True  # the client sees the body end before Content-Length
            return
        self.wfile.write(body[start:])

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")  # a proxy of the machine must not take these
    srv = Server(("127.0.0.1", 0), Handler)
    body = make_zip(movielens_files())
    srv.files, srv.seen = {"/ml.zip": body, "/ml.zip.md5": md5_file(body)}, []
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}/ml.zip"
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=10)


def download(dest: Path, url: str) -> int:
    return main(["data", "download", "movielens", "--dest", str(dest), "--url", url, "--no-progress"])


def one_error(capsys, *words: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith("neorec: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err
    return err


def assert_nothing_half_written(dest: Path) -> None:
    """No MovieLens folder, no temporary extraction folder, no archive part."""
    left = sorted(p.name for p in dest.iterdir()) if dest.exists() else []
    assert left == [], left


def assert_extracted(folder: Path) -> None:
    files = movielens_files()
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    for name, text in files.items():
        assert (folder / name).read_text() == text, name
    assert [p.name for p in folder.parent.iterdir()] == ["ml-latest-small"]  # no .part, no .extract left


# ---- download, verify, extract, read ---------------------------------------------------------------------
def test_download_extracts_and_a_config_without_root_reads_it(tmp_path, server, monkeypatch, capsys):
    monkeypatch.setenv("NEOREC_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)  # no ../shared/data here: an unset data.movielens.root means the download
    assert main(["data", "download", "movielens", "--url", server.url, "--no-progress"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "data" / "ml-latest-small"
    assert f"MovieLens latest-small in {folder}" in out and "/ml.zip.md5" in out, out
    assert "`neorec train --config movielens` reads it there" in out, out
    assert_extracted(folder)
    assert [p for p, _ in server.seen] == ["/ml.zip.md5", "/ml.zip"]

    source = MovieLensSource()  # root unset: the downloaded copy
    assert source.root == folder and len(source.train_index) + len(source.val_index) == NUM_USERS * PER_USER
    assert main(["data", "inspect", "--config", "movielens", "--batches", "1"]) == 0
    assert "movie" in capsys.readouterr().out

    assert main(["data", "download", "movielens", "--url", server.url]) == 0  # already there: no request
    assert "already there; nothing downloaded" in capsys.readouterr().out
    assert len(server.seen) == 2


def test_a_pinned_size_and_sha256_are_checked(tmp_path, server):
    body = server.files["/ml.zip"]
    good = Archive(server.url, len(body), hashlib.sha256(body).hexdigest())
    result = download_movielens(tmp_path / "a", good, progress=False)
    assert result.fetched and "SHA-256 of the official archive" in result.verified
    assert_extracted(result.folder)
    assert [p for p, _ in server.seen] == ["/ml.zip"]  # a pinned digest needs no .md5

    with pytest.raises(DownloadError, match="does not match the archive .sha256"):
        download_movielens(tmp_path / "b", Archive(server.url, len(body), "0" * 64), progress=False)
    assert_nothing_half_written(tmp_path / "b")
    with pytest.raises(
        DownloadError, match=f"the download is {len(body)} bytes, the archive {len(body) + 1}"
    ):
        download_movielens(tmp_path / "c", Archive(server.url, len(body) + 1, "0" * 64), progress=False)
    assert_nothing_half_written(tmp_path / "c")


def damaged(kind: str) -> tuple[bytes, bytes | None]:
    """(archive, its .md5 or None for the good archive's) of one kind of damage."""
    files = movielens_files()
    if kind == "digest":  # the archive changed on the way: the md5 is the good archive's
        body = bytearray(make_zip(files))
        body[len(body) // 3] ^= 0xFF
        return bytes(body), md5_file(make_zip(files))
    if kind == "crc":  # an entry's bytes differ from its CRC32 (stored, so the zip still parses)
        body = bytearray(make_zip(files, stored=True))
        at = bytes(body).index(b"1,2,funny")
        body[at] = ord("7")
        return bytes(body), None
    if kind == "header":
        return make_zip({**files, "ratings.csv": "user,movie,rating,timestamp\n1,1,4.0,1\n"}), None
    if kind == "member":
        return make_zip({k: v for k, v in files.items() if k != "links.csv"}), None
    return b"<html>not found</html>", None  # kind == "not a zip"


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("digest", "does not match the archive (md5"),
        ("crc", "entry 'ml-latest-small/tags.csv' does not read back"),
        ("header", "not the MovieLens header 'userId,movieId,rating,timestamp'"),
        ("member", "the archive lacks ml-latest-small/links.csv"),
        ("not a zip", "not a readable zip archive"),
    ],
)
def test_a_damaged_archive_is_refused_and_nothing_is_left(tmp_path, server, capsys, kind, words):
    body, md5 = damaged(kind)
    server.files.update({"/ml.zip": body, "/ml.zip.md5": md5 or md5_file(body)})
    assert download(tmp_path / "data", server.url) == 1  # the transfer or the server failed: exit 1
    one_error(capsys, words, "rerun the command to download it again")
    assert_nothing_half_written(tmp_path / "data")


# ---- resuming --------------------------------------------------------------------------------------------
def test_a_stopped_download_continues_with_a_range_request(tmp_path, server, capsys):
    body = server.files["/ml.zip"]
    server.cut_next = True
    assert download(tmp_path / "data", server.url) == 1
    one_error(capsys, f"stopped after {len(body) // 2} of {len(body)} bytes", "rerun the same command")
    part = tmp_path / "data" / ".ml-latest-small.zip.part"
    assert part.read_bytes() == body[: len(body) // 2]
    assert not (tmp_path / "data" / "ml-latest-small").exists()

    assert download(tmp_path / "data", server.url) == 0
    assert server.seen[-1] == ("/ml.zip", f"bytes={len(body) // 2}-")
    assert_extracted(tmp_path / "data" / "ml-latest-small")


def test_a_server_that_ignores_range_is_read_from_the_start(tmp_path, server):
    body = server.files["/ml.zip"]
    server.ranges = False
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / ".ml-latest-small.zip.part").write_bytes(body[:100])
    assert download(tmp_path / "data", server.url) == 0
    assert server.seen[-1] == ("/ml.zip", "bytes=100-")  # asked for the rest, got the whole file
    assert_extracted(tmp_path / "data" / "ml-latest-small")


def test_a_whole_part_is_verified_without_downloading_it_again(tmp_path, server):
    body = server.files["/ml.zip"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / ".ml-latest-small.zip.part").write_bytes(body)
    assert download(tmp_path / "data", server.url) == 0  # the server answers 416: nothing is left to send
    assert server.seen[-1] == ("/ml.zip", f"bytes={len(body)}-")
    assert_extracted(tmp_path / "data" / "ml-latest-small")


# ---- where the data is, and what to do when it is not ----------------------------------------------------
def test_the_data_folder_follows_neorec_data_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("NEOREC_DATA", str(tmp_path / "nd"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data_home() == tmp_path / "nd"
    monkeypatch.delenv("NEOREC_DATA")
    assert data_home() == tmp_path / "xdg" / "neorec" / "data"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")  # not absolute: ignored, as the XDG spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_home() == tmp_path / "home" / ".cache" / "neorec" / "data"

    (tmp_path / "shared" / "data" / "ml-latest-small").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    assert movielens_root(None) == SHARED_MOVIELENS  # the copy beside a checkout comes first
    assert movielens_root("mine") == Path("mine")


def test_missing_movielens_names_the_download_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NEOREC_DATA", str(tmp_path / "nd"))
    monkeypatch.chdir(tmp_path)
    assert main(["data", "inspect", "--config", "movielens"]) == 2
    default = tmp_path / "nd" / "ml-latest-small"
    one_error(capsys, f"{default}: no such directory", "get it with: neorec data download movielens")
    named = tmp_path / "elsewhere" / "ml-latest-small"
    assert main(["data", "inspect", "--config", "movielens", "--set", f"data.movielens.root={named}"]) == 2
    one_error(capsys, f"{named}: no such directory", f"neorec data download movielens --dest {named.parent}")


def test_missing_criteo_says_where_to_get_it_and_which_key(tmp_path, capsys):
    sets = ["--set", "data.source=criteo_tsv", "--set", f"data.criteo.train_paths=[{tmp_path / 'day_0.gz'}]"]
    assert main(["data", "inspect", *sets]) == 2
    one_error(
        capsys,
        "day_0.gz: no such file",
        "https://ailab.criteo.com/ressources/",
        "set data.criteo.train_paths",
    )
    assert main(["data", "download", "criteo"]) == 2
    one_error(
        capsys,
        "cannot be downloaded by neorec",
        "https://ailab.criteo.com/ressources/",
        "data.criteo.train_paths",
    )
    assert main(["data", "download", "movielens", "--url", "ftp://x/ml.zip", "--dest", str(tmp_path)]) == 2
    one_error(capsys, "--url", "http:// or https://")


def test_docs_have_the_section_the_errors_name():
    page = (DOCS / "data.md").read_text()
    assert "\n## Getting the data\n" in page
    section = page.split("\n## Getting the data\n", 1)[1].split("\n## ", 1)[0]
    for words in ("neorec data download movielens", "~/.cache/neorec/data/ml-latest-small", "NEOREC_DATA",
                  "https://ailab.criteo.com/ressources/", "data.criteo.train_paths"):  # fmt: skip
        assert words in section, words
