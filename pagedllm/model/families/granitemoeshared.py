"""Granite-MoE-shared: Granite-MoE (granitemoe.py) with a shared expert of `shared_intermediate_size` beside the
routed ones, added without a gate. Its GGUF files say "granitemoe" (that family reads them, shared expert and
all)."""

from __future__ import annotations

from pagedllm.model.families.base import Family
from pagedllm.model.families.granitemoe import LAYER, UNFUSE, gguf_fields, hf_fields

GRANITEMOESHARED = Family(
    "granitemoeshared",
    ("GraniteMoeSharedForCausalLM",),
    ("granitemoeshared",),
    (),
    hf_fields=hf_fields,
    gguf_fields=gguf_fields,
    layer_tensors=LAYER,
    gguf_permute_qk=True,
    moe=True,
    unfuse=UNFUSE,
)
