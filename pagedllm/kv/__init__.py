"""KV-cache blocks: the pool, the managers (paged and contiguous) and the sizing arithmetic. These names are the
package's public surface (what bench/ and rag/ may use: counting prefix hits and sizing without an engine)."""

from pagedllm.kv.manager import ContiguousKVCacheManager, PagedKVCacheManager, TokenRequest, cdiv
from pagedllm.kv.sizing import KV_DTYPE_ROWS, kv_bytes_per_token, kv_dtype_bytes_per_token

__all__ = [
    "ContiguousKVCacheManager",
    "PagedKVCacheManager",
    "TokenRequest",
    "cdiv",
    "KV_DTYPE_ROWS",
    "kv_bytes_per_token",
    "kv_dtype_bytes_per_token",
]
