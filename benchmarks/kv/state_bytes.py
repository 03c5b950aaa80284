"""Recurrent-state bytes per request of each hybrid family at a released model's shape (issue 35's "state bytes per
request for each hybrid family in kv-calc"): what `pagedllm kv-calc --model` prints for a folder holding only the
shape's config.json, beside the KV bytes per token of the model's attention layers, so a state slot reads as the KV
of that many tokens. bfloat16 weights (the conv state's dtype; the recurrent state is float32).

    python -m benchmarks.kv.state_bytes
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile

from pagedllm.entrypoints.cli import main as cli
from pagedllm.kv.sizing import kv_dtype_bytes_per_token
from pagedllm.model import load_model_config

# config.json fields of each shape (the released configs' sizes; vocabularies cut to 32,000: no state depends on it)
SHAPES: dict[str, dict] = {
    "Qwen3.5-2B-like (qwen3_5)": dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4, vocab_size=32000, max_position_embeddings=32768,
    ),
    "Qwen3-Next-80B-A3B (qwen3_next)": dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048, intermediate_size=5120,
        num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, decoder_sparse_step=1, vocab_size=32000, max_position_embeddings=32768,
    ),
    "Granite-4.0-H-Tiny (granitemoehybrid)": dict(
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid", hidden_size=1536,
        intermediate_size=512, shared_intermediate_size=1024, num_hidden_layers=40, num_attention_heads=12,
        num_key_value_heads=4, num_local_experts=64, num_experts_per_tok=6, mamba_n_heads=48, mamba_d_head=64,
        mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, position_embedding_type="nope",
        layer_types=["attention" if i % 10 == 5 else "mamba" for i in range(40)], vocab_size=32000,
        max_position_embeddings=131072,
    ),
    "LFM2-1.2B (lfm2)": dict(
        architectures=["Lfm2ForCausalLM"], model_type="lfm2", hidden_size=2048, intermediate_size=12288,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, full_attn_idxs=[2, 5, 8, 10, 12, 14],
        conv_L_cache=3, block_multiple_of=256, block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=True,
        vocab_size=32000, max_position_embeddings=128000,
    ),
    "Qwen3.5-35B-A3B (qwen3_5_moe)": dict(
        architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text", hidden_size=2048,
        num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        full_attention_interval=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, vocab_size=32000, max_position_embeddings=32768,
    ),
    "Nemotron-H-8B-like (nemotron_h)": dict(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=4096, intermediate_size=21504,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, mamba_num_heads=128, mamba_head_dim=64,
        ssm_state_size=128, n_groups=8, conv_kernel=4, expand=2, mlp_hidden_act="relu2",
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        vocab_size=32000, max_position_embeddings=8192,
    ),
    "LFM2-8B-A1B-like (lfm2_moe)": dict(
        architectures=["Lfm2MoeForCausalLM"], model_type="lfm2_moe", hidden_size=2048, intermediate_size=7168,
        moe_intermediate_size=1792, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
        num_dense_layers=2, num_experts=32, num_experts_per_tok=4, conv_L_cache=3,
        layer_types=["full_attention" if i in (2, 6, 10, 14, 18, 21) else "conv" for i in range(24)],
        vocab_size=32000, max_position_embeddings=128000,
    ),
}  # fmt: skip


def main() -> None:
    print("| shape | linear layers (mixer) | state bytes per request | KV bytes per token (bf16) | state = KV of |")
    print("|---|---|---|---|---|")
    for name, fields in SHAPES.items():
        with tempfile.TemporaryDirectory() as folder:
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump({"torch_dtype": "bfloat16", **fields}, f)
            cfg = load_model_config(folder)
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                cli(["kv-calc", "--model", folder, "--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"])
        line = next(x for x in out.getvalue().splitlines() if x.startswith("recurrent state:"))
        state = int(line.split()[2].replace(",", ""))
        assert state == cfg.state_bytes_per_request(2), line  # kv-calc's figure is the engine's reservation
        per_token = kv_dtype_bytes_per_token(cfg.kv_layout().num_kv_layers, *cfg.kv_slot_shape, "bfloat16")
        print(
            f"| {name} | {len(cfg.linear_layers)} of {cfg.num_layers} ({cfg.recurrent_mixer}) | {state:,} "
            f"({state / 2**20:.2f} MiB) | {per_token:,} | {state / per_token:,.0f} tokens |"
        )


if __name__ == "__main__":
    main()
