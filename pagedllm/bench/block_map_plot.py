"""Block maps as PNG: the /kv page's pictures, painted by matplotlib from the same layout (engine/block_map.py).

The page's kv.js (from its JSON) and this module paint the `BlockMap` that `block_map()` returns with one rule: a cell
has its state's colour; a request's last, partly filled block is filled from the bottom up to its share of tokens and
labelled with its empty slots; a shared block is labelled with its ref count; a cell that aggregates many blocks is a
stack of its states. `bench sweep --plot` draws the contiguous and paged runs at their peak with it, `kv-calc --plot`
its example requests.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from pagedllm.engine import STATES, BlockMap, KVSnapshot, RequestState, block_map, expand_row
from pagedllm.kv import cdiv

LABEL_MIN_CELLS = 2048  # above this many cells a pool map has no room for numbers


@functools.cache
def _mpl():
    """matplotlib's pieces, imported on first use: importing this module must not cost a matplotlib import."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PatchCollection
    from matplotlib.patches import Patch, Rectangle

    return plt, PatchCollection, Rectangle, Patch


def _cell(
    rects: list,
    x: float,
    y: float,
    state: str,
    fill_share: float,
    colors: dict,
    gap: float,
    height: float | None = None,
) -> None:
    """One block at (x, y), top-left origin, one unit wide; a tail shows its filled share from the bottom."""
    Rectangle = _mpl()[2]
    w, h = 1 - gap, height or 1 - gap
    if state == "tail":
        rects.append(Rectangle((x, y), w, h, color=colors["free"]))
        rects.append(Rectangle((x, y + h * (1 - fill_share)), w, h * fill_share, color=colors["tail"]))
    else:
        rects.append(Rectangle((x, y), w, h, color=colors[state]))


def draw_pool(ax, m: BlockMap) -> None:
    """The pool as a grid of cells, as the page's canvas shows it."""
    PatchCollection, Rectangle = _mpl()[1:3]
    mp, bs = m.map, m.block_size
    cols, cells, colors = mp.columns, len(mp.state), mp.colors
    rects, labels = [], cells <= LABEL_MIN_CELLS
    for i in range(cells):
        x, y = i % cols, i // cols
        if mp.counts is not None:  # a run of blocks: a stack of its states, top to bottom in legend order
            top, total = float(y), sum(mp.counts[i]) or 1
            for state, n in zip(STATES, mp.counts[i]):
                if n:
                    rects.append(Rectangle((x, top), 0.95, 0.95 * n / total, color=colors[state]))
                    top += 0.95 * n / total
            continue
        state, fill = STATES[mp.state[i]], mp.fill[i]
        _cell(rects, x, y, state, fill / bs, colors, 0.08)
        text = str(mp.ref[i]) if state == "shared" else str(bs - fill) if state == "tail" else ""
        if labels and text:
            ax.text(
                x + 0.46,
                y + 0.5,
                text,
                ha="center",
                va="center",
                fontsize=6,
                color="white" if state == "shared" else "#1d2329",
            )
    ax.add_collection(PatchCollection(rects, match_original=True))
    _frame(ax, cols, cdiv(cells, cols))
    ax.set_aspect("equal")  # square cells, as on the page


def draw_rows(ax, m: BlockMap, max_rows: int = 24, max_cells: int | None = None) -> None:
    """Each request's block table as a row of cells (running first), as the page's request table shows it."""
    PatchCollection, Rectangle = _mpl()[1:3]
    colors, bs = m.map.colors, m.block_size
    rects: list[Any] = []
    rows = [r for r in m.requests if r.block_ids][:max_rows]
    width = max([len(r.block_ids) for r in rows] + [max_cells or 1])
    for y, r in enumerate(rows):
        for k, (state, _) in enumerate(expand_row(r.row)):
            share = min(bs, max(0, r.kv_tokens - k * bs)) / bs
            _cell(rects, k, y, state, share, colors, 0.12 if width <= 96 else 0.0, height=0.78)
            if k < r.prefix_hit_blocks:  # came from the prefix cache: underlined, as on the page
                rects.append(Rectangle((k, y + 0.8), 0.88, 0.08, color="#1f4e79"))
    ax.add_collection(PatchCollection(rects, match_original=True))
    _frame(ax, width, len(rows))
    ax.set_yticks([y + 0.39 for y in range(len(rows))], [_short(r.request_id) for r in rows], fontsize=7)


def _short(request_id: str) -> str:
    return request_id if len(request_id) <= 18 else request_id[:8] + "…" + request_id[-8:]


def _frame(ax, width: float, height: float) -> None:
    ax.set_xlim(-0.2, width + 0.2)
    ax.set_ylim(height + 0.2, -0.2)  # row 0 on top, as on the page
    ax.set_xticks([])
    ax.set_yticks([])
    for side in ax.spines.values():
        side.set_visible(False)


def legend(fig, m: BlockMap, states: Sequence[str] = STATES) -> None:
    _, _, _, Patch = _mpl()
    shown = [s for s in states if s != "checkpoint" or m.counters.num_checkpoint_blocks]  # a hybrid model's only
    handles = [Patch(color=m.map.colors[s], label=m.map.labels[s]) for s in shown]
    fig.legend(handles=handles, loc="lower center", ncol=min(3, len(handles)), fontsize=8, frameon=False)


def plot_block_maps(maps: dict[str, BlockMap], path: str, title: str = "") -> None:
    """Side by side, one column per map (e.g. contiguous and paged at their peak): the pool, then the tables."""
    plt = _mpl()[0]
    fig, axes = plt.subplots(
        2, len(maps), figsize=(7.5 * len(maps), 9), squeeze=False, gridspec_kw={"height_ratios": [3, 2]}
    )
    width = max([len(r.block_ids) for m in maps.values() for r in m.requests] + [0])
    for col, (name, m) in enumerate(maps.items()):
        c = m.counters
        draw_pool(axes[0][col], m)
        axes[0][col].set_title(
            f"{name}: {c.num_running} running, {c.num_used_blocks:,} of {m.num_blocks:,} "
            f"blocks held\n{c.tokens_stored:,} tokens in {c.slots_allocated:,} slots "
            f"({_share(c.tokens_stored, c.slots_allocated)} used)",
            fontsize=10,
        )
        draw_rows(axes[1][col], m, max_cells=width)  # one scale for all: a short table looks short
        axes[1][col].set_title("block tables (one row per request)", fontsize=9)
    legend(fig, next(iter(maps.values())))
    fig.suptitle(title or "KV block maps")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.1%}" if whole else "-"


def lengths_snapshot(lengths: Sequence[int], block_size: int, allocation: str, max_len: int) -> KVSnapshot:
    """Requests that hold `lengths` tokens, laid end to end in a pool just big enough: kv-calc's whole-vs-paged
    arithmetic as a snapshot, so kv-calc draws it with the same code as a live engine's."""
    per_request = [cdiv(max_len if allocation == "contiguous" else n, block_size) for n in lengths]
    reqs, start = [], 0
    for i, (n, blocks) in enumerate(zip(lengths, per_request)):
        reqs.append(RequestState(f"request {i + 1}", "running", n, 0, 0, n, 0, list(range(start, start + blocks))))
        start += blocks
    total = max(1, start)
    return KVSnapshot(
        0.0, 0, allocation, block_size, total, False, [1] * start + [0] * (total - start), [], [], [], reqs, 0
    )


def plot_kv_calc(lengths: Sequence[int], block_size: int, max_len: int, path: str):
    """Whole allocation (each request's max_len locker, its used part) above paged (its blocks, the last one's
    empty slots marked), with the totals; returns the figure's text lines so a caller can check them."""
    plt = _mpl()[0]
    whole = block_map(lengths_snapshot(lengths, block_size, "contiguous", max_len))
    paged = block_map(lengths_snapshot(lengths, block_size, "paged", max_len))
    width = cdiv(max_len, block_size)
    fig, axes = plt.subplots(2, 1, figsize=(14, 2.2 + 0.55 * len(lengths)))
    used = sum(lengths)
    whole_slots, paged_slots = whole.counters.slots_allocated, paged.counters.slots_allocated
    lines = [
        f"{used:,} tokens used",
        f"whole: {whole_slots:,} slots ({_share(used, whole_slots)} used), {max_len:,} reserved per request",
        f"paged: {paged_slots:,} slots ({_share(used, paged_slots)} used), blocks of {block_size}",
    ]
    for ax, m, line in ((axes[0], whole, lines[1]), (axes[1], paged, lines[2])):
        draw_rows(ax, m, max_rows=len(lengths), max_cells=width)
        ax.set_xlim(-0.2, width * 1.2)  # room for each row's numbers
        ax.set_title(line, fontsize=10, loc="left")
        for y, r in enumerate(x for x in m.requests if x.block_ids):
            ax.text(
                len(r.block_ids) + 1,
                y + 0.39,
                f"{r.kv_tokens:,} tokens in {r.slots:,} slots, {r.empty_slots:,} empty",
                va="center",
                fontsize=7,
            )
    legend(fig, whole, ("used", "tail", "reserved"))
    fig.suptitle(f"KV slots, whole vs paged: {lines[0]}", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return lines
