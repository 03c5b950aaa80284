"""Recurrent-state slots: the fixed-size state a hybrid model's linear-attention layers keep per request (Gated
DeltaNet's conv and recurrent states, layers/deltanet.py), one slot per running request (vLLM v1's MambaManager
gives a request one state page the same way).

Why slots and not blocks: a request's state does not grow with its tokens, so it needs one place from admission to
the end, not a table. The engine reserves `max_num_seqs` slots' bytes out of the KV budget before it sizes the
block pool (a request can never wait for a slot: the scheduler admits at most max_num_seqs), and the KV manager
hands a slot out at a request's first allocation and takes it back when the request is freed (finished, aborted,
preempted: a preempted request is recomputed from position 0, from a zero state). What a slot holds changes only
when a step commits (RecurrentStep.commit), so a failed step leaves every slot as it was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pagedllm.kv.hashing import BlockHash


class StateSlotPool:
    def __init__(self, num_slots: int, bytes_per_slot: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"a hybrid model needs at least one state slot, got {num_slots}")
        self.num_slots, self.bytes_per_slot = num_slots, bytes_per_slot
        self._free: deque[int] = deque(range(num_slots))
        self.req_to_slot: dict[str, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_take(self, request_id: str) -> bool:
        """The request holds a slot already, or one is free."""
        return request_id in self.req_to_slot or bool(self._free)

    def take(self, request_id: str) -> int:
        """The request's slot, handed out on its first call."""
        slot = self.req_to_slot.get(request_id)
        if slot is None:
            slot = self.req_to_slot[request_id] = self._free.popleft()
        return slot

    def free(self, request_id: str) -> None:
        slot = self.req_to_slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)


class StateCheckpoints:
    """Prefix caching for a hybrid model: copies of a request's recurrent state at block boundaries of its prompt,
    each under the chained hash of the blocks before it (the key of the last full block, as the KV blocks are
    keyed), in rows of their own after the running slots (`first_row`). A prefix hit is then the longest run of
    cached KV blocks that ends where a checkpoint lies: the request starts from a copy of that state. An entry is
    held (ref-counted) from the hit's allocation until the copy is made; unheld entries are evicted least
    recently used first when a new checkpoint needs a row.

    Where the states come from is `mode` (vLLM's --mamba-cache-mode). "align": the scheduler cuts a hybrid
    request's prompt chunks at block boundaries (and at the prompt's last one, and where its run of cached KV
    blocks ends without a checkpoint: a shared prefix another request computed), and a chunk's state at its end is
    kept; the first prompt of a shared prefix leaves no state at the prefix's end, so the second misses its hit.
    "all": the mixers also emit the state at every block boundary inside a prompt chunk (`reserve`: a row the
    step writes when it commits, RecurrentStep.marks), so the first prompt already leaves one at every boundary,
    at the cost of a row per block boundary of every prompt (docs/benchmarks.md says what a row costs).

    An entry evicted to make room is handed to `on_evict` (key, row) before its row is reused: the disk tier
    (connector.py) keeps it, as the block pool hands it an evicted block."""

    def __init__(self, first_row: int, num_rows: int, block_size: int, mode: str = "align") -> None:
        if mode not in ("align", "all"):
            raise ValueError(f"state checkpoints are taken in mode align or all, not {mode!r}")
        self.block_size, self.num_rows, self.mode = block_size, num_rows, mode
        self._free: deque[int] = deque(range(first_row, first_row + num_rows))
        self.rows: dict[BlockHash, int] = {}  # key -> row, in least-recently-used order (oldest first)
        self.refs: dict[BlockHash, int] = {}  # keys held by a hit not yet copied
        self.restores: dict[str, tuple[BlockHash, int]] = {}  # request id -> (key, row) to copy before its step
        # request id -> the end of its run of cached KV blocks where no checkpoint lies: its chunk is cut there, so
        # the next prompt sharing that prefix hits it
        self.wanted: dict[str, int] = {}
        self.on_evict: Callable[[BlockHash, int], None] | None = None
        self.unwritten: set[BlockHash] = set()  # reserved this step, written when it commits: never evicted

    def find(self, key: BlockHash) -> int | None:
        return self.rows.get(key)

    def hold(self, request_id: str, key: BlockHash) -> None:
        """The request's hit starts from `key`'s state: keep it until `take_restore` (or the request's free)."""
        self.release(request_id)
        self.restores[request_id] = (key, self.rows[key])
        self.refs[key] = self.refs.get(key, 0) + 1
        self.rows[key] = self.rows.pop(key)  # most recently used

    def take_restore(self, request_id: str) -> int | None:
        """The row to copy into the request's slot before its first step (once), letting go of its hold."""
        held = self.restores.get(request_id)
        if held is None:
            return None
        self.release(request_id)
        return held[1]

    def release(self, request_id: str) -> None:
        held = self.restores.pop(request_id, None)
        if held is not None:
            key = held[0]
            self.refs[key] -= 1
            if not self.refs[key]:
                del self.refs[key]

    def forget(self, request_id: str) -> None:
        """The request is freed: its hold and its wanted cut go."""
        self.release(request_id)
        self.wanted.pop(request_id, None)

    def store(self, key: BlockHash) -> int | None:
        """A row for the state under `key` (None: it is cached already, or every row is held): a free one, or the
        least recently used unheld entry's."""
        if key in self.rows:
            self.rows[key] = self.rows.pop(key)
            return None
        if not self._free:
            victim = next((k for k in self.rows if k not in self.refs and k not in self.unwritten), None)
            if victim is None:
                return None
            if self.on_evict is not None:
                self.on_evict(victim, self.rows[victim])
            self._free.append(self.rows.pop(victim))
        row = self.rows[key] = self._free.popleft()
        return row

    def reserve(self, key: BlockHash) -> int | None:
        """A row for the state under `key` that the step about to run writes (a block boundary inside a prompt
        chunk, mode "all"): as `store`, and kept from eviction until `written` (the step committed) or
        `drop_unwritten` (it failed: the row never got its state)."""
        row = self.store(key)
        if row is not None:
            self.unwritten.add(key)
        return row

    def written(self) -> None:
        self.unwritten.clear()

    def drop_unwritten(self) -> None:
        for key in self.unwritten:
            self.drop(key)
        self.unwritten.clear()

    def drop(self, key: BlockHash) -> None:
        """Forget an unheld entry whose row could not be filled (a state read back from a tier that did not fit)."""
        if key in self.rows and key not in self.refs:
            self._free.append(self.rows.pop(key))

    @property
    def num_free(self) -> int:
        """Rows that hold no checkpoint."""
        return len(self._free)

    def clear(self) -> None:
        """Forget every checkpoint that no hit holds (reset_prefix_cache)."""
        for key in [k for k in self.rows if k not in self.refs]:
            self._free.append(self.rows.pop(key))
