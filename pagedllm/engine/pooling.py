"""Embeddings from a decoder: how a checkpoint says its hidden states become one vector, and the pooling itself.

The rule is sentence-transformers' (what vLLM reads too): `modules.json` lists the modules, `1_Pooling/config.json`
says which pooling (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`, `pooling_mode_cls_token`), a
`sentence_transformers.models.Normalize` module means L2-normalized. A checkpoint without them gets vLLM's default
for a decoder run as an embedding model: the last token, normalized. Matryoshka truncation (`dimensions`) is only
allowed where the model's config.json says it was trained for it (`is_matryoshka` / `matryoshka_dimensions`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from pagedllm.errors import UserError
from pagedllm.sampling_params import PoolingParams

_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}


@dataclass
class PoolerConfig:
    """A model's embedding rule; `params(dimensions)` is what a request of it passes to the engine."""

    pooling_type: str = "LAST"
    normalize: bool = True
    is_matryoshka: bool = False
    matryoshka_dimensions: list[int] | None = None

    def check_dimensions(self, dimensions: int | None, hidden_size: int) -> None:
        """UserError naming `dimensions` unless the model may be cut to that many (vLLM's rule)."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise UserError("dimensions: this model does not support Matryoshka truncation (dimensions)")
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise UserError(f"dimensions: must be one of {allowed}, got {dimensions}")
        if not 1 <= dimensions <= hidden_size:
            raise UserError(f"dimensions: must be in [1, {hidden_size}], got {dimensions}")

    def params(self, dimensions: int | None = None) -> PoolingParams:
        return PoolingParams(self.pooling_type, self.normalize, dimensions)


def _read_json(path: str) -> dict:
    """A JSON object from the checkpoint, or {} when absent; a broken one is the user's to fix, named."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read it: {e}") from None
    if not isinstance(data, dict | list):
        raise UserError(f"{path}: not a JSON object")
    return {"modules": data} if isinstance(data, list) else data


def read_pooler_config(model_path: str) -> PoolerConfig:
    """The checkpoint's pooling rule (module docstring); a GGUF file or a folder without one gets LAST + normalize."""
    folder = model_path if os.path.isdir(model_path) else ""
    if not folder:
        return PoolerConfig()
    modules = _read_json(os.path.join(folder, "modules.json")).get("modules", [])
    types = [m.get("type", "") for m in modules if isinstance(m, dict)]
    pooling_dir = next(
        (m.get("path", "") for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")),
        "1_Pooling",
    )
    pooling = _read_json(os.path.join(folder, str(pooling_dir), "config.json"))
    mode = next((kind for key, kind in _MODES.items() if pooling.get(key)), None)
    hf = _read_json(os.path.join(folder, "config.json"))
    dims = hf.get("matryoshka_dimensions")
    return PoolerConfig(
        pooling_type=mode or "LAST",
        normalize=any(t.endswith(".Normalize") for t in types) if modules else True,
        is_matryoshka=bool(hf.get("is_matryoshka")) or dims is not None,
        matryoshka_dimensions=[int(d) for d in dims] if isinstance(dims, list) else None,
    )


class PoolingState:
    """A pooling request's running pool over its prompt chunks (the engine computes a long prompt in pieces): the
    sum for MEAN, the first row for CLS, the last row for LAST. A recomputed (preempted) prompt starts over."""

    def __init__(self, params: PoolingParams) -> None:
        self.params = params
        self.acc: torch.Tensor | None = None
        self.embedding: list[float] | None = None

    def add(self, hidden: torch.Tensor, start: int) -> None:
        """`hidden`: [n, hidden_size] final hidden states of positions start .. start + n - 1."""
        kind = self.params.pooling_type
        if start == 0:
            self.acc = None
        if kind == "MEAN":
            part = hidden.float().sum(0)
            self.acc = part if self.acc is None else self.acc + part
        elif kind == "LAST" or self.acc is None:
            self.acc = hidden[-1 if kind == "LAST" else 0].float().clone()

    def finish(self, num_tokens: int) -> list[float]:
        assert self.acc is not None, "pooled before any chunk was computed"
        vec = self.acc / num_tokens if self.params.pooling_type == "MEAN" else self.acc
        if self.params.dimensions is not None:
            vec = vec[: self.params.dimensions]
        if self.params.normalize:
            vec = torch.nn.functional.normalize(vec, p=2, dim=0)
        self.embedding = vec.tolist()
        return self.embedding
