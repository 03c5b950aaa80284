"""Per-layer input embeddings (PLE; Gemma 4's `hidden_size_per_layer_input`): besides the main embedding, every
token gets a small vector for each layer, which that layer gates into its residual stream after its MLP.

Why a module of its own: the vector is made once per step for all layers (one lookup in a table of
[vocab, layers x width], one projection of the main embedding), then each layer reads its slice. As transformers
computes it: (norm(proj(embedding) / sqrt(hidden)) + table[token] * sqrt(width)) / sqrt(2), each layer then
adding norm(out(act(gate(h)) * its slice)).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model.layers.common import RMSNorm, activation
from pagedllm.model.layers.linear import Embedding, Linear


class PerLayerEmbedding(nn.Module):
    """The model's side: the per-layer table, the projection of the main embedding and its norm."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        layers: int,
        width: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.layers, self.width, self.hidden = layers, width, hidden
        self.embed = Embedding(vocab, layers * width, dtype, device)
        self.projection = Linear(layers * width, hidden, False, dtype, device)
        self.norm = RMSNorm(width, eps, dtype, device)

    def slots(self) -> dict[str, nn.Module]:
        """Its weights by their names in a Hugging Face checkpoint, under "model."."""
        return {
            "embed_tokens_per_layer": self.embed,
            "per_layer_model_projection": self.projection,
            "per_layer_projection_norm": self.norm,
        }

    def forward(self, input_ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, layers, width] for tokens `input_ids` whose (scaled) main embedding is `embedded`."""
        T = input_ids.shape[0]
        own = self.embed(input_ids) * torch.tensor(self.width**0.5, dtype=embedded.dtype)
        proj = self.norm((self.projection(embedded) * self.hidden**-0.5).reshape(T, self.layers, self.width))
        return (proj + own.reshape(T, self.layers, self.width)) * 2.0**-0.5


class PerLayerInput(nn.Module):
    """A layer's side: gate the residual stream by the layer's slice, project back, norm, add."""

    def __init__(
        self, hidden: int, width: int, act: str, eps: float, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.act = act
        self.gate = Linear(width, hidden, False, dtype, device)
        self.proj = Linear(hidden, width, False, dtype, device)
        self.norm = RMSNorm(hidden, eps, dtype, device)

    def forward(self, h: torch.Tensor, per_layer: torch.Tensor) -> torch.Tensor:
        return h + self.norm(self.proj(activation(self.act, self.gate(h)) * per_layer))
