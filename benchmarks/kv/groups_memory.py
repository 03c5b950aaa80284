"""Peak KV memory of one long request on a Gemma-3-shaped model (five sliding layers of window 512 to one full
layer) with a block table per KV-cache group against one table for every layer (--disable-hybrid-kv-cache-manager,
the full-attention twin of the allocation): the sliding groups give back what fell out of their window, so the
share falls toward 1/6 (the full layer's) as the request grows. Each measured length runs the engine both ways;
`--layout-only` lengths are what the layout says a request of that length holds once its prompt is in (kv-calc's
figure, `sizing.layout_blocks`: no prefill chunk in flight), for lengths too long to prefill here.

    python -m benchmarks.kv.groups_memory [--tokens 4096,8192] [--chunk 256] [--layout-only 32768,131072]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine
from pagedllm.kv.kv_spec import cdiv
from pagedllm.kv.sizing import layout_blocks
from pagedllm.model import load_model_config


def _lengths(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _model(folder: str, window: int, max_len: int) -> None:
    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=window,
        max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    from devkit.tiny_tokenizer import save_tiny_tokenizer

    save_tiny_tokenizer(folder, 512)


def _peak(folder: str, prompt: list[int], chunk: int, one_table: bool) -> tuple[int, int, int]:
    """(peak blocks, bytes per block, groups) of one request prefilled in `chunk`-token chunks, 16 decoded."""
    engine = LLMEngine(
        EngineConfig(
            model=folder,
            dtype="float32",
            max_model_len=len(prompt) + 64,
            kv_cache_memory=2**28,
            max_num_batched_tokens=chunk,
            disable_hybrid_kv_cache_manager=one_table,
            log_stats_interval=0,
        )  # fmt: skip
    )
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return engine.kv.peak_used_blocks, engine.runner.bytes_per_block, len(engine.kv_layout.groups)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,8192", help="prompt lengths run through the engine")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--window", type=int, default=512, help="the sliding layers' window (Gemma 3 4B+: 1024)")
    ap.add_argument("--layout-only", default="32768,131072", help="lengths answered from the layout alone")
    args = ap.parse_args()
    lengths, layout_lengths = _lengths(args.tokens), _lengths(args.layout_only)
    folder = tempfile.mkdtemp()
    _model(folder, args.window, max(lengths + layout_lengths) + 64)
    print(f"window {args.window}, prefill chunks of {args.chunk}, 16 tokens decoded")
    print("| prompt tokens | a table per group: peak blocks x bytes | one table: peak blocks x bytes | share |")
    print("|---|---|---|---|")
    for n in lengths:
        prompt = torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(0)).tolist()
        (pg, bg, groups), (p1, b1, _) = (_peak(folder, prompt, args.chunk, off) for off in (False, True))
        print(f"| {n:,} | {pg:,} x {bg:,} ({groups} groups) | {p1:,} x {b1:,} | **{pg * bg / (p1 * b1):.3f}** |")
    cfg = load_model_config(folder)
    grouped, single = cfg.kv_layout(hybrid=True), cfg.kv_layout(hybrid=False)
    for n in layout_lengths:
        held = sum(layout_blocks(grouped, n, 16))
        whole = cdiv(n, 16) * single.layers_per_block
        print(f"| {n:,} (layout) | {held:,} x 1 layer | {cdiv(n, 16):,} x {single.layers_per_block} layers | "
              f"**{held / whole:.3f}** |")  # fmt: skip
    print("1/6 = 0.167: the full layer's share, the limit as the request grows")


if __name__ == "__main__":
    main()
