"""Mixtral: Mistral's layer with sparse blocks (`block_sparse_moe`, experts' w1 / w3 / w2 = gate / up / down):
softmax over the experts, the top k, always renormalised. llama.cpp writes it as arch "llama" with an
`expert_count` (config.py picks this family then), Q/K permuted like Llama's."""

from __future__ import annotations

from typing import Any

from pagedllm.model.families.base import LLAMA_LAYER, Family, GGUFHeader, Unfuse
from pagedllm.model.families.llama import gguf_fields as llama_gguf_fields
from pagedllm.model.families.moe import fused_experts, gguf_moe_fields, hf_moe_fields, moe_tensors

_NAMES = ("w1", "w3", "w2")


def hf_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    return hf_moe_fields(cfg, "intermediate_size") | {"norm_topk_prob": True}


def gguf_fields(h: GGUFHeader) -> dict[str, Any]:
    return llama_gguf_fields(h) | gguf_moe_fields(h, norm_topk_prob=True)


MIXTRAL = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    ("mixtral",),
    ("llama",),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LLAMA_LAYER | moe_tensors("block_sparse_moe", names=_NAMES),
    gguf_permute_qk=True,
    moe=True,
    # transformers 5's names: the block is `mlp`, its experts 3-D
    unfuse=(Unfuse("mlp.gate.weight", ("block_sparse_moe.gate.weight",), experts=False),)
    + fused_experts("mlp", at="block_sparse_moe", names=_NAMES),
)
