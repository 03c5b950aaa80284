"""The smallest request the KV-cache managers accept (their KVRequest protocol), for tests without an engine."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
