"""The LoRA tests' tiny model and adapters (issue 37), shared by test_lora.py and test_cluster_lora.py: a tiny random
Llama, random PEFT adapters of different ranks and targets, and transformers' greedy tokens with each adapter
merged into the weights (PEFT's merge_and_unload), the independent reference."""

from __future__ import annotations

import copy

import torch
from engine_helpers import GREEDY
from model_helpers import make_tiny_hf

from pagedllm.lora_request import LoRARequest

# (name, rank, alpha, targets, rslora): different ranks and targets, split and all-module
ADAPTERS = [
    ("qv", 4, 8, ["q_proj", "v_proj"], False),
    ("all", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], True),
    ("mlp", 2, 4, ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
]
PROMPTS = [[5, 9, 17, 33, 4, 71, 8, 12, 90, 3, 44, 6, 19, 27, 81, 2, 55, 60], [7, 7, 120, 31, 9], [200, 11, 64, 5]]


def peft_adapter(hf, folder: str, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):
    """A PEFT adapter with random A and B (PEFT starts B at zero), saved; the merged transformers model back."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(hf), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


def greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def make_tiny_loras(root: str):
    """(the base folder, the adapters' LoRARequests by name, the reference tokens per adapter and prompt (None:
    the base), the transformers base model), all under `root`."""
    base = f"{root}/base"
    hf = make_tiny_hf("llama_gqa_tied", base)
    loras, want = {}, {None: [greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]}
    for i, (name, rank, alpha, targets, rslora) in enumerate(ADAPTERS):
        folder = f"{root}/{name}"
        merged = peft_adapter(hf, folder, rank, alpha, targets, rslora, seed=i)
        loras[name] = LoRARequest(name, i + 1, folder)
        want[name] = [greedy(merged, p, GREEDY.max_tokens) for p in PROMPTS]
    assert len({str(v) for v in want.values()}) == len(want), "the adapters must change the tokens"
    return base, loras, want, hf
