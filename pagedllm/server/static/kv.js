// The /kv page: polls GET /v1/kv/blocks about twice a second and paints what pagedllm.engine.block_map laid out.
// Every decision about states, colours and aggregation is made by the server; this file only maps cells to
// pixels and DOM rows, so the page and the PNG pictures show the same thing.
"use strict";

const POLL_MS = 500;
const MAX_CELLS = new URLSearchParams(location.search).get("max_cells") || 8192;  // /kv?max_cells=N to aggregate
const MAX_CELL_PX = 28;
const ROW_HEAD = 24, ROW_TAIL = 8;  // a long block table shows its first and last blocks (the tail is there)
const $ = (id) => document.getElementById(id);
const page = { data: null, prev: null, pinned: null, hover: null, cellPx: 0, details: new Map() };

function apiKey() {
  const m = location.hash.match(/key=([^&]+)/);
  if (m) sessionStorage.setItem("pagedllm-key", decodeURIComponent(m[1]));
  return sessionStorage.getItem("pagedllm-key");
}

async function getJSON(path) {
  const key = apiKey();
  const resp = await fetch(path, { headers: key ? { Authorization: "Bearer " + key } : {}, cache: "no-store" });
  if (resp.status === 401) { $("keyform").hidden = false; throw new Error("the API key is missing or wrong"); }
  if (!resp.ok) throw new Error((await resp.json()).error?.message || resp.statusText);
  return resp.json();
}

async function poll() {
  let delay = POLL_MS;
  if (!document.hidden) {
    const started = performance.now();
    try {
      const data = await getJSON(`/v1/kv/blocks?max_cells=${encodeURIComponent(MAX_CELLS)}`);
      // A big pool makes each answer cost more: wait at least four answers' time, so watching stays cheap.
      delay = Math.max(POLL_MS, 4 * (performance.now() - started));
      page.prev = page.data;
      page.data = data;
      render(data);
      $("status").textContent = "live · step " + data.step;
      $("status").className = "";
    } catch (e) {
      $("status").textContent = "not updating: " + e.message;
      $("status").className = "error";
    }
  }
  setTimeout(poll, delay);
}

function render(d) {
  $("pool").textContent = `${d.num_blocks.toLocaleString()} blocks of ${d.block_size} tokens · ${d.allocation}` +
    ` allocation · KV ${d.kv_cache_dtype} · prefix caching ${d.prefix_caching ? "on" : "off"}` +
    (d.map.blocks_per_cell > 1 ? ` · ${d.map.blocks_per_cell} blocks per cell` : "") +
    (d.kv_groups.length > 1 || d.kv_groups.some((g) => g.window !== null) ? " · KV groups: " +
      d.kv_groups.map((g) => `${g.layers.length} layers ${g.window === null ? "full attention" : `window ${g.window}` +
        (g.frees_blocks ? " (blocks out of it freed)" : "")}: ${g.blocks} blocks`).join(", ") : "") +
    (d.recurrent_state ? " · " + stateLine(d.recurrent_state) : "");
  renderLegend(d);
  renderCounters(d);
  drawMap(d);
  renderRequests(d);
  const shown = page.pinned ?? page.hover;
  if (shown !== null) showDetail(shown);
}

function stateLine(s) {
  // a hybrid model's linear-attention layers: a state slot per running request, checkpoints for the prefix cache
  return `recurrent state (${s.layers.length} ${s.mixer} layers): ${s.bytes_per_request.toLocaleString()} bytes ` +
    `per request, slots ${s.slots_used} used / ${s.slots_free} free` +
    (s.checkpoint_blocks_each ? `, checkpoints ${s.checkpoints} in ${s.checkpoint_blocks} pool blocks ` +
      `(${s.checkpoint_blocks_each} each, ${s.checkpoints_held} held` +
      (s.checkpoint_disk_loads ? `, ${s.checkpoint_disk_loads} read from disk` : "") + ")" : "");
}

function renderLegend(d) {
  // a hybrid model's recurrent-state checkpoints are blocks of their own kind; other models have none to name
  const ul = $("legend"), map = d.map, checkpoints = Boolean(d.recurrent_state?.checkpoint_blocks_each);
  if (ul.childElementCount && ul.dataset.checkpoints === String(checkpoints)) return;
  ul.replaceChildren();
  ul.dataset.checkpoints = String(checkpoints);
  for (const s of map.states) {
    if (s === "checkpoint" && !checkpoints) continue;
    const li = document.createElement("li");
    li.dataset.state = s;
    li.innerHTML = `<i style="background:${map.colors[s]}"></i>${map.labels[s]}`;
    ul.appendChild(li);
  }
}

function tokensPerSecond(d) {
  const p = page.prev;
  if (!p || d.time <= p.time) return "—";
  const tokens = (c) => c.prompt_tokens + c.generation_tokens;
  return ((tokens(d.counters) - tokens(p.counters)) / (d.time - p.time)).toFixed(1);
}

function renderCounters(d) {
  const c = d.counters, pct = (x) => (100 * x).toFixed(1) + "%", n = (x) => x.toLocaleString();
  const rows = [
    ["running", n(c.num_running), "running"], ["waiting", n(c.num_waiting), "waiting"],
    ["KV usage", pct(c.kv_usage), "usage"], ["prefix-cache hit rate", pct(c.prefix_cache_hit_rate), "hit"],
    ["preemptions", n(c.num_preemptions), "preemptions"], ["tokens/s", tokensPerSecond(d), "tps"],
    ["blocks used", n(c.num_used_blocks), "used"], ["blocks shared", n(c.num_shared_blocks), "shared"],
    ["blocks free", n(c.num_free_blocks), "free"], ["… still caching a prefix", n(c.num_evictable_blocks), "evictable"],
    ["slots allocated", n(c.slots_allocated), "slots"], ["tokens stored", n(c.tokens_stored), "stored"],
    ["empty slots", n(c.empty_slots), "empty"],
    ["used share", c.slots_allocated ? pct(c.tokens_stored / c.slots_allocated) : "—", "share"],
  ];
  if (d.recurrent_state?.checkpoint_blocks_each) rows.push(["checkpoint blocks", n(c.num_checkpoint_blocks), "checkpoint"]);
  $("counters").tBodies[0].innerHTML = rows.map(([label, value, id]) =>
    `<tr><td>${label}</td><td id="c-${id}">${value}</td></tr>`).join("");
}

function drawMap(d) {
  const canvas = $("map"), map = d.map, cells = map.state.length;
  const width = canvas.clientWidth || 800;
  const px = Math.max(1, Math.min(MAX_CELL_PX, Math.floor(width / map.columns)));
  const rows = Math.ceil(cells / map.columns), dpr = window.devicePixelRatio || 1;
  canvas.style.height = rows * px + "px";
  canvas.width = Math.round(width * dpr);
  canvas.height = Math.round(rows * px * dpr);
  Object.assign(canvas.dataset, { cellPx: px, columns: map.columns, blocksPerCell: map.blocks_per_cell });
  page.cellPx = px;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  for (let i = 0; i < cells; i++) {
    const x = (i % map.columns) * px, y = Math.floor(i / map.columns) * px;
    if (map.blocks_per_cell === 1) drawBlock(ctx, d, map.states[map.state[i]], map.ref[i], map.fill[i], x, y, px);
    else drawRun(ctx, map, map.counts[i], x, y, px);
  }
}

function drawBlock(ctx, d, state, ref, fill, x, y, px) {
  const colors = d.map.colors, inner = px > 4 ? px - 1 : px;
  ctx.fillStyle = colors[state === "tail" ? "free" : state];
  ctx.fillRect(x, y, inner, inner);
  let label = "";
  if (state === "tail") {  // the filled share of the last block, from the bottom up
    const h = inner * fill / d.block_size;
    ctx.fillStyle = colors.tail;
    ctx.fillRect(x, y + inner - h, inner, h);
    label = String(d.block_size - fill);
  } else if (state === "shared") label = String(ref);
  if (label && px >= 14) {
    ctx.fillStyle = state === "shared" ? "#fff" : "#1d2329";
    ctx.font = `${Math.floor(px * 0.55)}px system-ui, sans-serif`;
    ctx.textAlign = "center";
    ctx.textBaseline = "middle";
    ctx.fillText(label, x + inner / 2, y + inner / 2 + 1);
  }
}

function drawRun(ctx, map, counts, x, y, px) {  // many blocks in one cell: a stack of their states
  const total = counts.reduce((a, b) => a + b, 0) || 1, inner = px > 4 ? px - 1 : px;
  let top = y;
  map.states.forEach((s, k) => {
    if (!counts[k]) return;
    const h = inner * counts[k] / total;
    ctx.fillStyle = map.colors[s];
    ctx.fillRect(x, top, inner, h + 0.5);
    top += h;
  });
}

function cellSpan(d, r, k, state, ref) {
  const span = document.createElement("span");
  span.className = `cell ${state}` + (k < r.prefix_hit_blocks ? " hit" : "");
  span.style.background = d.map.colors[state];
  span.dataset.block = r.block_ids[k];
  span.dataset.ref = ref;
  if (state === "shared") span.textContent = ref;
  if (state === "tail") span.textContent = Math.min(d.block_size, (k + 1) * d.block_size - r.kv_tokens);
  span.title = `block ${r.block_ids[k]}: ${d.map.labels[state]}, ref count ${ref}` +
    (k < r.prefix_hit_blocks ? ", from the prefix cache" : "");
  return span;
}

function tableRow(d, r) {  // the table's runs, cell by cell; a long table shows its head and its tail
  const row = document.createElement("div"), n = r.block_ids.length, long = n > ROW_HEAD + ROW_TAIL;
  row.className = "row";
  let k = 0;
  for (const [state, ref, count] of r.row) {
    for (let j = 0; j < count; j++, k++) {
      if (long && k >= ROW_HEAD && k < n - ROW_TAIL) {
        if (k === ROW_HEAD) {
          const gap = document.createElement("span");
          gap.className = "gap";
          gap.textContent = `… ${n - ROW_HEAD - ROW_TAIL} more …`;
          row.appendChild(gap);
        }
        continue;
      }
      row.appendChild(cellSpan(d, r, k, state, ref));
    }
  }
  return row;
}

function renderRequests(d) {
  const body = $("requests").tBodies[0];
  body.replaceChildren(...d.requests.map((r) => {
    const tr = document.createElement("tr");
    tr.dataset.request = r.request_id;
    tr.dataset.status = r.status;
    for (const v of [r.request_id, r.status, r.prompt_tokens, r.cached_tokens, r.output_tokens, r.kv_tokens,
                     r.slots, r.empty_slots, r.num_preemptions]) {
      const td = document.createElement("td");
      td.textContent = typeof v === "number" ? v.toLocaleString() : v;
      tr.appendChild(td);
    }
    const td = document.createElement("td");
    td.appendChild(tableRow(d, r));
    tr.appendChild(td);
    return tr;
  }));
  $("omitted").textContent = d.requests_omitted ? `… and ${d.requests_omitted} more waiting` : "";
}

function cellAt(event) {
  const canvas = $("map"), rect = canvas.getBoundingClientRect(), d = page.data;
  if (!d || !page.cellPx) return null;
  const col = Math.floor((event.clientX - rect.left) / page.cellPx);
  const row = Math.floor((event.clientY - rect.top) / page.cellPx);
  const i = row * d.map.columns + col;
  return col < d.map.columns && i >= 0 && i < d.map.state.length ? i : null;
}

async function showDetail(i) {
  const d = page.data, map = d.map, box = $("detail");
  box.className = page.pinned === null ? "" : "pinned";
  if (map.blocks_per_cell > 1) {
    const first = i * map.blocks_per_cell, last = Math.min(d.num_blocks, first + map.blocks_per_cell) - 1;
    box.innerHTML = `<b>blocks ${first}–${last}</b>: ` + map.states.map((s, k) =>
      map.counts[i][k] ? `${map.counts[i][k]} ${s}` : "").filter(Boolean).join(", ");
    return;
  }
  const key = `${i}@${d.step}`;  // one question per block per update, however often the mouse moves
  if (!page.details.has(key)) {
    page.details.clear();
    page.details.set(key, getJSON(`/v1/kv/blocks/${i}`).catch((e) => ({ error: e.message })));
  }
  const b = await page.details.get(key);
  if ((page.pinned ?? page.hover) !== i || page.data !== d) return;  // the mouse or the data moved on
  box.innerHTML = blockHTML(d, i, b);
}

function blockHTML(d, i, b) {
  const state = d.map.states[d.map.state[i]], fill = d.map.fill[i];
  if (b.error) return `<b>block ${i}</b> · ${d.map.labels[state]} · (${escapeHTML(b.error)})`;
  const text = b.token_ids.length ? escapeHTML(b.text) : (fill ? "(tokens unknown: cached before this page " +
    "watched)" : "(no tokens)");
  return `<b>block ${i}</b> · <span id="d-state">${d.map.labels[state]}</span> · ref count ` +
    `<span id="d-ref">${b.ref_cnt}</span>` + (b.hash ? ` · hash <code>${b.hash.slice(0, 16)}</code>` : "") +
    (b.evict_rank !== null ? ` · evicted after ${b.evict_rank} other blocks` : "") +
    (fill ? ` · ${fill} of ${d.block_size} slots hold tokens` : "") +
    `<br>held by: <span id="d-holders">${b.holders.map(escapeHTML).join(", ") || "nobody"}</span>` +
    `<div class="text" id="d-text">${text}</div>`;
}

function escapeHTML(s) {
  return s.replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

function wire() {
  const canvas = $("map");
  canvas.addEventListener("mousemove", (e) => {
    page.hover = cellAt(e);
    if (page.pinned === null && page.hover !== null) showDetail(page.hover);
  });
  canvas.addEventListener("click", (e) => {
    const i = cellAt(e);
    page.pinned = page.pinned === i ? null : i;
    if (i !== null) showDetail(i);
  });
  $("keyform").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem("pagedllm-key", $("key").value);
    history.replaceState(null, "", location.pathname);
    $("keyform").hidden = true;
  });
  window.addEventListener("resize", () => page.data && drawMap(page.data));
}

wire();
poll();
