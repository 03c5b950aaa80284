"""A disk tier under the prefix cache: full blocks evicted from the RAM pool are kept in files keyed by their chained
hash, so a later request, or a restarted server, reads them back instead of recomputing the prefix.

A wrong block would be a wrong answer, so every file is checked before a byte of it is served: it carries the
engine's fingerprint (weights, dtypes, block size, layer shape), its own block hash, its payload length and a
CRC-32. A file is written under a temporary name, fsynced and then renamed, so a process killed mid-write leaves
only a temporary file (removed at the next start), never a torn block under a real name. Anything that fails a
check is a miss: the file is deleted and the fact logged. A disk that refuses a write (full, read-only) stops the
writing, never the serving. The engine only copies an evicted block and queues it; one thread does the writing,
so a step never waits on the disk.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.kv.hashing import BlockHash

logger = logging.getLogger("pagedllm")

MAGIC = b"PLKVBLK1"
HEADER = struct.Struct("<8s32s32sQI")  # magic, fingerprint, block hash, payload length, CRC-32 of the payload
SUFFIX = ".kv"
QUEUE_BYTES = 64 * 2**20  # evicted blocks waiting for the writer; past this they are dropped, not waited for


@dataclass
class DiskTierStats:
    blocks: int = 0  # block files the tier holds now
    bytes: int = 0  # their size on disk
    writes: int = 0  # blocks written (cumulative)
    loads: int = 0  # blocks served back to the RAM pool (cumulative)
    dropped: int = 0  # evicted blocks not written: the writer's queue was full
    evictions: int = 0  # files deleted to stay within the size
    bad_files: int = 0  # files that failed a check (torn, truncated, corrupted, another engine's) and were deleted
    write_errors: int = 0  # writes the disk refused; the first one stops the writing


class DiskKVTier:
    """Block files in `root/<fingerprint>/`, at most `max_bytes` of them, least recently used evicted first."""

    def __init__(self, root: str, max_bytes: int, fingerprint: bytes, payload_bytes: int) -> None:
        if len(fingerprint) != 32:
            raise ValueError("the fingerprint is a 32-byte digest")
        self.root, self.max_bytes = root, max_bytes
        self.fingerprint, self.payload_bytes = fingerprint, payload_bytes
        self.dir = os.path.join(root, fingerprint.hex()[:16])
        self.stats = DiskTierStats()
        self.writable = True
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file size, least recently used first
        self._pending: dict[BlockHash, bytes] = {}  # queued for the writer: still served from memory
        self._queue: queue.Queue[tuple[BlockHash, bytes] | None] = queue.Queue(max(2, QUEUE_BYTES // payload_bytes))
        self._logged: set[str] = set()
        self._open()
        self._thread = threading.Thread(target=self._writer, name="pagedllm-kv-offload", daemon=True)
        self._thread.start()
        atexit.register(self.flush)  # a clean exit writes what is queued

    def _open(self) -> None:
        """Reopen what an earlier engine left: our fingerprint's files, oldest first; torn writes are removed."""
        try:
            os.makedirs(self.dir, exist_ok=True)
            names = os.listdir(self.dir)
            others = [d for d in os.listdir(self.root) if d != os.path.basename(self.dir)]
        except OSError as e:
            self._stop_writing(f"cannot use {self.root} ({e})")
            return
        found = []
        for name in names:
            path = os.path.join(self.dir, name)
            try:
                if not name.endswith(SUFFIX):
                    os.unlink(path)  # a temporary file: a write that never finished
                    continue
                st = os.stat(path)
                found.append((st.st_mtime_ns, bytes.fromhex(name[:-len(SUFFIX)]), st.st_size))
            except (OSError, ValueError):
                continue
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.stats.bytes += size
        self.stats.blocks = len(self._index)
        self._evict_to(self.max_bytes)
        logger.info("KV disk tier %s: %d blocks (%.1f MiB) reopened, limit %.1f GiB%s", self.dir, self.stats.blocks,
                    self.stats.bytes / 2**20, self.max_bytes / 2**30,
                    f"; ignoring {len(others)} folder(s) of other models or settings" if others else "")

    def _path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.dir, block_hash.hex() + SUFFIX)

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message, *args)

    def contains(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._index or block_hash in self._pending

    @property
    def accepting(self) -> bool:
        """Whether a put now would be queued (writing goes on and the queue has room)."""
        return self.writable and not self._queue.full()

    def put(self, block_hash: BlockHash, read: Callable[[], bytes]) -> bool:
        """Queue a block for writing unless it is on disk (or queued) already; `read` copies its contents and is
        called only if it will be written. Never blocks: a full queue drops the block."""
        with self._lock:
            if not self.writable or block_hash in self._index or block_hash in self._pending:
                return False
            if self._queue.full():
                self.stats.dropped += 1
                return False
            data = read()
            self._pending[block_hash] = data
        self._queue.put_nowait((block_hash, data))
        return True

    def load(self, block_hash: BlockHash) -> bytes | None:
        """The block's checked payload, or None: not here, unreadable, or failed a check (then deleted)."""
        with self._lock:
            data = self._pending.get(block_hash)
            if data is None and block_hash not in self._index:
                return None
        if data is None:
            data = self._read(block_hash)
            if data is None:
                return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            self.stats.loads += 1
        return data

    def _read(self, block_hash: BlockHash) -> bytes | None:
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                raw = f.read(HEADER.size + self.payload_bytes + 1)
        except OSError as e:  # evicted meanwhile, or the disk went away: a miss
            self._forget(block_hash, None, f"cannot read {path}: {e}", logging.DEBUG)
            return None
        problem = self._check(raw, block_hash)
        if problem is not None:
            self.stats.bad_files += 1
            self._forget(block_hash, path, f"{path} {problem}: not served, deleted")
            return None
        try:
            os.utime(path)  # the recency a restart orders by
        except OSError:
            pass
        return raw[HEADER.size:]

    def _check(self, raw: bytes, block_hash: BlockHash) -> str | None:
        if len(raw) < HEADER.size:
            return "is shorter than its header (a torn or truncated write)"
        magic, fingerprint, stored_hash, length, crc = HEADER.unpack_from(raw)
        if magic != MAGIC:
            return "is not a pagedllm KV block"
        if fingerprint != self.fingerprint:
            return "was written by another model or with other settings"
        if stored_hash != block_hash:
            return "holds another block than its name says"
        if length != self.payload_bytes or len(raw) - HEADER.size != length:
            return f"has {len(raw) - HEADER.size} payload bytes, expected {self.payload_bytes} (truncated?)"
        if zlib.crc32(memoryview(raw)[HEADER.size:]) != crc:
            return "fails its checksum (corrupted)"
        return None

    def _forget(self, block_hash: BlockHash, path: str | None, message: str, level: int = logging.WARNING) -> None:
        logger.log(level, "KV disk tier: %s", message)
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.bytes -= size
                self.stats.blocks -= 1
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    # ---- the writer thread ---------------------------------------------------------------------------------
    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:  # noqa: BLE001 - a bug here must stop the writing, not leave flush() waiting
                self._stop_writing(f"the writer failed ({e!r})")
            finally:
                self._queue.task_done()

    def _write(self, block_hash: BlockHash, data: bytes) -> None:
        size = HEADER.size + len(data)
        try:
            if not self.writable:
                return
            if size > self.max_bytes:
                self._stop_writing(f"a block takes {size:,} bytes, more than --kv-offload-size {self.max_bytes:,}")
                return
            self._evict_to(self.max_bytes - size)
            path = self._path(block_hash)
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    f.write(HEADER.pack(MAGIC, self.fingerprint, block_hash, len(data), zlib.crc32(data)))
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except OSError as e:
                self.stats.write_errors += 1
                self._stop_writing(f"writing {path} failed ({e})")
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                return
            with self._lock:
                self._index[block_hash] = size
                self.stats.bytes += size
                self.stats.blocks += 1
                self.stats.writes += 1
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)

    def _evict_to(self, limit: int) -> None:
        victims = []
        with self._lock:
            while self._index and self.stats.bytes > limit:
                block_hash, size = self._index.popitem(last=False)
                self.stats.bytes -= size
                self.stats.blocks -= 1
                self.stats.evictions += 1
                victims.append(block_hash)
        for block_hash in victims:
            try:
                os.unlink(self._path(block_hash))
            except OSError:
                pass

    def _stop_writing(self, reason: str) -> None:
        self.writable = False
        self._log_once("stop", "KV disk tier: %s; no more blocks are written, serving goes on", reason)

    def flush(self) -> None:
        """Wait until every queued block is on disk (or refused): a block put before this call is acknowledged."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer."""
        self._queue.put(None)
        self._thread.join()
