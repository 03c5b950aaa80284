"""`LoRARequest`: which adapter a request runs under (vLLM's class and field names).

`lora_int_id` is the adapter's identity everywhere below the API: the KV cache's block hashes, kv_blend's segment
roots, the disk tier and the cluster router's keys carry it, never the name, so two adapters loaded one after the
other under one name never share blocks. 0 is the base model (no adapter), as in vLLM, where ids start at 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.errors import UserError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id (> 0, unique per adapter while it is loaded) and path (a PEFT folder or a GGUF LoRA
    file); `base_model_name`: the served name it applies to (vLLM's JSON form of --lora-modules)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise UserError("LoRARequest: lora_name is empty")
        if self.lora_int_id < 1:
            raise UserError(f"LoRARequest {self.lora_name!r}: lora_int_id must be at least 1 (got {self.lora_int_id})")


def lora_id(lora: LoRARequest | None) -> int:
    """The adapter id a request's KV is keyed by: 0 for the base model."""
    return 0 if lora is None else lora.lora_int_id
