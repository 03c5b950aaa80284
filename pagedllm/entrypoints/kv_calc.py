"""`pagedllm kv-calc`: the locker arithmetic of whole-length vs paged KV allocation (SOURCE below), and what a
memory budget holds for a real model."""

from __future__ import annotations

import argparse

from pagedllm.errors import UserError
from pagedllm.kv.manager import cdiv
from pagedllm.kv.sizing import (
    KV_DTYPE_ROWS,
    KV_DTYPES,
    kv_bytes_per_block,
    kv_dtype_bytes_per_token,
    layout_blocks,
    num_blocks_in_budget,
    paged_slots,
    parse_memory_size,
    requests_that_fit,
)

SOURCE = (
    'chapter 16 of a Korean textbook, "vLLM 서빙 벤치마킹과 RAG 최적화" (serving benchmarks and RAG optimization '
    "with vLLM): its section on the KV cache and PagedAttention compares reserving each request's maximum length "
    '("one big locker each") with handing out 16-token blocks as a request grows'
)
EXAMPLE_USED = "180,650,90,1200,300,75,420,260"  # the book's eight example requests, tokens each really uses


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-calc",
        help="KV-cache slots: whole-length reservation vs paged blocks",
        description=f"Reproduces the whole-vs-paged arithmetic of {SOURCE}; with --model, the KV bytes per token "
        "and block of a real model for each --kv-cache-dtype, and with --memory, how many of the requests fit in "
        "that KV budget under each allocation.",
    )
    # Flags are read as text and checked here, so a bad value gets one line that names the flag.
    p.add_argument("--max-len", default="4096", help="tokens reserved per request by whole allocation (default: 4096)")
    p.add_argument("--block-size", default="16", help="tokens per KV block of paged allocation (default: 16)")
    p.add_argument(
        "--used",
        default=EXAMPLE_USED,
        help=f"comma-separated tokens each request really uses (default: the book's eight, {EXAMPLE_USED})",
    )
    p.add_argument(
        "--lang",
        choices=["en", "ko"],
        default="en",
        help="en (default): totals and a table; ko: the book's own Korean lines, character for character: its "
        "three totals, then one line per request",
    )
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw the requests as rows, whole allocation (lockers) above paged (blocks), with the totals, into this "
        "PNG file (default: no picture)",
    )
    p.add_argument(
        "--model",
        nargs="?",
        const="default",
        default=None,
        help="a model (Hugging Face folder or GGUF file), or no value for the default model: adds its KV bytes "
        "per token and per block (default: no model report)",
    )
    p.add_argument(
        "--memory",
        default=None,
        help="a KV-cache budget such as 4GiB: how many requests fit in it (needs --model; default: none)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", *KV_DTYPES],
        default="bfloat16",
        help="the KV cache's dtype for --model's bytes per token (default: bfloat16; auto: the model's --dtype)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="the model's dtype, as for `pagedllm serve`; the cache's with --kv-cache-dtype auto (default: auto, "
        "what the engine would load the model in on this machine)",
    )
    p.set_defaults(func=run)


def _positive_int(flag: str, text: str, allow_zero: bool = False) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise UserError(f"{flag}: {text!r} is not a whole number") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise UserError(f"{flag}: must be {'0 or more' if allow_zero else 'at least 1'}, got {value}")
    return value


def parse_used(text: str) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise UserError("--used: give at least one length, e.g. --used 180,650,90")
    return [_positive_int("--used", t, allow_zero=True) for t in items]


def run(args: argparse.Namespace) -> int:
    max_len = _positive_int("--max-len", args.max_len)
    block_size = _positive_int("--block-size", args.block_size)
    used = parse_used(args.used)
    budget = None
    if args.memory is not None:
        try:
            budget = parse_memory_size(args.memory)
        except ValueError as e:
            raise UserError(f"--memory: {e}") from None
        if args.model is None:
            raise UserError("--memory: needs --model to know the KV bytes per token")

    rows = paged_slots(used, block_size)
    total = sum(used)
    whole = max_len * len(used)
    paged = sum(r.slots for r in rows)
    if args.lang == "ko":
        # Character for character what the book's code prints.
        print("실제로 쓴 토큰:", total)
        print(f"통째로 잡은 자리: {whole:,} (쓴 몫 {total / whole:.1%})")
        print(f"쪽으로 잡은 자리: {paged:,} (쓴 몫 {total / paged:.1%})")
        for r in rows:
            print(f"{r.tokens:2d}토큰 → 쪽 {r.blocks}개 = 자리 {r.slots}칸, 빈칸 {r.empty}")
    else:
        print(f"{total:,} tokens used")
        print(f"whole: {whole:,} slots ({total / whole:.1%} used)  [{max_len:,} reserved per request]")
        print(f"paged: {paged:,} slots ({total / paged:.1%} used)  [blocks of {block_size}]")
        print()
        print(f"{'request':>7} {'tokens':>7} {'blocks':>7} {'slots':>7} {'empty':>7}")
        for i, r in enumerate(rows, 1):
            print(f"{i:>7} {r.tokens:>7,} {r.blocks:>7,} {r.slots:>7,} {r.empty:>7,}")
    if args.model is not None:
        _report_model(args.model, _kv_dtype(args), block_size, max_len, used, budget, args.dtype)
    if args.plot:
        from pagedllm.bench.block_map_plot import plot_kv_calc

        plot_kv_calc(used, block_size, max_len, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _kv_dtype(args: argparse.Namespace) -> str:
    """--kv-cache-dtype, where auto is the model's --dtype (auto: as the engine loads the model here)."""
    if args.kv_cache_dtype != "auto":
        return str(args.kv_cache_dtype)
    from pagedllm.model import kv_cache_dtype, load_model_config, resolve_dtype

    dtype = resolve_dtype(args.dtype, load_model_config(None if args.model == "default" else args.model))
    return kv_cache_dtype("auto", dtype)[0]


def _report_states(cfg, model_dtype: str, per_block: int, block_size: int) -> None:
    """A hybrid model's recurrent-state slot: what each request holds beside its blocks, whatever its length (conv
    rows in the model's --dtype, SSM / delta-rule states in float32), per layer and per request, reserved for
    --max-num-seqs requests out of the KV budget; the prefix cache's checkpoints of it are blocks of the pool, as
    many as the state's bytes take of a pool block's (`per_block` bytes), evicted with the KV blocks."""
    from pagedllm.model import resolve_dtype

    if not cfg.linear_layers:
        return
    torch_dtype = resolve_dtype(model_dtype, cfg)
    conv_bytes = torch_dtype.itemsize
    per = cfg.state_bytes_per_request(conv_bytes)
    conv_dim, heads, key_dim, value_dim = cfg.recurrent_state_dims()
    conv = conv_dim * (cfg.linear_conv_kernel_dim - 1) * conv_bytes
    name = str(torch_dtype).removeprefix("torch.")
    layers = ", ".join(map(str, cfg.linear_layers))
    print(f"recurrent state ({cfg.recurrent_mixer}, layers {layers}: no KV, no blocks):")
    print(
        f"  per layer: conv state {conv:,} bytes ({name}), recurrent state {heads * key_dim * value_dim * 4:,} "
        "bytes (float32)"
    )
    print(
        f"recurrent state: {per:,} bytes per request ({len(cfg.linear_layers)} layers): one slot per running "
        "request, whatever its length, reserved for --max-num-seqs requests out of the KV budget"
    )
    each = cdiv(per, per_block)
    print(
        f"  with prefix caching (on by default) a checkpoint of it takes {each:,} pool blocks of their own kind "
        f"({per_block:,} bytes each, {per / per_block:,.1f}x the KV of the {block_size} tokens before it), evicted "
        "with the KV blocks; a prefix hit starts from the state checkpointed at its last block boundary"
    )
    print(
        "  --mamba-cache-mode align: one where a prompt chunk ends at a block boundary; all: one at every block "
        f"boundary of the cached prompts ({each:,} blocks per {block_size} tokens)"
    )


def _report_groups(cfg, dtype: str, block_size: int, max_len: int) -> None:
    """Bytes per token of each kind of layer (the same window), and the blocks a request of --max-len tokens holds
    in each KV-cache group of the pool (each its own table: a sliding group gives back what fell out of its
    window, the full group keeps its own)."""
    layout = cfg.kv_layout(hybrid=True)
    heads, dim = cfg.kv_slot_shape  # a cache slot's shape (the largest layer's, for Gemma 4's two)
    print("KV-cache groups (layers that attend alike):")
    for g in layout.kinds():
        per = kv_dtype_bytes_per_token(len(g.layers), heads, dim, dtype)
        print(f"  {g.name}: {len(g.layers)} layers, {per:,} bytes per token")
    shared = cfg.num_layers - layout.num_kv_layers - len(layout.recurrent_layers) - len(layout.mlp_only_layers)
    if layout.mlp_only_layers:
        print(f"  {len(layout.mlp_only_layers)} MLP-only layers (no mixer): no KV, no state")
    if shared:
        print(f"  {shared} layers read an earlier layer's KV (shared KV): no blocks of their own")
    held = layout_blocks(layout, max_len, block_size)
    if len(layout.groups) == 1:
        window = layout.groups[0].window
        if window is not None:
            print(
                f"a request of {max_len:,} tokens holds {held[0]:,} blocks (not {cdiv(max_len, block_size):,}): "
                f"blocks out of the {window:,}-token window go back to the pool"
            )
        return
    per_block = kv_bytes_per_block(layout.layers_per_block, heads, dim, dtype, block_size)
    print(
        f"the pool: blocks of {layout.layers_per_block} layers ({per_block:,} bytes per block of {block_size}), "
        f"{len(layout.groups)} groups with a block table each; a request of {max_len:,} tokens holds:"
    )
    for i, (g, n) in enumerate(zip(layout.groups, held)):
        print(f"  group {i} ({g.name}, layers {', '.join(map(str, g.layers))}): {n:,} blocks")
    total = sum(held) * per_block
    one_table = cdiv(max_len, block_size) * kv_bytes_per_block(layout.num_kv_layers, heads, dim, dtype, block_size)
    print(f"  in all {sum(held):,} blocks = {total:,} bytes, {total / one_table:.2f} of one table for every layer")


def _report_weights(cfg, model: str | None) -> None:
    """Parameters, total and active per token (a mixture of experts reads only the routed experts), and the
    weight bytes one decoded token reads."""
    from pagedllm.model.config import is_gguf, resolve_model_path
    from pagedllm.model.params import weight_count

    path = resolve_model_path(model)
    w = weight_count(cfg, path if is_gguf(path) else None)
    routed = f" ({cfg.num_experts_per_tok} of {cfg.num_experts} experts routed)" if cfg.num_experts else ""
    print()
    print(f"parameters: {w.total_params:,} total, {w.active_params:,} active per token{routed}")
    print(
        f"weight bytes: {w.total_bytes:,}; read per decoded token: {w.read_bytes:,} "
        f"({w.read_bytes / max(1, w.total_bytes):.1%})"
    )


def _report_model(
    model: str, dtype: str, block_size: int, max_len: int, used: list[int], budget: int | None, model_dtype: str
) -> None:
    from pagedllm.model.config import load_model_config

    cfg = load_model_config(None if model == "default" else model)
    _report_weights(cfg, None if model == "default" else model)

    def per_token_of(name: str) -> int:  # the layers that store KV (a shared layer stores none)
        return kv_dtype_bytes_per_token(cfg.kv_layout().num_kv_layers, *cfg.kv_slot_shape, name)

    per_token = per_token_of(dtype)
    per_block = per_token * block_size
    print()
    heads = f"{cfg.num_kv_heads} KV heads x {cfg.head_dim} dims"
    if cfg.kv_slot_shape != (cfg.num_kv_heads, cfg.head_dim):  # Gemma 4's full layers: their own shape
        heads += f"; the cache's rows {cfg.kv_slot_shape[0]} x {cfg.kv_slot_shape[1]} (the largest layer's)"
    print(f"model: {cfg.name} ({cfg.num_layers} layers, {heads}, {dtype})")
    print(f"KV bytes per token: {per_token:,}")
    print(f"KV bytes per block of {block_size}: {per_block:,}")
    _report_groups(cfg, dtype, block_size, max_len)
    _report_states(cfg, model_dtype, per_block, block_size)
    head = f"{'--kv-cache-dtype':>16} {'bytes/token':>12} {'vs float32':>10}"
    print(head + (f" {'tokens in budget':>17}" if budget else ""))
    for name in KV_DTYPE_ROWS:
        n = per_token_of(name)
        fit = f" {budget // (n * block_size) * block_size:>17,}" if budget else ""
        print(f"{name:>16} {n:>12,} {per_token_of('float32') / n:>9.2f}x{fit}")
    if budget is None:
        return
    blocks = num_blocks_in_budget(budget, per_block)
    print(f"budget {budget:,} bytes: {blocks:,} blocks = {blocks * block_size:,} tokens")
    # The same requests, repeated, until the budget is full: how many run at once under each allocation.
    workload = used * (blocks * block_size // max(1, sum(used)) + 2)
    for allocation in ("contiguous", "paged"):
        n = requests_that_fit(workload, blocks, block_size, allocation, max_len)
        print(f"{allocation:>10}: {n:,} requests of these lengths fit at once")
