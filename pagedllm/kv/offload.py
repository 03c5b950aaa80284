"""A disk tier under the prefix cache: full blocks evicted from the RAM pool are kept in files keyed by their chained
hash, so a later request, or a restarted server, reads them back instead of recomputing the prefix.

A wrong block would be a wrong answer, so every file is checked before a byte of it is served: it carries the
engine's fingerprint (weights, dtypes, block size, layer shape), its own block hash, its payload length and a
CRC-32. A file is written under a temporary name, fsynced and then renamed, so a process killed mid-write leaves
only a temporary file (removed at the next start), never a torn block under a real name. Anything that fails a
check is a miss: the file is deleted and the fact logged. A disk that refuses a write (full, read-only) stops the
writing, never the serving. The engine only copies an evicted block and queues it; one thread does the writing,
so a step never waits on the disk.

A hybrid model's recurrent-state checkpoints (kv/state_slots.py) are blocks of the pool under keys of their own,
so they come here as any evicted block.

The tier trusts the owner of its folder, nobody else: whoever can write in DIR can make it miss, never make it
touch a file outside DIR nor serve a wrong block. So DIR and its fingerprint folder must be real directories (a
symlinked one is refused), every name is resolved against a descriptor held on the fingerprint folder, nothing is
opened through a link (O_NOFOLLOW), files are created with O_EXCL under an unpredictable temporary name, and only
the tier's own names (`<hash>.kv` regular files, its temporary files) are ever deleted. Any other entry is left
alone and logged once; it never stops the writing of other blocks.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import queue
import re
import secrets
import stat
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
# (one item always fits)
_BLOCK_NAME = re.compile(r"[0-9a-f]{64}\.kv")
_TEMP_NAME = re.compile(r"[0-9a-f]{64}\.kv\.[0-9]+(\.[0-9a-f]{16})?\.tmp")  # also the older `<hash>.kv.<pid>.tmp`
# Errors that say the folder itself cannot take writes (full, read-only, not ours): the writing stops. Any other
# error is about one entry (a folder or a link under a block's name, ...): that block is skipped, writing goes on.
_FOLDER_ERRORS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO, errno.EFBIG})
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class DiskTierStats:
    blocks: int = 0  # block files the tier holds now
    bytes: int = 0  # their size on disk
    writes: int = 0  # blocks written (cumulative)
    loads: int = 0  # blocks served back to the RAM pool (cumulative)
    dropped: int = 0  # evicted blocks not written: the writer's queue was full
    evictions: int = 0  # files deleted to stay within the size
    bad_files: int = 0  # files that failed a check (torn, truncated, corrupted, another engine's) and were deleted
    write_errors: int = 0  # writes that failed: a full or read-only disk stops the writing, a bad entry its block
    skipped: int = 0  # entries that are not the tier's own files (a link, a folder, a stranger's): left alone


def open_folder(path: str, parent_fd: int | None = None) -> int:
    """A descriptor on the real directory `path` (made if missing, private), relative to `parent_fd` if given.
    O_NOFOLLOW refuses a symlink in its place; names resolved against the descriptor later cannot be sent
    elsewhere by a folder swapped for a link after this check."""
    try:
        os.mkdir(path, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW, dir_fd=parent_fd)


def write_new_file(dir_fd: int, name: str, chunks: tuple[bytes, ...]) -> OSError | None:
    """Write `name` in the folder `dir_fd` whole or not at all, never through a link: a fresh temporary file
    (O_EXCL, unpredictable name, so nothing planted can be written through), fsynced, renamed over `name`.
    The error, if any, is returned with the temporary file removed: nothing is left behind."""
    tmp = f"{name}.{os.getpid()}.{secrets.token_hex(8)}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as e:
        return e
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return None
    except OSError as e:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        return e


def read_regular_file(dir_fd: int, name: str, limit: int) -> bytes:
    """Up to `limit` bytes of the regular file `name` in `dir_fd`. A symlink is refused (O_NOFOLLOW), and so is a
    folder, a FIFO or a device (O_NONBLOCK: opening a FIFO never waits), and a file with another hard link (it
    may be a file outside the folder, linked in); raises OSError for all of them."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise OSError(errno.EINVAL, "not a regular file of one link", name)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        return f.read(limit)


class DiskKVTier:
    """Block files in `root/<fingerprint>/`, at most `max_bytes` of them, least recently used evicted first."""

    def __init__(self, root: str, max_bytes: int, fingerprint: bytes, payload_bytes: int) -> None:
        if len(fingerprint) != 32:
            raise ValueError("the fingerprint is a 32-byte digest")
        self.root, self.max_bytes = os.path.abspath(root), max_bytes
        self.fingerprint, self.payload_bytes = fingerprint, payload_bytes
        self.dir = os.path.join(self.root, fingerprint.hex()[:16])
        self.stats = DiskTierStats()
        self.writable = True
        self._fd: int | None = None  # the fingerprint folder; every name is resolved against it
        self._lock = threading.Lock()
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash -> file size, least recently used first
        self._pending: dict[BlockHash, bytes] = {}  # queued for the writer: served
        self._queued_bytes = 0  # payload bytes in the queue (bounded by QUEUE_BYTES)
        self._refused: set[BlockHash] = set()  # blocks whose name holds an entry that cannot be written over
        self._queue: queue.Queue[tuple[BlockHash, bytes] | None] = queue.Queue()
        self._logged: set[str] = set()
        self._open()
        self._thread = threading.Thread(target=self._writer, name="pagedllm-kv-offload", daemon=True)
        self._thread.start()
        atexit.register(self.flush)  # a clean exit writes what is queued

    def _open(self) -> None:
        """Reopen what an earlier engine left: our fingerprint's files, oldest first; torn writes are removed.
        DIR or the fingerprint folder being a link (or not a folder) refuses the tier: serving goes on without."""
        root_fd = None
        try:
            os.makedirs(os.path.dirname(self.root), exist_ok=True)
            root_fd = open_folder(self.root)
            self._fd = open_folder(os.path.basename(self.dir), root_fd)
            others = [d for d in os.listdir(root_fd) if d != os.path.basename(self.dir)]
            found = self._scan(self._fd)
        except OSError as e:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
            link = next((p for p in (self.root, self.dir) if os.path.islink(p)), None)
            why = f"{link} is a symlink; give the real folder" if link else str(e)
            self._stop_writing(f"cannot use {self.root} ({why})")
            return
        finally:
            if root_fd is not None:
                os.close(root_fd)
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.stats.bytes += size
        self.stats.blocks = len(self._index)
        self._evict_to(self.max_bytes)
        logger.info(
            "KV disk tier %s: %d blocks (%.1f MiB) reopened, limit %.1f GiB%s",
            self.dir,
            self.stats.blocks,
            self.stats.bytes / 2**20,
            self.max_bytes / 2**30,
            f"; ignoring {len(others)} folder(s) of other models or settings" if others else "",
        )

    def _scan(self, dir_fd: int) -> list[tuple[int, BlockHash, int]]:
        """(mtime, hash, size) of the regular files under a block's name. Our own temporary files (torn writes)
        are removed; any other entry (a link, a folder, a stranger's file) is left alone: it is not ours."""
        found, skipped = [], []
        with os.scandir(dir_fd) as entries:
            for entry in entries:
                try:
                    regular = entry.is_file(follow_symlinks=False)
                    if regular and _BLOCK_NAME.fullmatch(entry.name):
                        st = entry.stat(follow_symlinks=False)
                        found.append((st.st_mtime_ns, bytes.fromhex(entry.name[: -len(SUFFIX)]), st.st_size))
                    elif regular and _TEMP_NAME.fullmatch(entry.name):
                        os.unlink(entry.name, dir_fd=dir_fd)
                    else:
                        skipped.append(entry.name)
                except OSError:
                    skipped.append(entry.name)
        if skipped:
            self.stats.skipped += len(skipped)
            logger.warning(
                "KV disk tier %s: left alone %d entries that are not its block files (%s)",
                self.dir,
                len(skipped),
                ", ".join(sorted(skipped)[:3]) + (", ..." if len(skipped) > 3 else ""),
            )
        return found

    def _name(self, block_hash: BlockHash) -> str:
        return block_hash.hex() + SUFFIX

    def _path(self, block_hash: BlockHash) -> str:
        return os.path.join(self.dir, self._name(block_hash))

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
        return self.writable and self._queued_bytes < QUEUE_BYTES

    def _room_for(self, size: int) -> bool:
        return not self._queued_bytes or self._queued_bytes + size <= QUEUE_BYTES

    def put(self, block_hash: BlockHash, read: Callable[[], bytes]) -> bool:
        """Queue a block for writing unless it is on disk (or queued) already; `read` copies its contents and is
        called only if it will be written. Never blocks: a full queue drops it."""
        with self._lock:
            if not self.writable or block_hash in self._index or block_hash in self._pending:
                return False
            if block_hash in self._refused:
                return False
            if not self._room_for(self.payload_bytes):
                self.stats.dropped += 1
                return False
            data = read()
            self._pending[block_hash] = data
            self._queued_bytes += len(data)
        self._queue.put_nowait((block_hash, data))
        return True

    def load(self, block_hash: BlockHash) -> bytes | None:
        """The checked payload of the block, or None: not here, unreadable, or failed a check (then deleted)."""
        with self._lock:
            pending = self._pending.get(block_hash)
            if pending is None and block_hash not in self._index:
                return None
        if pending is not None:
            data: bytes | None = pending
        else:
            data = self._read(block_hash)
            if data is None:
                return None
        with self._lock:
            if block_hash in self._index:
                self._index.move_to_end(block_hash)
            self.stats.loads += 1
        return data

    def _read(self, block_hash: BlockHash) -> bytes | None:
        """The payload of the block's file if it passes every check. A file that fails one is deleted (it is a
        regular file under our name); a link or a folder put in its place is never followed, only forgotten."""
        path, fd = self._path(block_hash), self._fd
        try:
            if fd is None:
                raise OSError(errno.EBADF, "the tier is closed")
            raw = read_regular_file(fd, self._name(block_hash), HEADER.size + self.payload_bytes + 1)
        except OSError as e:  # evicted meanwhile, the disk went away, or not a regular file any more: a miss
            self._forget(block_hash, None, f"cannot read {path}: {e}", logging.DEBUG)
            return None
        problem = self._check(raw, block_hash)
        if problem is not None:
            self.stats.bad_files += 1
            self._forget(block_hash, self._name(block_hash), f"{path} {problem}: not served, deleted")
            return None
        try:
            os.utime(self._name(block_hash), dir_fd=fd, follow_symlinks=False)  # the recency a restart orders by
        except OSError:
            pass
        return raw[HEADER.size :]

    def _check(self, raw: bytes, block_hash: BlockHash) -> str | None:
        payload_bytes = self.payload_bytes
        if len(raw) < HEADER.size:
            return "is shorter than its header (a torn or truncated write)"
        magic, fingerprint, stored_hash, length, crc = HEADER.unpack_from(raw)
        if magic != MAGIC:
            return "is not a pagedllm KV block"
        if fingerprint != self.fingerprint:
            return "was written by another model or with other settings"
        if stored_hash != block_hash:
            return "holds another block than its name says"
        if length != payload_bytes or len(raw) - HEADER.size != length:
            return f"has {len(raw) - HEADER.size} payload bytes, expected {payload_bytes} (truncated?)"
        if zlib.crc32(memoryview(raw)[HEADER.size :]) != crc:
            return "fails its checksum (corrupted)"
        return None

    def _forget(self, block_hash: BlockHash, name: str | None, message: str, level: int = logging.WARNING) -> None:
        logger.log(level, "KV disk tier: %s", message)
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self.stats.bytes -= size
                self.stats.blocks -= 1
        if name is not None and self._fd is not None:
            try:
                os.unlink(name, dir_fd=self._fd)
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
            if not self.writable or self._fd is None:
                return
            if size > self.max_bytes:
                self._stop_writing(f"a block takes {size:,} bytes, more than --kv-offload-size {self.max_bytes:,}")
                return
            self._evict_to(self.max_bytes - size)
            header = HEADER.pack(MAGIC, self.fingerprint, block_hash, len(data), zlib.crc32(data))
            error = write_new_file(self._fd, self._name(block_hash), (header, data))
            if error is not None:
                self._write_failed(block_hash, error)
                return
            with self._lock:
                self._index[block_hash] = size
                self.stats.bytes += size
                self.stats.blocks += 1
                self.stats.writes += 1
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)
                self._queued_bytes -= len(data)

    def _write_failed(self, block_hash: BlockHash, error: OSError) -> None:
        """A full, read-only or vanished folder stops the writing; anything else is about this block's name (a
        folder or a stranger's entry in its place): that block alone is skipped, logged once."""
        self.stats.write_errors += 1
        if error.errno in _FOLDER_ERRORS or (error.errno == errno.ENOENT and self._folder_gone()):
            self._stop_writing(f"writing {self._path(block_hash)} failed ({error})")
            return
        with self._lock:
            self._refused.add(block_hash)
        self.stats.skipped += 1
        self._log_once(
            f"skip {block_hash.hex()}",
            "KV disk tier: cannot write %s (%s); that block is skipped, writing goes on",
            self._path(block_hash),
            error,
        )

    def _folder_gone(self) -> bool:
        """Whether the fingerprint folder was removed under us (a removed folder has no links left)."""
        try:
            return self._fd is None or os.fstat(self._fd).st_nlink == 0
        except OSError:
            return True

    def _evict_to(self, limit: int) -> None:
        victims = []
        with self._lock:
            while self._index and self.stats.bytes > limit:
                block_hash, size = self._index.popitem(last=False)
                self.stats.bytes -= size
                self.stats.blocks -= 1
                self.stats.evictions += 1
                victims.append(block_hash)
        fd = self._fd
        for block_hash in victims if fd is not None else ():  # never a name resolved against the working folder
            try:
                os.unlink(self._name(block_hash), dir_fd=fd)
            except OSError:
                pass

    def _stop_writing(self, reason: str) -> None:
        self.writable = False
        self._log_once("stop", "KV disk tier: %s; no more blocks are written, serving goes on", reason)

    def flush(self) -> None:
        """Wait until every queued block is on disk (or refused): a block put before this call is acknowledged."""
        self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer and let go of the folder."""
        self._queue.put(None)
        self._thread.join()
        self.writable = False
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
