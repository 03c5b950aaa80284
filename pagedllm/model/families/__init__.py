"""The model families pagedllm runs, one small module each over the shared decoder (decoder.py)."""

from pagedllm.model.families.base import Family, GGUFHeader
from pagedllm.model.families.gemma2 import GEMMA2
from pagedllm.model.families.gemma3 import GEMMA3
from pagedllm.model.families.gemma4 import GEMMA4
from pagedllm.model.families.gpt_oss import GPT_OSS
from pagedllm.model.families.granite import GRANITE
from pagedllm.model.families.granitemoe import GRANITEMOE
from pagedllm.model.families.granitemoehybrid import GRANITEMOEHYBRID
from pagedllm.model.families.granitemoeshared import GRANITEMOESHARED
from pagedllm.model.families.lfm2 import LFM2
from pagedllm.model.families.lfm2_moe import LFM2_MOE
from pagedllm.model.families.llama import LLAMA, MISTRAL
from pagedllm.model.families.mixtral import MIXTRAL
from pagedllm.model.families.nemotron_h import NEMOTRON_H
from pagedllm.model.families.olmo2 import OLMO2
from pagedllm.model.families.olmoe import OLMOE
from pagedllm.model.families.phi3 import PHI3
from pagedllm.model.families.qwen2 import QWEN2
from pagedllm.model.families.qwen2_moe import QWEN2_MOE
from pagedllm.model.families.qwen3 import QWEN3
from pagedllm.model.families.qwen3_5 import QWEN3_5
from pagedllm.model.families.qwen3_5_moe import QWEN3_5_MOE
from pagedllm.model.families.qwen3_moe import QWEN3_MOE
from pagedllm.model.families.qwen3_next import QWEN3_NEXT
from pagedllm.model.families.smollm3 import SMOLLM3

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, PHI3, SMOLLM3, OLMO2, GRANITE)
FAMILIES += (GEMMA4,)  # per-layer input embeddings, shared KV (families/gemma4.py)
FAMILIES += (QWEN2_MOE, QWEN3_MOE, OLMOE, MIXTRAL, GRANITEMOE, GRANITEMOESHARED, GPT_OSS)  # sparse (families/moe.py)
FAMILIES += (QWEN3_5, QWEN3_NEXT, QWEN3_5_MOE)  # hybrid: Gated DeltaNet layers, a recurrent state (layers/deltanet.py)
FAMILIES += (GRANITEMOEHYBRID, LFM2, LFM2_MOE)  # hybrid: Mamba2 (layers/mamba2.py), short conv (shortconv.py)
FAMILIES += (NEMOTRON_H,)  # hybrid, single-block layers: a Mamba2 mixer, attention or an ungated MLP each
SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)
GGUF_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.gguf_archs)


def by_architecture(name: str) -> Family | None:
    """The family of an HF `architectures` entry or `model_type`, or None."""
    return next((f for f in FAMILIES if name in f.architectures or name in f.model_types), None)


def by_gguf_arch(name: str, moe: bool = False) -> Family | None:
    """The family of a GGUF `general.architecture` (`moe`: the file has experts; llama.cpp writes Mixtral as
    "llama" with an expert count), or None."""
    found = [f for f in FAMILIES if name in f.gguf_archs]
    return next((f for f in found if f.moe == moe), found[0] if found else None)


__all__ = ["FAMILIES", "Family", "GGUFHeader", "SUPPORTED_ARCHITECTURES", "GGUF_ARCHITECTURES"]
__all__ += ["by_architecture", "by_gguf_arch"]
