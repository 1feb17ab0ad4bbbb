"""The optional on-disk spool: batches the collector could not take yet, kept in order.

Used only by the exporter thread (never by ``record()``). A spool is a directory of
segment files ``<n>.seg`` (older segments have smaller numbers), each a sequence of
records::

    magic b"KVS1" | meta_len u32 | body_len u32 | crc32(meta + body) u32   (big-endian)
    meta: JSON {"engine_id", "boot_id", "seq", "n_steps", "n_requests"}
    body: the batch exactly as it is POSTed (gzip JSON), so its idempotency key
          (engine_id, boot_id, seq) is unchanged when it is replayed

Appends go to the newest segment, a new one past ``segment_bytes``; past ``max_bytes``
the oldest segment is deleted whole and its unsent records returned to be counted as
dropped. Records are read back in write order; a segment is deleted once every record
in it was delivered or given up on. :meth:`Spool.append` hands the record to the OS at
once (a kill -9 loses nothing appended); :meth:`Spool.sync` fsyncs, once per cycle. A
torn record or a CRC mismatch is skipped with the rest of its segment and counted in
:attr:`Spool.corrupt_records`. One process owns a spool directory at a time (an
``flock`` on ``LOCK``); a second gets :class:`SpoolBusy`.

Guarantees and their tests: docs/reliability.md#the-engine-plugin
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import struct
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

MAGIC = b"KVS1"
HEADER = struct.Struct(">4sIII")
#: Largest meta / body accepted when reading (anything larger is corruption).
MAX_META_BYTES = 4096
MAX_BODY_BYTES = 256 * 1024 * 1024
SUFFIX = ".seg"


class SpoolBusy(RuntimeError):
    """Another live process owns this spool directory."""


@dataclass
class SpoolEntry:
    """One stored record: where it is and what it holds."""

    segment: int
    offset: int
    size: int
    """Bytes of the whole record, header included."""
    meta: dict[str, Any]


def encode_record(meta: dict[str, Any], body: bytes) -> bytes:
    """The bytes of one record."""
    m = json.dumps(meta, separators=(",", ":")).encode("utf-8")
    return HEADER.pack(MAGIC, len(m), len(body), zlib.crc32(body, zlib.crc32(m))) + m + body


def read_records(data: bytes) -> tuple[list[tuple[int, int, dict[str, Any], bytes]], bool]:
    """Parse a segment's bytes: ``[(offset, size, meta, body)]`` and whether it ended
    cleanly (False: a torn or corrupt record, and everything after it, was skipped)."""
    out: list[tuple[int, int, dict[str, Any], bytes]] = []
    pos, n = 0, len(data)
    while pos < n:
        if n - pos < HEADER.size:
            return out, False
        magic, meta_len, body_len, crc = HEADER.unpack_from(data, pos)
        end = pos + HEADER.size + meta_len + body_len
        if magic != MAGIC or meta_len > MAX_META_BYTES or body_len > MAX_BODY_BYTES or end > n:
            return out, False
        m = data[pos + HEADER.size : pos + HEADER.size + meta_len]
        body = data[pos + HEADER.size + meta_len : end]
        if zlib.crc32(body, zlib.crc32(m)) != crc:
            return out, False
        try:
            meta = json.loads(m)
        except ValueError:
            return out, False
        if not isinstance(meta, dict):
            return out, False
        out.append((pos, end - pos, meta, body))
        pos = end
    return out, True


class Spool:
    """An ordered, size-capped, crash-tolerant queue of batches on disk."""

    def __init__(
        self, directory: str | os.PathLike[str], max_bytes: int, segment_bytes: int | None = None
    ) -> None:
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes or min(max(max_bytes // 8, 4096), 16 << 20)
        self.corrupt_records = 0
        """Torn or corrupt records skipped (each counts once, with the rest of its segment)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock_fh: BinaryIO | None = open(self.directory / "LOCK", "ab")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_fh.close()
            self._lock_fh = None
            raise SpoolBusy(f"another process is using the spool {self.directory}") from None
        self._entries: deque[SpoolEntry] = deque()
        self._sizes: dict[int, int] = {}  # segment -> bytes on disk
        self._live: dict[int, int] = {}  # segment -> records not yet popped
        for seg in sorted(self._segments()):
            data = (self.directory / f"{seg}{SUFFIX}").read_bytes()
            records, clean = read_records(data)
            if not clean:
                self.corrupt_records += 1
            self._sizes[seg] = len(data)
            self._live[seg] = len(records)
            for offset, size, meta, _ in records:
                self._entries.append(SpoolEntry(seg, offset, size, meta))
            if not records:
                self._delete(seg)
        self._write_seg = max(self._sizes, default=0) + 1
        self._write_fh: BinaryIO | None = None
        self._dirty = False
        self._reader: tuple[int, BinaryIO] | None = None

    def _segments(self) -> list[int]:
        out = []
        for p in self.directory.iterdir():
            if p.suffix == SUFFIX and p.stem.isdigit():
                out.append(int(p.stem))
        return out

    # -- size --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        """Bytes of all segment files."""
        return sum(self._sizes.values())

    def entries(self) -> list[SpoolEntry]:
        """The stored records, oldest first (a copy)."""
        return list(self._entries)

    # -- writing -----------------------------------------------------------------------

    def append(self, meta: dict[str, Any], body: bytes) -> list[SpoolEntry]:
        """Append one record; return the records dropped to stay within ``max_bytes``."""
        record = encode_record(meta, body)
        if self._write_fh is None or self._sizes.get(self._write_seg, 0) >= self.segment_bytes:
            self._rotate()
        fh = self._write_fh
        assert fh is not None
        offset = self._sizes[self._write_seg]
        fh.write(record)
        fh.flush()  # to the OS now: a kill -9 loses nothing appended
        self._dirty = True
        self._sizes[self._write_seg] = offset + len(record)
        self._live[self._write_seg] += 1
        self._entries.append(SpoolEntry(self._write_seg, offset, len(record), meta))
        return self._enforce_cap()

    def _rotate(self) -> None:
        if self._write_fh is not None:
            self.sync()
            self._write_fh.close()
            self._write_seg += 1
        self._write_fh = open(self.directory / f"{self._write_seg}{SUFFIX}", "ab")  # noqa: SIM115
        self._sizes[self._write_seg] = self._write_fh.tell()
        self._live.setdefault(self._write_seg, 0)

    def _enforce_cap(self) -> list[SpoolEntry]:
        dropped: list[SpoolEntry] = []
        while self.size_bytes > self.max_bytes and len(self._sizes) > 1:
            oldest = min(self._sizes)
            while self._entries and self._entries[0].segment == oldest:
                dropped.append(self._entries.popleft())
            self._live[oldest] = 0
            self._delete(oldest)
        return dropped

    def sync(self) -> None:
        """``fsync`` the write segment if anything was appended since the last call."""
        if self._dirty and self._write_fh is not None:
            self._write_fh.flush()
            os.fsync(self._write_fh.fileno())
            self._dirty = False

    # -- reading -----------------------------------------------------------------------

    def peek(self) -> tuple[SpoolEntry, bytes] | None:
        """The oldest record and its body, or None when empty. A record that no longer
        reads back intact is skipped with the rest of its segment (and counted)."""
        while self._entries:
            entry = self._entries[0]
            data = self._read(entry)
            records, _ = read_records(data)
            if len(records) == 1 and records[0][1] == entry.size:
                return entry, records[0][3]
            self.corrupt_records += 1
            seg = entry.segment
            while self._entries and self._entries[0].segment == seg:
                self._entries.popleft()
            self._live[seg] = 0
            was_write = seg == self._write_seg
            self._delete(seg)
            if was_write:
                self._write_seg += 1
        return None

    def _read(self, entry: SpoolEntry) -> bytes:
        if self._reader is None or self._reader[0] != entry.segment:
            self._close_reader()
            try:
                reader: BinaryIO = open(self.directory / f"{entry.segment}{SUFFIX}", "rb")  # noqa: SIM115
            except FileNotFoundError:
                return b""
            self._reader = (entry.segment, reader)
        fh = self._reader[1]
        fh.seek(entry.offset)
        return fh.read(entry.size)

    def pop(self) -> SpoolEntry:
        """Remove the oldest record (delivered or given up on)."""
        entry = self._entries.popleft()
        seg = entry.segment
        self._live[seg] -= 1
        if self._live[seg] <= 0 and seg != self._write_seg:
            self._delete(seg)
        elif self._live[seg] <= 0 and not self._entries:
            # Everything delivered: start the next append in a fresh segment.
            self._close_writer()
            self._delete(seg)
            self._write_seg += 1
        return entry

    # -- files -------------------------------------------------------------------------

    def _delete(self, seg: int) -> None:
        if self._reader is not None and self._reader[0] == seg:
            self._close_reader()
        if seg == self._write_seg:
            self._close_writer()
        with contextlib.suppress(FileNotFoundError):
            (self.directory / f"{seg}{SUFFIX}").unlink()
        self._sizes.pop(seg, None)
        self._live.pop(seg, None)

    def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader[1].close()
            self._reader = None

    def _close_writer(self) -> None:
        if self._write_fh is not None:
            self.sync()
            self._write_fh.close()
            self._write_fh = None

    def close(self) -> None:
        """Sync and close the files and release the directory."""
        self._close_writer()
        self._close_reader()
        if self._lock_fh is not None:
            self._lock_fh.close()
            self._lock_fh = None
