"""Peak KV memory of one long request on a Gemma-3-shaped model (five sliding layers of window 512 to one full
layer) with a block table per KV-cache group against one table for every layer (--disable-hybrid-kv-cache-manager,
the full-attention twin of the allocation): the sliding groups give back what fell out of their window.

    python -m benchmarks.kv.groups_memory [--tokens 8192] [--chunk 256]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig

from pagedllm import SamplingParams
from pagedllm.engine import EngineConfig, LLMEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    folder = tempfile.mkdtemp()
    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16, sliding_window=512,
        max_position_embeddings=args.tokens + 64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    from devkit.tiny_tokenizer import save_tiny_tokenizer

    save_tiny_tokenizer(folder, 512)
    prompt = torch.randint(3, 512, (args.tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    peaks = {}
    for off in (False, True):
        engine = LLMEngine(
            EngineConfig(
                model=folder,
                dtype="float32",
                max_model_len=args.tokens + 64,
                kv_cache_memory=2**28,
                max_num_batched_tokens=args.chunk,
                disable_hybrid_kv_cache_manager=off,
                log_stats_interval=0,
            )  # fmt: skip
        )
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        peak = engine.kv.peak_used_blocks
        peaks[off] = peak * engine.runner.bytes_per_block
        name = "one table for every layer" if off else "a table per group"
        print(f"{name}: {len(engine.kv_layout.groups)} groups, peak {peak} blocks x "
              f"{engine.runner.bytes_per_block} B = {peaks[off]:,} B")  # fmt: skip
    print(f"per-group tables hold {peaks[False] / peaks[True]:.3f} of the one-table peak")


if __name__ == "__main__":
    main()
