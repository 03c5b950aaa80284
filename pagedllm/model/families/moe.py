"""What the mixture-of-experts families share: where a sparse block's tensors sit in an HF checkpoint, the 3-D
tensors that hold every expert at once, and the config.json / GGUF keys every MoE family reads alike.

Slots of a sparse block (the decoder's `SparseMoE`, model/layers/moe.py), under "model.layers.N.":
- `router`: the gate over the experts [experts, hidden] (and its bias, gpt-oss);
- `experts_gate_up` / `experts_down`: one expert's weights, `{e}` standing for its number (gate and up are
  merged into one matmul per expert at load, as the dense MLP's are);
- `shared_gate_up` / `shared_down` / `shared_gate`: the always-on shared expert and its sigmoid gate.

Transformers keeps experts in 3-D parameters ([experts, 2 * ffn, hidden] for gate and up, [experts, hidden, ffn]
for down); `save_pretrained` writes each family's original layout (one module per expert for Qwen-MoE, OLMoE,
Mixtral; Granite's 3-D `input_linear` / `output_linear`), and a checkpoint written from the state dict keeps the
3-D names. An `Unfuse` (base.py) names such a tensor and the table's names it holds; the loader splits it.
Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import GGUFHeader, Unfuse

Names = tuple[str, str, str]
HF_NAMES: Names = ("gate_proj", "up_proj", "down_proj")  # one expert's modules (Mixtral: w1, w3, w2)


def moe_tensors(block: str, router: str = "gate", names: Names = HF_NAMES) -> dict[str, tuple[str, ...]]:
    """The slots of a sparse block under `block` with one module per expert (`names`: gate, up, down)."""
    gate, up, down = names
    return {
        "router": (f"{block}.{router}",),
        "experts_gate_up": (f"{block}.experts.{{e}}.{gate}", f"{block}.experts.{{e}}.{up}"),
        "experts_down": (f"{block}.experts.{{e}}.{down}",),
    }


# Qwen's shared expert beside the routed ones (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE), scaled by sigmoid(x @ its gate)
QWEN_SHARED_EXPERT: dict[str, tuple[str, ...]] = {
    "shared_gate_up": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
    "shared_down": ("mlp.shared_expert.down_proj",),
    "shared_gate": ("mlp.shared_expert_gate",),
}


def fused_experts(block: str, at: str = "", names: Names = HF_NAMES) -> tuple[Unfuse, ...]:
    """transformers 5's 3-D expert parameters under `block` (`experts.gate_up_proj` [experts, 2 * ffn, hidden],
    gate rows first; `experts.down_proj` [experts, hidden, ffn]), split into the per-expert names of
    `moe_tensors(at or block, names=names)`."""
    at = at or block
    gate, up, down = names
    return (
        Unfuse(
            f"{block}.experts.gate_up_proj", (f"{at}.experts.{{e}}.{gate}.weight", f"{at}.experts.{{e}}.{up}.weight")
        ),
        Unfuse(f"{block}.experts.down_proj", (f"{at}.experts.{{e}}.{down}.weight",)),
    )


def hf_moe_fields(cfg: dict[str, Any], expert_size_key: str = "moe_intermediate_size") -> dict[str, Any]:
    """The keys every MoE config.json has (transformers' names; Mixtral / Granite / OLMoE: num_local_experts and
    the experts' size in intermediate_size)."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise ValueError("an MoE config without num_experts / num_local_experts")
    return {
        "num_experts": int(experts),
        "num_experts_per_tok": int(cfg["num_experts_per_tok"]),
        "moe_intermediate_size": int(cfg.get(expert_size_key) or cfg["intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(cfg.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in cfg.get("mlp_only_layers") or []],
    }


_GATING = {2: "sigmoid_topk", 3: "softmax_weight"}  # llama.cpp's expert_gating_func values besides 1 (softmax)


def gguf_moe_fields(h: GGUFHeader, norm_topk_prob: bool) -> dict[str, Any]:
    """llama.cpp's MoE keys (`<arch>.expert_count`, ...). A layer is sparse where its router `ffn_gate_inp` is
    stored (llama.cpp builds it so; no key says it); the experts' size is `expert_feed_forward_length` or, where
    the converter writes none (Mixtral, OLMoE, Granite-MoE: the experts are the ffn), the stored experts' rows.
    `norm_topk_prob` is the arch's (llama.cpp fixes it per arch) unless `expert_weights_norm` says; an
    `expert_gating_func` other than softmax (DeepSeek's sigmoid) names a router config.py refuses."""
    layers = int(h.get("block_count"))
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in h.tensors]
    first = next((i for i in range(layers) if i not in dense), 0)
    stored = h.tensors.get(f"blk.{first}.ffn_gate_exps.weight") or h.tensors.get(f"blk.{first}.ffn_up_exps.weight")
    size = h.get("expert_feed_forward_length") or (stored[1] if stored else h.get("feed_forward_length"))
    norm, gating = h.get("expert_weights_norm"), h.get("expert_gating_func")
    shared = h.get("expert_shared_feed_forward_length") or h.tensors.get(f"blk.{first}.ffn_up_shexp.weight", (0,))[0]
    out = {} if gating in (None, 1) else {"moe_router": _GATING.get(int(gating), f"gating function {gating}")}
    return out | {
        "num_experts": int(h.get("expert_count")),
        "num_experts_per_tok": int(h.get("expert_used_count")),
        "moe_intermediate_size": int(size),
        "norm_topk_prob": norm_topk_prob if norm is None else bool(norm),
        "mlp_only_layers": dense,
        "shared_expert_intermediate_size": int(shared),
        "shared_expert_gate": f"blk.{first}.ffn_gate_inp_shexp.weight" in h.tensors,
    }
