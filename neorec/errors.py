"""One error type for every user-facing failure: bad configs, bad data, impossible plans; and how the
command line reports what else may stop a command (`failure`): one line, never a traceback, exit 2 for
bad input and 1 for a failure of the machine."""

from __future__ import annotations

import errno
import re


class NeorecError(Exception):
    """A mistake the user can fix. The message names the file/line, key, table or feature concerned."""


class ConfigError(NeorecError):
    """A config value is unknown, of the wrong type, or impossible. The message names the key."""


class DataError(NeorecError):
    """Input data is malformed. The message names the file and line, or the feature."""


class DistributedError(NeorecError):
    """Another rank failed or stopped answering; the message names it and how long this rank waited.
    Not the input's fault: the command line exits 1 (the rank that failed first says why)."""


class MachineError(NeorecError):
    """The machine failed (disk full, a file-size limit, an I/O error, out of memory), or its network
    did (a download that stopped or arrived damaged: neorec.data.download.DownloadError), not the
    input: the command line exits 1 instead of 2."""


# errno values of a failing machine (exit 1), and of a path the user gave that cannot be used (exit 2)
MACHINE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.ENOMEM, errno.EMFILE, errno.ENFILE}
)
PATH_ERRNOS = frozenset({
    errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG,
    errno.ELOOP, errno.EEXIST, errno.ENOTEMPTY, errno.EXDEV,
})  # fmt: skip
_HINTS = {
    errno.ENOSPC: "free some space, or write elsewhere",
    errno.EDQUOT: "the disk quota is used up; free some space, or write elsewhere",
    errno.EFBIG: "a file-size limit (ulimit -f) or the filesystem's largest file was reached",
    errno.EIO: "the disk or filesystem failed; check it (dmesg) before retrying",
    errno.EMFILE: "too many open files; raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on this machine",
    errno.EACCES: "check its permissions, or choose another path",
    errno.EPERM: "check its permissions, or choose another path",
    errno.EROFS: "choose a folder on a writable filesystem",
}
LOWER_MEMORY = (
    "lower data.batch_size, embedding.dim, the tables' rows or the MLP sizes, run more processes "
    "(--nproc) or keep tables on disk (embedding.tier: ssd)"
)


def naming(error: OSError, path: object) -> OSError:
    """`error` (from a call on a file descriptor, which carries no file name) as an OSError naming
    `path`, so that the command line reports which file failed (`failure`)."""
    return OSError(error.errno, error.strerror, str(path))


def state_mismatch(error: BaseException, limit: int = 200) -> str:
    """The first problem torch's load_state_dict reports, on one line (it lists them one per line after
    a heading: missing or unexpected keys, size mismatches)."""
    lines = [" ".join(line.split()) for line in str(error).splitlines() if line.strip()]
    first = next((line for line in lines[1:] if line), lines[0] if lines else type(error).__name__)
    # torch says "from checkpoint" of whatever state it loads (a model.pt, an export file)
    first = _SIZE_MISMATCH.sub(r"shape [\1] in the file, [\2] in the model", first)
    return first[:limit].rstrip(".")


_SIZE_MISMATCH = re.compile(
    r"copying a param with shape torch\.Size\(\[([^\]]*)\]\) from checkpoint, "
    r"the shape in current model is torch\.Size\(\[([^\]]*)\]\)"
)


MAX_MESSAGE_CHARS = 4000  # of an error message: what an input quotes in one is cut short where it is made


def bounded(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message`, its middle left out when it is longer than `limit` characters (a safety net: each
    message cuts what it quotes, but nothing should print megabytes)."""
    if len(message) <= limit:
        return message
    return f"{message[: limit * 3 // 4]} ... ({len(message)} characters in all) ... {message[-limit // 8 :]}"


# what gloo and torch's store say when a peer's process is gone: the failure is another rank's
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "rank that failed first")


def peer_gone(error: BaseException) -> bool:
    """Whether `error` stopped this rank because another rank failed: a DistributedError, or torch's
    error of a collective whose peer process is gone."""
    if isinstance(error, DistributedError):
        return True
    return isinstance(error, RuntimeError) and any(s in str(error) for s in PEER_GONE)


def failure(error: BaseException) -> tuple[int, str] | None:
    """(exit code, one-line message) of an exception that a command reports as `neorec: error: ...`:
    2 for bad input (a NeorecError, a path that cannot be used, input nested too deeply, not UTF-8 or
    holding an integer of thousands of digits),
    1 for a failure of the machine (disk full, an I/O error, a file-size limit, out of memory, or a
    NeorecError caused by one) or of another rank (a DistributedError, a peer's process gone).
    None for anything else: a bug, whose traceback is its report."""
    if isinstance(error, NeorecError):
        machine = isinstance(error, MachineError | DistributedError) or _machine_cause(error)
        return (1 if machine else 2), bounded(str(error))
    if peer_gone(error):
        return 1, _peer_message(str(error))
    if out_of_memory(error):
        detail = " ".join(str(error).split())
        detail = detail[detail.find("DefaultCPUAllocator") :] if "DefaultCPUAllocator" in detail else detail
        return 1, f"out of memory{f' ({detail[:160]})' if detail else ''}; {LOWER_MEMORY}"
    if isinstance(error, OSError) and error.errno is not None:
        name = str(error.filename)  # a path of 4 KiB still makes a short line
        name = name if len(name) <= 200 else f"{name[:120]}...{name[-60:]}"
        where = f"{name}: " if error.filename is not None else ""
        what = f"{where}{error.strerror or error} ({errno.errorcode.get(error.errno, error.errno)})"
        hint = _HINTS.get(error.errno)
        if error.errno in MACHINE_ERRNOS:
            return 1, f"{what}{'' if where else ' while writing or reading a file'}; {hint}"
        if error.errno in PATH_ERRNOS and where:
            return 2, f"{what}{f'; {hint}' if hint else ''}"
        return None
    if isinstance(error, RecursionError):
        return 2, "an input is nested too deeply to read (maximum recursion depth exceeded)"
    if isinstance(error, UnicodeDecodeError):
        return 2, f"an input file is not UTF-8 text ({error.reason} at byte {error.start})"
    if isinstance(error, ValueError) and "integer string conversion" in str(
        error
    ):  # Python's 4300-digit limit
        return 2, "an input holds an integer of thousands of digits; no count or size is that large"
    return None


def _peer_message(text: str) -> str:
    """One line for gloo's error of a peer that is gone: `[.../pair.cc:553] Connection closed by peer
    [127.0.0.1]:20378. This is typically caused by ...` becomes its first sentence, without the path."""
    text = " ".join(text.split())
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\] ", "", text)
    first = text.split(". ", 1)[0].rstrip(".")[:200]
    return (
        f"a peer rank's process is gone ({first}); this rank stops too: the rank that failed first says "
        "why in its own output"
    )


def out_of_memory(error: BaseException) -> bool:
    """MemoryError, an mmap's ENOMEM, or a torch allocator's failure (CPU or CUDA: a RuntimeError)."""
    if isinstance(error, MemoryError) or (isinstance(error, OSError) and error.errno == errno.ENOMEM):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "can't allocate memory" in text
        or "out of memory" in text
        or type(error).__name__ == "OutOfMemoryError"
    )


def _machine_cause(error: BaseException) -> bool:
    """Whether a NeorecError was caused by a failing machine (disk full, I/O error, out of memory):
    e.g. neorec.utils.files.FileWriteError, raised from the OSError of the write."""
    cause = error.__cause__
    while cause is not None:
        if out_of_memory(cause):
            return True
        if isinstance(cause, OSError) and cause.errno is not None:
            return cause.errno in MACHINE_ERRNOS
        cause = cause.__cause__
    # a NeorecError that is itself an OSError (a failed write) without a path errno behind it
    return isinstance(error, OSError) and (error.errno is None or error.errno in MACHINE_ERRNOS)
