"""The bodies of vLLM's runtime LoRA routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (served only
when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true, as vLLM serves them)."""

from __future__ import annotations

from pydantic import Field, StrictInt, StrictStr

from pagedllm.server.protocol import RequestModel


class LoadLoRAAdapterRequest(RequestModel):
    lora_name: StrictStr = Field(min_length=1, description="the name requests put in `model`")
    lora_path: StrictStr = Field(min_length=1, description="a PEFT folder or a GGUF LoRA file on the server")


class UnloadLoRAAdapterRequest(RequestModel):
    lora_name: StrictStr = Field(min_length=1)
    lora_int_id: StrictInt | None = Field(None, description="accepted for vLLM's clients; the name decides")
