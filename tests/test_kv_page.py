"""The /kv page in a real browser: headless Chromium (Debian's `chromium` + `chromium-driver`) driven by Selenium.

A server with an API key runs two groups of requests, each group sharing its own prompt prefix (three requests,
then two). The page must show each group's shared blocks as shared with the group's size as ref count, a hover
over a shared block must name its holders and decode its tokens, and once the requests end the map must be back
to free (plain or still caching a prefix), checked on the canvas' pixels. The screenshot taken while the blocks
are shared is kept under out/kv-page/ (docs/img/kv_page.png is a copy of one); an earlier request's blocks, still
cached in the free queue, are on it too.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from engine_helpers import kv_budget
from server_helpers import StepHold

from devkit.kv_pool import busy_engine
from pagedllm.server.kv_page import KVBlockDetail, KVBlocksResponse

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "sk-kv-page"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHOTS = Path(__file__).resolve().parent.parent / "out" / "kv-page"
PREFIX_A = (
    "The library gives every visitor a locker. A whole locker for a small bag wastes the wall, so the "
    "librarian hands out small shelves one at a time, and two visitors with the same books share a shelf. "
    "Nobody knows in advance how much a visitor will bring, so the shelves are handed out as the bags "
    "grow, and a shelf that is half full is the only waste. "
)
PREFIX_B = (
    "Paged attention splits the key-value cache into blocks of sixteen tokens. A request takes a new block "
    "only when its last one is full, so the only empty slots are in its last block. Requests that begin "
    "with the same words point at the same blocks, counted by a reference count. "
)
GROUPS = {"A": (PREFIX_A, 3), "B": (PREFIX_B, 2)}
EARLIER = "An earlier question, answered and gone: its full blocks stay cached in the free queue until evicted. "


@pytest.fixture(scope="module")
def server(model_fp32):
    from pagedllm.engine import EngineConfig, LLMEngine
    from pagedllm.engine.async_engine import AsyncLLMEngine
    from pagedllm.server.api_server import Server, build_app
    from pagedllm.server.config import ServerConfig

    cfg = EngineConfig(max_model_len=512, kv_cache_memory=kv_budget(128), log_stats_interval=0)
    engine = AsyncLLMEngine(LLMEngine(cfg, model_fp32))
    srv = Server(build_app(engine, ServerConfig(api_key=KEY)), host="127.0.0.1", port=0, log_level="warning")
    srv.start_in_thread()
    base = f"http://127.0.0.1:{srv.uvicorn.servers[0].sockets[0].getsockname()[1]}"
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            yield base, http, engine
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def browser():
    """Chromium from the system; missing, the test fails and says how to get it (no silent skip)."""
    from devkit.browser import BrowserMissing, chromium_driver

    try:
        driver = chromium_driver()
    except BrowserMissing as e:
        pytest.fail(str(e))
    try:
        yield driver
    finally:
        driver.quit()


def test_route_schema_auth_and_errors(server):
    base, http, _ = server
    assert http.get("/v1/kv/blocks").status_code == 401  # the data needs the key ...
    page = http.get("/kv")  # ... the page (no data in it) does not
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert http.get("/kv/kv.js").headers["content-type"].startswith("text/javascript")
    assert "https://" not in page.text + http.get("/kv/kv.js").text  # nothing from a CDN
    body = http.get("/v1/kv/blocks", headers=AUTH).json()
    state = KVBlocksResponse.model_validate(body)
    assert state.num_blocks == 128 and state.counters.num_free_blocks == 128 and len(state.map.state) == 128
    assert state.blocks is None and state.map.counts is None  # per-block records only on request:
    detailed = KVBlocksResponse.model_validate(http.get("/v1/kv/blocks?detail=blocks", headers=AUTH).json())
    assert detailed.blocks == []  # nothing but plain free blocks yet
    schema = http.get("/openapi.json").json()
    ref = schema["paths"]["/v1/kv/blocks"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert ref["$ref"].endswith("/KVBlocksResponse") and "KVBlockInfo" in schema["components"]["schemas"]
    for path, param, status in [
        ("/v1/kv/blocks?max_cells=0", "max_cells", 400),
        ("/v1/kv/blocks?max_waiting=x", "max_waiting", 400),
        ("/v1/kv/blocks?detail=all", "detail", 400),
        ("/v1/kv/blocks/128", "block_id", 404),
        ("/v1/kv/blocks/-1", "block_id", 400),
    ]:
        r = http.get(path, headers=AUTH)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    KVBlockDetail.model_validate(http.get("/v1/kv/blocks/0", headers=AUTH).json())


def send_groups(base: str, max_tokens: int) -> list[threading.Thread]:
    def one(group: str, i: int) -> None:
        prefix, _ = GROUPS[group]
        body = {
            "prompt": prefix + f"Question {i}: " + "why? " * (i + 1),
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        r = httpx.post(
            f"{base}/v1/completions", json=body, timeout=240, headers={**AUTH, "X-Request-Id": f"group{group}-{i}"}
        )
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one, args=(g, i)) for g, (_, n) in GROUPS.items() for i in range(n)]
    for t in threads:
        t.start()
    return threads


ROWS_JS = """return [...document.querySelectorAll('#requests tbody tr')].map(tr => ({
  id: tr.dataset.request, status: tr.dataset.status, empty: tr.children[7].textContent,
  cells: [...tr.querySelectorAll('.cell')].map(c => ({cls: c.className, text: c.textContent,
                                                      block: +c.dataset.block}))}));"""


def text_of(driver, element_id: str) -> str:
    """An element's rendered text, looked up and read in one script: the page rebuilds its parts on every
    update, so an element found by one WebDriver call can be gone (stale) by the next."""
    return driver.execute_script(
        "const e = document.getElementById(arguments[0]); return e ? e.innerText : '';", element_id
    )


def wait_for(what: str, check, timeout: float = 90.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"the page never showed {what}")
        time.sleep(0.1)


def all_groups_shared(driver):
    """The DOM rows, once every request runs and each group's shared blocks show the group's size."""
    rows = driver.execute_script(ROWS_JS)
    running = [r for r in rows if r["status"] == "running"]
    if len(running) < sum(n for _, n in GROUPS.values()):
        return None
    for r in running:
        shared = [c for c in r["cells"] if "shared" in c["cls"]]
        if len(shared) < 2 or any(c["text"] != str(GROUPS[r["id"].split("-")[1][-1]][1]) for c in shared):
            return None
    return running


def test_page_shows_sharing_and_returns_to_free(server, browser, capsys):
    """The page shows the five requests running with their shared prefix blocks, then the pool free again.
    The engine's steps wait until all five have arrived, run until each has made a token and then wait while
    the page is read: the requests are running when the page looks, on any CPU (held, not outrun)."""
    base, http, engine = server
    browser.get(f"{base}/kv#key={KEY}")
    wait_for("its first update", lambda: "live" in text_of(browser, "status"))
    r = http.post("/v1/completions", headers=AUTH, json={"prompt": EARLIER * 2, "max_tokens": 1})
    assert r.status_code == 200, r.text
    n = sum(n for _, n in GROUPS.values())
    with StepHold(engine) as hold:
        core = hold.core
        hold.run_while = lambda: len(core.parents) == n and len(hold.started) < n
        threads = send_groups(base, max_tokens=120)
        rows = wait_for("the two groups' shared blocks", lambda: all_groups_shared(browser))
        page_while_held(browser, rows, capsys)
    for t in threads:
        t.join()
    wait_for(
        "an empty request table",
        lambda: browser.execute_script(ROWS_JS) == [] and text_of(browser, "c-used") == "0",
    )
    check_map_pixels_are_free(browser, http)
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def page_while_held(browser, rows, capsys) -> None:
    """What the page shows of the five running requests: tails, prefix hits, a shared block's detail."""
    for r in rows:  # a partly filled last block shows its empty slots, as the table's "empty" column
        tail = r["cells"][-1]
        assert ("tail" in tail["cls"] and tail["text"] == r["empty"]) or r["empty"] == "0"
    for group, (_, n) in GROUPS.items():  # all but (at most) the first of a group got the prefix from the cache
        assert sum("hit" in r["cells"][0]["cls"] for r in rows if f"group{group}-" in r["id"]) >= n - 1
    check_hover_on_shared_block(browser, rows)
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / "kv_page.png"
    browser.save_screenshot(str(shot))
    with capsys.disabled():
        print(f"\nkv page screenshot (shared prefixes, partly filled tails, a shared block's detail): {shot}")


def check_hover_on_shared_block(driver, rows) -> None:
    """Click (pin) the map cell of group A's first block: its detail names the three holders and its text."""
    from selenium.webdriver.common.action_chains import ActionChains

    group_a = sorted(r["id"] for r in rows if "groupA-" in r["id"])
    block = next(r for r in rows if "groupA-" in r["id"])["cells"][0]["block"]
    canvas = driver.find_element("id", "map")
    px, cols = int(canvas.get_attribute("data-cell-px")), int(canvas.get_attribute("data-columns"))
    x, y = (block % cols + 0.5) * px, (block // cols + 0.5) * px
    ActionChains(driver).move_to_element_with_offset(
        canvas, round(x - canvas.size["width"] / 2), round(y - canvas.size["height"] / 2)
    ).click().perform()
    text = wait_for(
        "the block's decoded text",
        lambda: driver.execute_script("const e = document.getElementById('d-text'); return e && e.textContent;"),
    )
    assert text_of(driver, "d-ref") == "3"
    assert sorted(text_of(driver, "d-holders").split(", ")) == group_a
    assert PREFIX_A.startswith(text) and len(text) > 10  # its first 16 tokens, decoded


def check_map_pixels_are_free(driver, http) -> None:
    """Every cell of the canvas is painted free, or free-but-caching where the pool still caches a prefix."""
    state = http.get("/v1/kv/blocks", headers=AUTH).json()
    colors = {k: tuple(int(v[i : i + 2], 16) for i in (1, 3, 5)) for k, v in state["map"]["colors"].items()}
    cached = {b for b, s in enumerate(state["map"]["state"]) if state["map"]["states"][s] == "cached"}
    assert cached and state["counters"]["num_used_blocks"] == 0
    pixels = driver.execute_script(
        """
      const c = document.getElementById('map'), px = +c.dataset.cellPx, cols = +c.dataset.columns;
      const ctx = c.getContext('2d'), dpr = window.devicePixelRatio || 1, out = [];
      for (let i = 0; i < arguments[0]; i++) {
        const x = ((i % cols) + 0.3) * px * dpr, y = (Math.floor(i / cols) + 0.3) * px * dpr;
        out.push([...ctx.getImageData(Math.floor(x), Math.floor(y), 1, 1).data.slice(0, 3)]);
      }
      return out;""",
        state["num_blocks"],
    )
    expected = [list(colors["cached" if b in cached else "free"]) for b in range(state["num_blocks"])]
    assert pixels == expected


def test_aggregated_cells_in_the_page(server, browser):
    """/kv?max_cells=32 draws the 128-block pool as 32 cells of 4 blocks, each a stack of its states."""
    base, http, _ = server
    browser.get(f"{base}/kv?max_cells=32#key={KEY}")
    canvas = wait_for(
        "an aggregated map",
        lambda: (c := browser.find_element("id", "map")).get_attribute("data-blocks-per-cell") == "4" and c,
    )
    state = http.get("/v1/kv/blocks?max_cells=32", headers=AUTH).json()
    check_stacks(browser, state, range(32))
    hover_cell(browser, canvas, 1)
    text = wait_for("a run's detail", lambda: text_of(browser, "detail"))
    assert text.startswith("blocks 4–7: ")


def test_a_100k_block_pool_renders(browser):
    """A real 100,000-block manager behind the real route and page (no model): 7,693 cells of 13 blocks."""
    from types import SimpleNamespace

    from fastapi import FastAPI

    from pagedllm.server.api_server import Server
    from pagedllm.server.kv_page import router

    pool = busy_engine(100_000)  # the pool its cost benchmark times: 60% held, shared prefixes, cached

    async def run_on_engine(fn, timeout: float = 30.0):  # AsyncLLMEngine.run_on_engine's signature
        return fn(pool)

    app = FastAPI()
    app.include_router(router)
    app.state.engine = SimpleNamespace(
        run_on_engine=run_on_engine,
        stats=lambda: SimpleNamespace(num_blocks=100_000),
        stop_accepting=lambda: None,
        abort_all=lambda: None,
        is_healthy=True,
    )
    srv = Server(app, host="127.0.0.1", port=0, log_level="warning")
    srv.start_in_thread()
    base = f"http://127.0.0.1:{srv.uvicorn.servers[0].sockets[0].getsockname()[1]}"
    try:
        browser.get(f"{base}/kv")
        canvas = wait_for(
            "the map",
            lambda: (c := browser.find_element("id", "map")).get_attribute("data-blocks-per-cell") == "13" and c,
        )
        state = httpx.get(f"{base}/v1/kv/blocks", timeout=60).json()
        assert len(state["map"]["counts"]) == len(state["map"]["state"]) == 7_693 and state["blocks"] is None
        assert text_of(browser, "c-used") == f"{state['counters']['num_used_blocks']:,}"
        check_stacks(browser, state, range(0, 7_693, 37))
        hover_cell(browser, canvas, 5)
        detail = wait_for("a run's detail", lambda: text_of(browser, "detail"))
        counts = ", ".join(f"{n} {s}" for s, n in zip(state["map"]["states"], state["map"]["counts"][5]) if n)
        assert detail == f"blocks 65–77: {counts}"
    finally:
        srv.stop()


def hover_cell(driver, canvas, i: int) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    px, cols = int(canvas.get_attribute("data-cell-px")), int(canvas.get_attribute("data-columns"))
    x, y = (i % cols + 0.5) * px, (i // cols + 0.5) * px
    ActionChains(driver).move_to_element_with_offset(
        canvas, round(x - canvas.size["width"] / 2), round(y - canvas.size["height"] / 2)
    ).perform()


def check_stacks(driver, state: dict, cells) -> None:
    """A quarter of the way down each cell, the canvas has the colour of the state whose band covers that height."""
    mp = state["map"]
    rgb = {k: [int(v[i : i + 2], 16) for i in (1, 3, 5)] for k, v in mp["colors"].items()}
    checked = 0
    for i in cells:
        counts, total = mp["counts"][i], sum(mp["counts"][i])
        cum = [sum(counts[: k + 1]) / total for k in range(len(counts))]
        k = next(k for k, c in enumerate(cum) if c > 0.25)
        if abs(cum[k] - 0.25) < 0.15 or (k and abs(cum[k - 1] - 0.25) < 0.15):
            continue  # too near a band's edge for one pixel to say
        pixel = driver.execute_script(
            """
          const c = document.getElementById('map'), px = +c.dataset.cellPx, cols = +c.dataset.columns;
          const i = arguments[0], inner = px > 4 ? px - 1 : px, dpr = window.devicePixelRatio || 1;
          const x = (i % cols) * px + inner / 2, y = Math.floor(i / cols) * px + inner * 0.25;
          return [...c.getContext('2d').getImageData(Math.floor(x * dpr), Math.floor(y * dpr), 1, 1).data.slice(0, 3)];
          """,
            i,
        )
        assert pixel == rgb[mp["states"][k]], (i, counts)
        checked += 1
    assert checked


def test_the_page_names_a_hybrid_models_state_slots(browser):
    """A manager with recurrent-state slots and checkpoints (no model) behind the real route and page: the page's
    header names the state's layers, bytes per request, slots used and free, checkpoints held; a checkpoint's
    pool blocks are blocks of their own kind in the map (named in the legend, counted, painted in its colour),
    free and evictable in the counters."""
    from types import SimpleNamespace

    from fastapi import FastAPI

    from pagedllm.kv.kv_spec import kv_cache_layout
    from pagedllm.kv.manager import TokenRequest
    from pagedllm.kv.state_slots import StateCheckpoints, StateSlotPool
    from pagedllm.server.api_server import Server
    from pagedllm.server.kv_page import router

    engine = busy_engine(64, blocks_per_request=4)
    kv = engine.kv
    kv.layout = kv_cache_layout([None] * 4, recurrent=[0, 1, 2])
    io = SimpleNamespace(state_to_blocks=lambda row, ids: None, blocks_to_state=lambda ids, row: None)
    kv.attach_state_slots(StateSlotPool(3, 12_345), StateCheckpoints(kv.pool, io, 2, 16))
    req = TokenRequest("h", list(range(40)))
    assert kv.allocate_slots(req, 40) and kv.recurrent.checkpoint(req, 32)
    engine.model_config = SimpleNamespace(recurrent_mixer="mamba2")

    async def run_on_engine(fn, timeout: float = 30.0):
        return fn(engine)

    app = FastAPI()
    app.include_router(router)
    app.state.engine = SimpleNamespace(
        run_on_engine=run_on_engine,
        stats=lambda: SimpleNamespace(num_blocks=64),
        stop_accepting=lambda: None,
        abort_all=lambda: None,
        is_healthy=True,
    )
    srv = Server(app, host="127.0.0.1", port=0, log_level="warning")
    srv.start_in_thread()
    base = f"http://127.0.0.1:{srv.uvicorn.servers[0].sockets[0].getsockname()[1]}"
    try:
        browser.get(f"{base}/kv")
        text = wait_for("the header", lambda: (t := text_of(browser, "pool")) and "state" in t and t)
        assert (
            "recurrent state (3 mamba2 layers): 12,345 bytes per request, slots 1 used / 2 free, "
            "checkpoints 1 in 2 pool blocks (2 each, 0 held)" in text
        )
        check_checkpoint_blocks(
            browser, base, kv, {b.block_id for b in kv.recurrent.checkpoints.blocks(req_key(kv, req))}
        )
    finally:
        srv.stop()


def req_key(kv, req):
    """The key of the request's prefix at its second block boundary (32 tokens), where its checkpoint lies."""
    return kv._hashes(req, 32)[1]


def check_checkpoint_blocks(driver, base: str, kv, ids: set[int]) -> None:
    """The checkpoint's blocks (free, cached) in the map, the counters, the legend and the canvas."""
    state = httpx.get(f"{base}/v1/kv/blocks").json()
    mp, c = state["map"], state["counters"]
    assert {i for i, s in enumerate(mp["state"]) if mp["states"][s] == "checkpoint"} == ids and len(ids) == 2
    assert c["num_checkpoint_blocks"] == 2 and ids <= {b.block_id for b in kv.pool.free_queue}
    assert (c["num_free_blocks"], c["num_evictable_blocks"]) == (kv.num_free_blocks, kv.num_cached_blocks)
    assert c["num_used_blocks"] == kv.num_used_blocks and c["slots_allocated"] == 16 * kv.num_used_blocks
    legend = [li.get_attribute("data-state") for li in driver.find_elements("css selector", "#legend li")]
    assert legend[-1] == "checkpoint" and text_of(driver, "c-checkpoint") == "2"
    rgb = [int(mp["colors"]["checkpoint"][i : i + 2], 16) for i in (1, 3, 5)]
    for i in ids:
        pixel = driver.execute_script(
            """
          const c = document.getElementById('map'), px = +c.dataset.cellPx, cols = +c.dataset.columns;
          const i = arguments[0], dpr = window.devicePixelRatio || 1;
          const x = ((i % cols) + 0.3) * px * dpr, y = (Math.floor(i / cols) + 0.3) * px * dpr;
          return [...c.getContext('2d').getImageData(Math.floor(x), Math.floor(y), 1, 1).data.slice(0, 3)];""",
            i,
        )
        assert pixel == rgb, i
