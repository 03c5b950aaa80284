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
