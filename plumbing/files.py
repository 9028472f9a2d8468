"""plumbing/files.py - the leaf helpers every other module may use: the one-line error for bad
input, files written whole or not at all, one JSONL line in one write, and an output directory
claimed by one run. It imports nothing of the project, so it is in no import circle.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import tempfile

log = logging.getLogger("train")


class InputError(Exception):
    """Bad flags or inputs, reported as one line before any heavy work."""


class SaveError(OSError):
    """Writing a checkpoint, the final model, a log or a transcript failed (a full disk, ...).
    Nothing half-written is left where a later command would read it. `elsewhere`: this
    process wrote its part; another process's write failed (that one says why)."""
    elsewhere = False


class _FailedElsewhere(OSError):
    pass


@contextlib.contextmanager
def written_atomically(path: str, owner: bool = True, unique: bool = False):
    """Yield a temporary path beside `path` (a file or a folder to write); when the block ends
    without an error, rename it onto `path` (atomic on one file system; a folder replaces the
    old one whole), else remove it and raise SaveError. owner=False: only write into it
    (another process of a launch owns the rename). unique: several processes may write the same
    thing at once, each into its own temporary path; the first rename wins, a later one fails.

    A full disk shows as OSError, torch.save's RuntimeError or safetensors' own error,
    depending on the writer: all are a SaveError here."""
    name = f".tmp-{os.getpid()}-" if unique else ".tmp-"
    tmp = os.path.join(os.path.dirname(path) or ".", name + os.path.basename(path))
    if owner:
        _remove(tmp)
    try:
        yield tmp
        if owner:
            if os.path.isdir(tmp) and not unique:
                _remove(path)
            os.replace(tmp, path)
    except Exception as e:
        error = SaveError(f"could not write {path}: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}")
        error.elsewhere = isinstance(e, _FailedElsewhere)
        raise error from e
    finally:
        if owner:
            _remove(tmp)


def append_line(path: str, line: str):
    """Append one line (a JSONL row) in one write. A failure (a full disk) is a SaveError; a line
    it cut short is dropped by the next reader (truncate_logs, evaluate.resume_transcripts)."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
    except OSError as e:
        raise SaveError(f"could not write {path}: {e.strerror or e}") from e


def _remove(path: str):
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def make_output_dir(flag: str, path: str):
    """Create `path` and check that a file can be written there: InputError otherwise."""
    try:
        os.makedirs(path, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


NO_LOCKING = {errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP}  # "no locking here"


def lock_output_dir(path: str):
    """One run per output directory: two runs would interleave their metrics and overwrite each
    other's checkpoints. An exclusive lock (flock) on `.lock` in the directory, held until the
    process exits (the kernel drops it on a crash or SIGKILL too, so nothing stale is left).
    Each process of a multi-process launch locks its own file (`.lock-RANK`), and all agree on
    the outcome (plumbing.distributed.claim_output_dir): a second launch stops on every process,
    even when only some of its ranks clash with the first run's. Returns the open file
    (keep it referenced); InputError naming the directory and the holder's pid if locked."""
    rank = os.environ.get("RANK", "0")
    f = open(os.path.join(path, ".lock" if rank == "0" else f".lock-{rank}"), "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        pid = f.read().strip() or "unknown"
        f.close()
        raise InputError(f"--output-dir {path}: in use by another run (pid {pid})") from None
    except OSError as e:
        if e.errno not in NO_LOCKING:
            raise
        # A file system without flock (Lustre mounted without it, some NFS): no lock here, but
        # no reason to stop every rank with a traceback either.
        log.warning("--output-dir %s: this file system has no file locks (%s): a second run in it would not be "
                    "refused", path, errno.errorcode.get(e.errno, e.errno))
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f
