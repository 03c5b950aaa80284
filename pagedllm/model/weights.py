"""Reading checkpoint tensors into the decoder, from safetensors shards or a GGUF file, by each family's table.

A family names where its tensors sit in a Hugging Face checkpoint (families/base.py); the GGUF names follow
from llama.cpp's own table (`gguf.get_tensor_name_map`, the map its converter writes with), so one table
serves both sources. q/k/v and gate/up pieces are merged into one weight as they arrive; a checkpoint that
stores them fused (Phi-3) fills the merged weight at once. GGUF weights are dequantized with
`gguf.quants.dequantize` (what transformers uses), or, for `--quantization gguf`, kept as stored
(`QuantParts`, see quant.py); the Q/K rows are un-permuted where llama.cpp's converter reordered them for its
interleaved RoPE (we use the rotate-half layout of transformers). A tensor the model would not use is an
error, not a silently different model.

Memory while loading: the weights end up resident once, so whatever loading needs besides them is bounded by
one tensor, never the model: a quantized weight is packed for the kernels as soon as its pieces (q/k/v,
gate/up) are in, and a matrix loaded dense is dequantized a chunk of rows at a time straight into its
parameter (`DenseRows`; a 128k x 4096 head is 2 GiB in float32).
"""

from __future__ import annotations

import functools
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.model.decoder import CausalLM
from pagedllm.model.families import Family, by_architecture
from pagedllm.model.gguf_file import GGUFFile
from pagedllm.model.gguf_quants import GGML_TYPES, from_gguf_blocks
from pagedllm.model.linear import Embedding, Linear
from pagedllm.model.quant import QuantParts, log_once, pack, pack_merged, quantize_rtn

CHUNK_BYTES = 64 << 20  # float32 bytes of a dense GGUF matrix dequantized at a time


@dataclass
class DenseRows:
    """A GGUF matrix to load dense, read from the open file a chunk of rows at a time by `copy_to`."""

    gf: GGUFFile
    name: str
    shape: tuple[int, int]

    def copy_to(self, param: torch.Tensor) -> None:
        step = max(1, CHUNK_BYTES // (4 * self.shape[1]))
        for a in range(0, self.shape[0], step):
            rows = self.gf.load_array(self.name, slice(a, a + step))
            if not rows.flags.writeable:
                rows = rows.copy()
            with torch.no_grad():
                param[a : a + rows.shape[0]].copy_(torch.from_numpy(rows))


Value = torch.Tensor | QuantParts | DenseRows
# GGUF tensors read into the config instead (RoPE factors), and HF buffers recomputed from it.
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass
class Slot:
    """Where one checkpoint tensor goes: `target` (a parameter or its row slice) of `owner`, piece `index` of
    `pieces` (the q/k/v or gate/up pieces merged into one weight)."""

    owner: nn.Module
    target: torch.Tensor
    index: int
    pieces: int
    kind: str  # "weight" | "bias"


def family_of(model: CausalLM) -> Family:
    fam = by_architecture(model.config.architecture)
    assert fam is not None, "config.py only builds configs of known families"
    return fam


def _row_splits(n_pieces: int, rows: int, model: CausalLM) -> list[tuple[int, int]]:
    """Row ranges of the pieces of a merged weight: q, k, v or gate, up (one piece: all rows)."""
    if n_pieces == 1:
        return [(0, rows)]
    layer = model.decoder_layers[0]
    sizes = [layer.q_size, layer.kv_size, layer.kv_size] if n_pieces == 3 else [rows // 2, rows // 2]
    ends = np.cumsum(sizes).tolist()
    return [(e - s, e) for s, e in zip(sizes, ends)]


def tensor_table(model: CausalLM) -> dict[str, Slot]:
    """Every tensor the model needs, by its Hugging Face name."""
    fam = family_of(model)
    table = {
        "model.embed_tokens.weight": Slot(model.embed, model.embed.weight, 0, 1, "weight"),
        "model.norm.weight": Slot(model.norm, model.norm.weight, 0, 1, "weight"),
    }
    if not model.lm_head.tied:
        table["lm_head.weight"] = Slot(model.lm_head, model.lm_head.weight, 0, 1, "weight")
    for i, layer in enumerate(model.decoder_layers):
        for slot, module in layer.slots().items():
            names = fam.layer_tensors[slot]
            for kind in ("weight", "bias"):
                param = getattr(module, kind, None)
                if not isinstance(param, torch.Tensor):
                    continue
                suffix = "" if getattr(module, "bare", False) else f".{kind}"  # a bare nn.Parameter (gpt-oss sinks)
                for j, (name, (a, b)) in enumerate(zip(names, _row_splits(len(names), param.shape[0], model))):
                    table[f"model.layers.{i}.{name}{suffix}"] = Slot(module, param[a:b], j, len(names), kind)
    return table


def gguf_names(model: CausalLM, arch: str, hf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> HF name for the model's tensors, by llama.cpp's name map of `arch`."""
    import gguf

    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(archs.get(arch, gguf.MODEL_ARCH.LLAMA), model.config.num_layers)
    out = {}
    for hf in hf_names:
        name = tmap.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ModelLoadError(f"llama.cpp's {arch} tensor table has no name for {hf}")
        bare = not hf.endswith((".weight", ".bias"))  # the converter stores a bare parameter as `<name>.weight`
        out[name + ".weight" if bare else name] = hf
    return out


def safetensors_files(folder: str) -> list[str]:
    """The shards of a HF folder (from model.safetensors.index.json if present); error if there are none."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"cannot read {index}: {e}") from e
        files = sorted({os.path.join(folder, v) for v in weight_map.values()})
    else:
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {folder} (only safetensors checkpoints are supported)")
    for shard in files:
        if not os.path.isfile(shard):
            raise ModelLoadError(f"weight shard missing: {shard}")
    return files


def iter_safetensors(folder: str) -> Iterator[tuple[str, Value]]:
    from safetensors import safe_open

    for path in safetensors_files(folder):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers / data
            raise ModelLoadError(f"corrupt or unreadable weight file {path}: {e}") from e


def unpermute_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (HF rotate-half layout <- GGUF interleaved layout)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def iter_gguf(gf: GGUFFile, model: CausalLM, keep_quantized: bool = False) -> Iterator[tuple[str, Value]]:
    """GGUF tensors renamed to HF names, Q/K un-permuted where the converter permuted them: dequantized to
    float32, or, with `keep_quantized`, matrices in a type the kernels run (Q4_0, Q4_1, Q8_0) as QuantParts.
    A tensor name the model has no place for is passed on under its GGUF name (assign_weights rejects it)."""
    cfg = model.config
    names = gguf_names(model, str(gf.metadata.get("general.architecture")), list(tensor_table(model)))
    permuted = family_of(model).gguf_permute_qk
    for name, info in gf.tensors.items():
        if name in _CONFIG_TENSORS:
            continue
        hf = names.get(name, name)
        heads = cfg.num_heads if ".q_proj." in hf else cfg.num_kv_heads
        unpermute = permuted and (".q_proj." in hf or ".k_proj." in hf)
        parts = (
            gf.load_raw(name, functools.partial(from_gguf_blocks, ggml_type=info.ggml_type))
            if keep_quantized and info.ggml_type in GGML_TYPES and len(info.shape) == 2 and info.shape[1] % 32 == 0
            else None
        )
        if parts is not None:
            yield hf, parts.rows(unpermute_gguf(np.arange(info.shape[0]), heads)) if unpermute else parts
            continue
        if len(info.shape) == 2 and not unpermute:
            yield hf, DenseRows(gf, name, (info.shape[0], info.shape[1]))
            continue
        arr = gf.load_array(name)
        if unpermute:
            arr = unpermute_gguf(arr, heads)
        if not arr.flags.writeable:
            arr = arr.copy()
        yield hf, torch.from_numpy(np.ascontiguousarray(arr))


def _put(slot: Slot, value: Value, key: str, where: str) -> None:
    shape = tuple(value.shape)
    if shape != tuple(slot.target.shape):
        raise ModelLoadError(f"{where}: tensor {key} has shape {shape}, expected {tuple(slot.target.shape)}")
    if isinstance(value, DenseRows):
        value.copy_to(slot.target)
    elif not isinstance(value, QuantParts):
        with torch.no_grad():
            slot.target.copy_(value)


def _unused(name: str) -> bool:
    """Checkpoint tensors the model may skip: RoPE buffers, which it computes from the config."""
    return name.endswith("rotary_emb.inv_freq")


def assign_weights(model: CausalLM, tensors: Iterator[tuple[str, Value]], where: str) -> None:
    """Copy HF-named tensors into the model (merging q/k/v and gate/up); error on anything missing or left over.
    QuantParts are kept quantized where every piece of their merged weight is, and packed as soon as the last
    piece is in (so loading holds one weight's plain form at a time, not the model's); else dequantized into
    place."""
    table = tensor_table(model)
    filled: set[str] = set()
    extra: list[str] = []
    pieces: dict[int, dict[int, tuple[QuantParts, Slot]]] = {}
    for name, t in tensors:
        slot = table.get(name)
        if slot is None:
            extra += [] if _unused(name) else [name]
            continue
        _put(slot, t, name, where)
        filled.add(name)
        if isinstance(t, QuantParts):
            got = pieces.setdefault(id(slot.owner), {})
            got[slot.index] = (t, slot)
            if len(got) == slot.pieces:
                _install(pieces.pop(id(slot.owner)), where)
    if extra:
        raise ModelLoadError(
            f"{where}: {len(extra)} tensors this {model.config.family} model does not use, e.g. {extra[:3]}"
        )
    missing = [name for name in table if name not in filled]
    if missing:
        raise ModelLoadError(f"{where}: checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    for got in pieces.values():
        _install(got, where)
    model.finish_load()


def _install(got: dict[int, tuple[QuantParts, Slot]], where: str) -> None:
    """The quantized pieces of one weight: merged and kept as stored, or dequantized where they cannot be."""
    owner = next(iter(got.values()))[1].owner
    whole = len(got) == next(iter(got.values()))[1].pieces
    weight = pack_merged([got[i][0] for i in sorted(got)]) if whole else None  # mixed types stay as stored
    if weight is not None and isinstance(owner, (Linear, Embedding)):
        owner.set_quantized(weight)
        return
    log_once(
        f"{where}: a weight mixes quantized and dense pieces, or types split inside a block of 16 rows; it runs dense"
    )
    for p, slot in got.values():
        with torch.no_grad():
            slot.target.copy_(p.dequantize())


def quantize_rtn_model(model: CausalLM, bits: int) -> None:
    """--quantization int8|int4 on dense weights: every linear weight rounded to `bits` in groups of 32 (the
    embedding / LM head table to 8 bits either way: it is read one row per token, and 4 bits cost accuracy)."""
    if model.embed.weight.shape[-1] % 32 == 0:
        model.embed.set_quantized(pack(quantize_rtn(model.embed.weight, 8)))
    for lin in model.linears():
        if lin.tied or lin.quant is not None:
            continue
        if lin.weight.shape[-1] % 32:
            log_once(f"input size {lin.weight.shape[-1]} is not a multiple of 32; it runs dense")
            continue
        lin.set_quantized(pack(quantize_rtn(lin.weight, 8 if lin is model.lm_head else bits)))
    model.finish_load()
