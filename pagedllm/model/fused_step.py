"""A step of a quantized model as one C call (csrc/model_step.c) instead of ~1,200 torch ops.

Used by `ModelRunner` for every step (decode tokens and prefill chunks alike) when every matmul weight, the
embedding table and the LM head are kept quantized (`--quantization gguf|int8|int4`) and the kernels are
built. The structures are the C ones, read from csrc/model_step.h; they are filled once per runner (weights,
caches), and what changes per step is a few int64 arrays built with numpy.

With --dtype bfloat16 on a CPU with AMX, matmuls of at least the measured number of rows (kernel_choice.py)
run on AMX with their inputs rounded to bfloat16; everything else computes in float32.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

import pagedllm.model.cpu_kernel as cpu_kernel
import pagedllm.model.kv_quant as kv_quant
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.quant import FORMATS, amx_available

# the C structures (csrc/model_step.h), read from the header itself; cpu_kernel.load() checks their sizes
_STRUCTS = cpu_kernel.c_structs("model_step.h")
_Layer, _Model, _Batch = _STRUCTS["StepLayer"], _STRUCTS["StepModel"], _STRUCTS["StepBatch"]


PHASES = ("norm", "qkv", "rope+kv write", "attention", "o", "gate_up", "act", "down", "lm_head")


ERRORS = {
    -1: "out of memory",
    -2: "bad sizes",
    -3: "a context length outside the block table",
    -4: "a block id outside the cache",
    -5: "a token id, position, slot or row out of range",
}
_LAYER_WEIGHTS = (
    ("qkv", "qkv_weight", False),
    ("o", "o_weight", False),
    ("gate_up", "gate_up_weight", True),
    ("down", "down_weight", True),
)


def fusable(model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether the C step can run this model: every weight quantized, CPU caches the kernel reads, kernels built."""
    if cpu_kernel.load() is None or model.quant.get("embed_tokens") is None or model.lm_head_quant is None:
        return False
    if any(kc.device.type != "cpu" or kc.dtype not in kv_quant.KINDS or not kc.is_contiguous() for kc, _ in kv_caches):
        return False
    return model.config.head_dim % 2 == 0 and all(
        name in (layer.mlp if mlp else layer).quant for layer in model.layers for _, name, mlp in _LAYER_WEIGHTS
    )


class FusedStep:
    """Runs steps of one model over one set of KV caches."""

    def __init__(
        self, model: LlamaForCausalLM, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int
    ) -> None:
        lib = cpu_kernel.load()
        assert lib is not None, "built only where supported() found the kernels"
        self.lib = lib
        self.model, self.block_size = model, block_size
        self._keep: list[torch.Tensor] = []  # float32 copies the C structures point into
        self.layers = (_Layer * len(model.layers))(
            *[self._layer(layer, kc, vc) for layer, (kc, vc) in zip(model.layers, kv_caches)]
        )
        self.dims = self._model(kv_caches[0][0])
        self.profile: np.ndarray | None = None  # float64 [len(PHASES)]: seconds per phase, summed, when set

    def _f32(self, t: torch.Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().float().contiguous()
        self._keep.append(t)
        return t.data_ptr()

    def _layer(self, layer, k_cache: torch.Tensor, v_cache: torch.Tensor) -> ctypes.Structure:
        fields = {
            "attn_norm": self._f32(layer.input_layernorm.weight),
            "ffn_norm": self._f32(layer.post_attention_layernorm.weight),
            "qkv_bias": self._f32(layer.qkv_bias),
            "k_cache": k_cache.data_ptr(),
            "v_cache": v_cache.data_ptr(),
        }
        for field, name, mlp in _LAYER_WEIGHTS:
            w = (layer.mlp if mlp else layer).quant[name]
            fields[field], fields[f"{field}_fmt"] = w.tiles.data_ptr(), FORMATS[w.fmt]
        return _Layer(**fields)

    def _model(self, k_cache: torch.Tensor) -> Any:
        m, cfg = self.model, self.model.config
        embed, head = m.quant["embed_tokens"], m.lm_head_quant
        assert head is not None, "fused_step.supported() checked the LM head is quantized"
        amx = head.amx_min_rows if m.embed_tokens.dtype == torch.bfloat16 and amx_available() else 0
        return _Model(
            hidden=cfg.hidden_size,
            inter=cfg.intermediate_size,
            heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            layers=cfg.num_layers,
            vocab=cfg.vocab_size,
            block_size=self.block_size,
            cache_kind=kv_quant.KINDS[k_cache.dtype],
            amx_min_rows=amx,
            num_blocks=k_cache.shape[0],
            eps=cfg.rms_norm_eps,
            scale=cfg.head_dim**-0.5,
            final_norm=self._f32(m.norm.weight),
            embed=embed.tiles.data_ptr(),
            lm_head=head.tiles.data_ptr(),
            embed_fmt=FORMATS[embed.fmt],
            lm_head_fmt=FORMATS[head.fmt],
        )

    def _rotary(self, max_pos: int) -> None:
        """Point at the cos/sin tables, growing them first if a position is past their end."""
        rot = self.model.rotary
        if max_pos >= rot.cos_cache.shape[0]:
            rot.cos_sin(torch.tensor([max_pos]), torch.float32)
        self.dims.cos, self.dims.sin = rot.cos_cache.data_ptr(), rot.sin_cache.data_ptr()
        self.dims.max_positions = rot.cos_cache.shape[0]

    def run(
        self, token_ids: list[list[int]], starts: list[int], block_tables: list[list[int]], num_logits: list[int]
    ) -> torch.Tensor:
        """float32 logits of sequence i adding `token_ids[i]` after `starts[i]` cached tokens: the last
        `num_logits[i]` rows of each sequence, in order ([sum(num_logits), vocab])."""
        S, bs = len(token_ids), self.block_size
        lens = np.array([len(t) for t in token_ids], dtype=np.int64)
        T = int(lens.sum())
        seq = np.repeat(np.arange(S, dtype=np.int64), lens)
        first = np.cumsum(lens) - lens
        pos = np.array(starts, dtype=np.int64)[seq] + np.arange(T, dtype=np.int64) - first[seq]
        tables = self._tables(block_tables, np.array(starts, dtype=np.int64) + lens, bs)
        slots = tables[seq, pos // bs] * bs + pos % bs
        toks = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=T)
        want = np.array(num_logits, dtype=np.int64)
        rows = (
            np.arange(T, dtype=np.int64)
            if (want == lens).all()
            else np.concatenate(
                [np.arange(e - k, e, dtype=np.int64) for e, k in zip((first + lens).tolist(), want.tolist())]
            )
        )
        logits = torch.empty(len(rows), self.model.config.vocab_size, dtype=torch.float32)
        self._rotary(int(pos.max()))
        batch = _Batch(
            toks.ctypes.data,
            pos.ctypes.data,
            seq.ctypes.data,
            slots.ctypes.data,
            tables.ctypes.data,
            rows.ctypes.data,
            T,
            S,
            tables.shape[1],
            len(rows),
            logits.data_ptr(),
            None if self.profile is None else self.profile.ctypes.data,
        )
        rc = self.lib.model_step(ctypes.byref(self.dims), self.layers, ctypes.byref(batch), torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"model_step failed: {ERRORS.get(rc, rc)}")
        return logits

    @staticmethod
    def _tables(block_tables: list[list[int]], ends: np.ndarray, bs: int) -> np.ndarray:
        """[S, most blocks needed] int64: row i the blocks sequence i needs to hold `ends[i]` tokens."""
        need = (ends + bs - 1) // bs
        out = np.zeros((len(block_tables), int(need.max())), dtype=np.int64)
        for i, (table, n) in enumerate(zip(block_tables, need.tolist())):
            if len(table) < n:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {int(ends[i])} tokens")
            out[i, :n] = table[:n]
        return out
