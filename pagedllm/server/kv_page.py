"""The KV cache, live in a browser: GET /kv (the page) and GET /v1/kv/blocks (its data), as an APIRouter.

The data route asks the engine thread for a snapshot between two steps (`AsyncLLMEngine.run_on_engine`), lays it out
with pagedllm.engine.block_map and answers it through `KVBlocksResponse`, the model /openapi.json declares; nothing runs
while no page polls, so an unwatched server pays nothing. The data routes live under /v1/, so `--api-key` guards them
like every other /v1 route. The page itself (HTML, JS, CSS, shipped as package data: no CDN, no build step) holds no
data and is served without the key; it reads the key from the address's fragment (`/kv#key=...`, which browsers never
send to a server) or asks for it.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from pagedllm.engine.block_map import BlockMap, block_map
from pagedllm.engine.kv_snapshot import BlockTokens, block_detail, take_snapshot
from pagedllm.server.errors import ERROR_RESPONSES, APIError
from pagedllm.server.protocol_info import RecurrentState

router = APIRouter()
ENGINE_WAIT_S = 30.0  # how long a read waits for the engine thread to get between two steps, then a 503

BlockState = Literal["free", "cached", "used", "shared", "tail", "reserved", "checkpoint"]


class KVCounters(BaseModel):
    num_running: int
    num_waiting: int
    num_free_blocks: int = Field(description="free blocks, evictable ones included")
    num_evictable_blocks: int = Field(description="free blocks that still cache a prefix")
    num_used_blocks: int
    num_shared_blocks: int = Field(description="blocks held by more than one request")
    kv_usage: float = Field(description="share of blocks held by requests, 0..1")
    prefix_cache_queries: int = Field(description="prompt tokens looked up in the prefix cache (cumulative)")
    prefix_cache_hits: int = Field(description="prompt tokens found there (cumulative)")
    prefix_cache_hit_rate: float
    num_preemptions: int
    prompt_tokens: int = Field(description="prompt tokens computed (cumulative); the page derives tokens/s")
    generation_tokens: int = Field(description="tokens generated (cumulative)")
    slots_allocated: int = Field(description="token slots in held blocks")
    tokens_stored: int = Field(description="tokens those slots hold (a shared block counts once)")
    empty_slots: int = Field(description="slots_allocated - tokens_stored: tails, and contiguous reservations")
    num_checkpoint_blocks: int = Field(
        description="blocks holding a hybrid model's recurrent-state checkpoint (free ones are evictable)"
    )


class KVMap(BaseModel):
    blocks_per_cell: int = Field(description="1 while the pool fits in max_cells; else each cell is a run")
    columns: int = Field(description="cells per row of the drawing")
    states: list[BlockState] = Field(description="the state names that `state` and `counts` index")
    colors: dict[str, str]
    labels: dict[str, str]
    state: list[int] = Field(description="per cell (blocks in id order): its block's state, or a run's most common one")
    ref: list[int] = Field(description="per cell: its block's ref count (a run's highest)")
    fill: list[int] = Field(description="per cell: token slots that hold a token")
    counts: list[list[int]] | None = Field(
        description="per cell of a run, its blocks of each state; null when each cell is one block"
    )


class KVBlockInfo(BaseModel):
    block_id: int
    state: BlockState
    ref_cnt: int
    hash: str | None = Field(description="first 16 hex digits of the prefix-cache key; null if not registered")
    evict_rank: int | None = Field(description="0: evicted next; null unless free and caching a prefix")
    tokens: int = Field(description="slots that hold a token")
    holders: list[int] = Field(description="indexes into requests")


class KVRequestInfo(BaseModel):
    request_id: str
    status: Literal["running", "waiting", "preempted"]
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = Field(description="prompt tokens served by the prefix cache at first admission")
    prefix_hit_blocks: int = Field(
        description="leading blocks of the table that came from the prefix cache (not "
        "the pool's cached_blocks: free blocks that still hold a prefix)"
    )
    kv_tokens: int = Field(description="tokens it has KV slots for")
    num_preemptions: int
    block_ids: list[int] = Field(description="its block table, without the skipped entries")
    skipped_blocks: int = Field(
        description="leading table entries given back to the pool: out of every layer's sliding window"
    )
    row: list[tuple[BlockState, int, int]] = Field(
        description="the table as runs of equal (state, ref count): [state, ref_cnt, blocks], in table order"
    )
    slots: int
    empty_slots: int = Field(description="its slots without a token: the tail's, or a contiguous reservation's")


class KVGroupInfo(BaseModel):
    window: int | None = Field(description="tokens a query of these layers sees, itself included; null: all")
    layers: list[int]
    frees_blocks: bool = Field(description="whether the pool gives back blocks out of the window before the end")
    blocks: int = Field(0, description="blocks the running requests hold in this group (its own block tables)")


class KVBlocksResponse(BaseModel):
    object: Literal["kv.blocks"]
    time: float = Field(description="wall-clock seconds when the snapshot was taken")
    step: int
    allocation: Literal["paged", "contiguous"]
    block_size: int
    num_blocks: int
    prefix_caching: bool
    kv_cache_dtype: str = Field(
        description="what the cache stores a value as: float32, bfloat16, int8, "
        "float8_e4m3fn or float8_e5m2 (--kv-cache-dtype)"
    )
    kv_groups: list[KVGroupInfo] = Field(description="the KV-cache groups: layers that attend alike")
    recurrent_state: RecurrentState | None = Field(
        None, description="a hybrid model's state slots and checkpoints (as /v1/kv's); null: no linear layers"
    )
    counters: KVCounters
    map: KVMap
    blocks: list[KVBlockInfo] | None = Field(
        description="with ?detail=blocks, every block that is not plain free; else null"
    )
    requests: list[KVRequestInfo] = Field(description="running requests, then the head of the waiting queue")
    requests_omitted: int = Field(description="waiting requests past the listed head")


class KVBlockDetail(BaseModel):
    block_id: int
    ref_cnt: int
    hash: str | None = Field(description="the full prefix-cache key, hex")
    evict_rank: int | None
    holders: list[str] = Field(description="request ids whose block table holds it")
    token_ids: list[int] = Field(description="empty if unknown (cached and freed before any page watched)")
    text: str


def kv_blocks_json(layout: BlockMap) -> str:
    """The engine's block map as the route's answer: checked against `KVBlocksResponse`, then its JSON."""
    body = KVBlocksResponse.model_validate({"object": "kv.blocks", **vars(layout)}, from_attributes=True)
    return body.model_dump_json()


def _int_param(name: str, text: str | None, default: int, low: int, high: int) -> int:
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise APIError(f"{name}: {text!r} is not a whole number", 400, param=name) from None
    if not low <= value <= high:
        raise APIError(f"{name}: must be in {low}..{high}, got {value}", 400, param=name)
    return value


def _block_tokens(request: Request) -> BlockTokens:
    """The app's memory of cached blocks' tokens; only the engine thread reads or writes it."""
    state = request.app.state
    if getattr(state, "kv_block_tokens", None) is None:
        state.kv_block_tokens = BlockTokens()
    return state.kv_block_tokens


@router.get(
    "/v1/kv/blocks",
    response_model=KVBlocksResponse,
    tags=["kv"],
    responses={c: ERROR_RESPONSES[c] for c in (400, 401, 503)},
    summary="The KV block pool, block tables and queues, from one snapshot between engine steps",
)
async def kv_blocks(
    request: Request,
    max_cells: Annotated[str | None, Query(description="most cells in the map (1..1000000, default 8192)")] = None,
    max_waiting: Annotated[str | None, Query(description="waiting requests listed (0..10000, default 64)")] = None,
    detail: Annotated[str | None, Query(description="'blocks': add a record per block that is not plain free")] = None,
) -> Response:
    cells = _int_param("max_cells", max_cells, 8192, 1, 1_000_000)
    waiting = _int_param("max_waiting", max_waiting, 64, 0, 10_000)
    if detail not in (None, "blocks"):
        raise APIError(f"detail: the only detail is 'blocks', got {detail!r}", 400, param="detail")
    memo = _block_tokens(request)
    snap = await request.app.state.engine.run_on_engine(
        lambda e: take_snapshot(e, waiting, memo, evict_order=detail is not None),  # the LRU walk only if shown
        timeout=ENGINE_WAIT_S,
    )
    return Response(kv_blocks_json(block_map(snap, cells, detail=detail is not None)), media_type="application/json")


@router.get(
    "/v1/kv/blocks/{block_id}",
    response_model=KVBlockDetail,
    tags=["kv"],
    responses={c: ERROR_RESPONSES[c] for c in (400, 401, 404, 503)},
    summary="One block: ref count, full hash, holders and the tokens it holds, decoded",
)
async def kv_block(request: Request, block_id: str) -> Response:
    engine = request.app.state.engine
    bid = _int_param("block_id", block_id, 0, 0, 2**62)
    total = engine.stats().num_blocks
    if bid >= total:
        raise APIError(f"block_id: {bid} is not a block of this pool (0..{total - 1})", 404, param="block_id")
    memo = _block_tokens(request)
    d = await engine.run_on_engine(lambda e: block_detail(e, bid, memo), timeout=ENGINE_WAIT_S)
    return JSONResponse(
        KVBlockDetail(
            block_id=d.block_id,
            ref_cnt=d.ref_cnt,
            hash=d.block_hash,
            evict_rank=d.evict_rank,
            holders=d.holders,
            token_ids=d.token_ids,
            text=d.text,
        ).model_dump(mode="json")
    )


_STATIC = {
    "": ("kv.html", "text/html; charset=utf-8"),
    "kv.js": ("kv.js", "text/javascript; charset=utf-8"),
    "kv.css": ("kv.css", "text/css; charset=utf-8"),
}


@router.get("/kv", include_in_schema=False)
@router.get("/kv/{name}", include_in_schema=False)
async def kv_page(name: str = "") -> Response:
    if name not in _STATIC:
        raise APIError(f"/kv/{name}: no such file (the page is at /kv)", 404)
    file, media = _STATIC[name]
    body = resources.files("pagedllm.server").joinpath("static", file).read_bytes()
    return Response(body, media_type=media, headers={"Cache-Control": "no-cache"})
