"""Closed journal segments: compressed once closed, read back the same, pruned by a retention.

- **Compression.** A segment the writer closed (`journal.NNNN.jsonl`) is gzipped to
  `journal.NNNN.jsonl.gz` (written under a temporary name, synced, renamed, and only then is
  the plain one removed, so a crash leaves one complete copy at least; readers take the plain
  one where both exist). A segment of 4 GiB or more stays plain: gzip records the size of
  what it holds modulo 2**32, and readers need that size (`segment_size`).
- **Reading.** `open_segment` opens either kind as a binary stream of the plain lines (gzip
  streams seek forward by decompressing, which is all the readers do); `segment_size` is the
  plain size.
- **Retention.** `prune` deletes closed segments, oldest first, older than an age or while
  the closed segments hold more than a size; never the first (it holds the run's start) nor
  one that holds a finding (the verdict must not forget a leak), nor what the resume
  checkpoint does not cover yet (`harness.run.resume_state`). What is left is still one
  journal: the reports then cover the requests it holds.

It knows nothing about what the lines mean beyond how a finding's line starts.
"""

from __future__ import annotations

import gzip
import io
import os
import shutil
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from kvcanary.harness.record.line_encoding import RECORD_START

COMPRESSED_SUFFIX = ".gz"
GZIP_LEVEL = 6
"""zlib's default: ~3x on journal lines (the packed canaries are random), ~85 MB/s."""
_MAX_COMPRESSED = 1 << 32
_FINDING = RECORD_START + b'finding"'
_FILE_MODE = 0o600


def is_compressed(path: Path) -> bool:
    return path.name.endswith(COMPRESSED_SUFFIX)


def open_segment(path: Path) -> io.BufferedIOBase:
    """A segment's plain lines as a binary stream, compressed or not."""
    if is_compressed(path):
        return gzip.GzipFile(path, "rb")
    return path.open("rb")


def segment_size(path: Path) -> int:
    """The size of a segment's plain lines (a gzip file says it in its last four bytes)."""
    if not is_compressed(path):
        return path.stat().st_size
    with path.open("rb") as f:
        f.seek(-4, os.SEEK_END)
        size: int = struct.unpack("<I", f.read(4))[0]
    return size


def compress_segment(path: Path) -> Path:
    """Gzip a closed segment next to itself and remove the plain one; the path it now has.
    A segment too large for gzip's size field, or already compressed, is left as it is."""
    if is_compressed(path) or path.stat().st_size >= _MAX_COMPRESSED:
        return path
    target = path.with_name(path.name + COMPRESSED_SUFFIX)
    partial = path.with_name(path.name + COMPRESSED_SUFFIX + ".partial")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, _FILE_MODE)
    with os.fdopen(fd, "wb") as raw, path.open("rb") as source:
        with gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=GZIP_LEVEL, mtime=0) as out:
            shutil.copyfileobj(source, out, 1 << 20)
        raw.flush()
        os.fsync(raw.fileno())
    os.rename(partial, target)
    fsync_dir(path.parent)
    path.unlink()
    return target


def holds_a_finding(path: Path) -> bool:
    """Whether a segment holds a finding record (scanned a block at a time)."""
    tail = b""
    with open_segment(path) as f:
        while block := f.read(1 << 20):
            if _FINDING in tail + block:
                return True
            tail = block[-len(_FINDING) :]
    return False


def prune(
    closed: Iterable[tuple[int, Path]],
    *,
    max_age_s: float | None,
    max_bytes: int | None,
    keep: Callable[[int, Path], bool],
    now: float | None = None,
) -> list[Path]:
    """Delete closed segments (number, path), oldest first, that are older than `max_age_s`
    or while those left hold more than `max_bytes` on disk; never segment 1, the newest
    closed one, nor one `keep` says to keep (a finding in it, not yet checkpointed). The
    paths deleted."""
    segments = sorted(closed)
    now = time.time() if now is None else now
    on_disk = sum(path.stat().st_size for _, path in segments)
    deleted = []
    for number, path in segments[:-1]:
        size = path.stat().st_size
        too_old = max_age_s is not None and now - path.stat().st_mtime > max_age_s
        too_big = max_bytes is not None and on_disk > max_bytes
        if number == 1 or not (too_old or too_big) or keep(number, path):
            continue
        path.unlink()
        on_disk -= size
        deleted.append(path)
    if deleted:
        fsync_dir(deleted[0].parent)
    return deleted


def fsync_dir(directory: Path) -> None:
    """Make a rename or a deletion in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
