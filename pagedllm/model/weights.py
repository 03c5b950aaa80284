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
import re
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pagedllm.errors import ModelLoadError
from pagedllm.model.families import Family, by_architecture
from pagedllm.model.families.base import Unfuse
from pagedllm.model.formats.gguf_file import GGUFFile
from pagedllm.model.formats.gguf_quants import GGML_TYPES, from_gguf_blocks
from pagedllm.model.kernels.quant_linear import QuantParts, log_once, pack, pack_merged, quantize_rtn
from pagedllm.model.layers.decoder import CausalLM, DecoderLayer
from pagedllm.model.layers.linear import Embedding, Linear

CHUNK_BYTES = 64 << 20  # float32 bytes of a dense GGUF matrix dequantized at a time


@dataclass
class DenseRows:
    """A GGUF matrix to load dense, read from the open file a chunk of rows at a time by `copy_to`."""

    gf: GGUFFile
    name: str
    shape: tuple[int, int]
    expert: int | None = None  # the matrix of this expert in a 3-D tensor of every expert's (read whole)
    first_row: int = 0  # where the expert's rows start in its matrix (Gemma 4's gate and up stacked)

    def copy_to(self, param: torch.Tensor) -> None:
        if self.expert is not None:
            one = self.gf.load_array(self.name, slice(self.expert, self.expert + 1))[0]
            one = np.array(one[self.first_row : self.first_row + self.shape[0]])
            with torch.no_grad():
                param.copy_(torch.from_numpy(one))
            return
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


def _row_splits(n_pieces: int, rows: int, layer: DecoderLayer, slot: str) -> list[tuple[int, int]]:
    """Row ranges of the pieces of a merged weight: q, k, v (q, k where keys are the values) or gate, up (one
    piece: all rows)."""
    if n_pieces == 1:
        return [(0, rows)]
    if slot in ("qkv", "qk"):
        sizes = [layer.q_rows] + [layer.kv_size] * (n_pieces - 1)
    else:
        sizes = [rows // 2, rows // 2]
    ends = np.cumsum(sizes).tolist()
    return [(e - s, e) for s, e in zip(sizes, ends)]


def tensor_table(model: CausalLM) -> dict[str, Slot]:
    """Every tensor the model needs, by its Hugging Face name."""
    fam = family_of(model)
    table = {
        "model.embed_tokens.weight": Slot(model.embed, model.embed.weight, 0, 1, "weight"),
        f"model.{fam.final_norm}.weight": Slot(model.norm, model.norm.weight, 0, 1, "weight"),
    }
    if not model.lm_head.tied:
        table["lm_head.weight"] = Slot(model.lm_head, model.lm_head.weight, 0, 1, "weight")
    for name, module in ({} if model.per_layer is None else model.per_layer.slots()).items():
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        table[f"model.{name}.weight"] = Slot(module, weight, 0, 1, "weight")
    for i, layer in enumerate(model.decoder_layers):
        for slot, module in layer.slots().items():
            base, _, expert = slot.partition("#")  # "experts_down#3": expert 3's
            names = [name.replace("{e}", expert) for name in fam.layer_tensors[base]]
            for kind in ("weight", "bias"):
                param = getattr(module, kind, None)
                if not isinstance(param, torch.Tensor):
                    continue
                suffix = "" if getattr(module, "bare", False) else f".{kind}"  # a bare nn.Parameter (gpt-oss sinks)
                splits = _row_splits(len(names), param.shape[0], layer, base)
                for j, (name, (a, b)) in enumerate(zip(names, splits)):
                    table[f"model.layers.{i}.{name}{suffix}"] = Slot(module, param[a:b], j, len(names), kind)
    return table


@dataclass
class LoRATarget:
    """A matmul an adapter may target, by its checkpoint module name: decoder layer `layer`'s `slot` (qkv, o,
    gate_up, down), rows [start, end) of the merged weight (q, k or v of qkv; gate or up of gate_up)."""

    layer: int
    slot: str
    linear: Linear
    start: int
    end: int


LORA_SLOTS = ("qkv", "o", "gate_up", "down")  # a dense layer's four matmuls (a sparse layer's experts: none)


def lora_targets(model: CausalLM) -> dict[str, LoRATarget]:
    """Every module an adapter may target, by its Hugging Face name without `.weight` (the names PEFT writes
    under `base_model.model.`): the q/k/v/o/gate/up/down projections of the dense layers, split or fused as the
    family's checkpoints store them (Phi-3's qkv_proj and gate_up_proj are one target each)."""
    fam = family_of(model)
    out = {}
    for i, layer in enumerate(model.decoder_layers):
        slots = layer.slots()
        for slot in LORA_SLOTS:
            lin = slots.get(slot)
            if not isinstance(lin, Linear):
                continue
            names = fam.layer_tensors[slot]
            for name, (a, b) in zip(names, _row_splits(len(names), lin.out_features, layer, slot)):
                out[f"model.layers.{i}.{name}"] = LoRATarget(i, slot, lin, a, b)
    return out


def gguf_target_names(model: CausalLM, arch: str) -> dict[str, str]:
    """GGUF weight name ("blk.0.attn_q.weight") -> the LoRA target's HF module name, by llama.cpp's table."""
    targets = lora_targets(model)
    return {
        g: hf.removesuffix(".weight") for g, hf in gguf_names(model, arch, [t + ".weight" for t in targets]).items()
    }


# HF names as llama.cpp's converter renames them before its name map (Mamba2's and Qwen3-Next's dt_bias, LFM2-MoE's
# expert_bias, Nemotron-H's e_score_correction_bias)
_CONVERTER_RENAMES = (
    (".dt_bias", ".dt_proj.bias"),
    (".expert_bias", ".expert_bias.bias"),
    (".e_score_correction_bias", ".e_score_correction.bias"),
)


def gguf_names(model: CausalLM, arch: str, hf_names: list[str]) -> dict[str, str]:
    """GGUF tensor name -> HF name for the model's tensors, by llama.cpp's name map of `arch` (and the family's
    own names for those the map lacks)."""
    import gguf

    archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    tmap = gguf.get_tensor_name_map(archs.get(arch, gguf.MODEL_ARCH.LLAMA), model.config.num_layers)
    fam = family_of(model)
    own = {} if fam.gguf_layer_names is None else fam.gguf_layer_names(model.config.num_experts > 0)
    out = {}
    for hf in hf_names:
        m = _LAYER_NAME.fullmatch(hf)
        base, dot, kind = hf.rpartition(".")
        if m and base[len(m.group(1)) :] in own:
            out[f"blk.{m.group(1).split('.')[2]}.{own[base[len(m.group(1)) :]]}{dot}{kind}"] = hf
            continue
        key = hf
        for old, new in _CONVERTER_RENAMES:
            key = key.replace(old, new)
        name = tmap.get_name(key, try_suffixes=(".weight", ".bias"))
        for old, new in fam.renamed if name is None else ():  # the checkpoint's own name (Nemotron-H's backbone.)
            if name is None and key.startswith(new):
                name = tmap.get_name(old + key[len(new) :], try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ModelLoadError(f"llama.cpp's {arch} tensor table has no name for {hf}")
        if not hf.endswith((".weight", ".bias")) and key == hf:  # a bare parameter: `<name>.weight` (gpt-oss's
            out[name + ".weight"] = hf  # sinks) or `<name>` (Mamba2's and Qwen3-Next's ssm_a, ssm_d)
        out[name] = hf
    return out


# llama.cpp's MoE tensors ("blk.N.<name>.weight" / ".bias") -> (slot, piece) in the family's table
_GGUF_MOE = {
    "ffn_gate_inp": ("router", 0),
    "ffn_gate_exps": ("experts_gate_up", 0),
    "ffn_up_exps": ("experts_gate_up", 1),
    "ffn_down_exps": ("experts_down", 0),
    "ffn_gate_shexp": ("shared_gate_up", 0),
    "ffn_up_shexp": ("shared_gate_up", 1),
    "ffn_down_shexp": ("shared_down", 0),
    "ffn_gate_inp_shexp": ("shared_gate", 0),
}


# ... where the experts and the shared expert are ungated (Nemotron-H): their gate_up slot holds the up rows alone
_GGUF_MOE_UNGATED = {
    short: (slot, 0) if short in ("ffn_up_exps", "ffn_up_shexp") else (slot, piece)
    for short, (slot, piece) in _GGUF_MOE.items()
    if short not in ("ffn_gate_exps", "ffn_gate_shexp")
}


# Gemma 4's router scale and per-expert scales, stored beside the router and the experts' down matrices
_GGUF_MOE_SCALES = {"ffn_gate_inp.scale": "router_scale", "ffn_down_exps.scale": "expert_scale"}


def gguf_moe_names(model: CausalLM) -> dict[str, str]:
    """GGUF name -> HF name of every sparse block's tensors (an expert's with `{e}` for its number: the GGUF
    tensor holds them all). llama.cpp's converter names these alike in every arch."""
    layers = family_of(model).layer_tensors
    table = _GGUF_MOE if model.config.mlp_gated else _GGUF_MOE_UNGATED
    out = {}
    for i, layer in enumerate(model.decoder_layers):
        slots = {slot.partition("#")[0]: module for slot, module in layer.slots().items()}
        for short, (slot, piece) in table.items():
            if slot in slots and layer.moe is not None:
                for kind in ("weight", "bias"):
                    if isinstance(getattr(slots[slot], kind, None), torch.Tensor):
                        out[f"blk.{i}.{short}.{kind}"] = f"model.layers.{i}.{layers[slot][piece]}.{kind}"
        for short, slot in _GGUF_MOE_SCALES.items():
            if slot in slots:
                suffix = "" if getattr(slots[slot], "bare", False) else ".weight"
                out[f"blk.{i}.{short}"] = f"model.layers.{i}.{layers[slot][0]}{suffix}"
    return out


def _expert_names(model: CausalLM, templates: list[str]) -> set[str]:
    return {t.replace("{e}", str(e)) for t in templates for e in range(max(1, model.config.num_experts))}


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
    moe = gguf_moe_names(model)
    sparse = _expert_names(model, list(moe.values()))
    dense = [name for name in tensor_table(model) if name not in sparse]
    names = gguf_names(model, str(gf.metadata.get("general.architecture")), dense) | moe
    permuted = family_of(model).gguf_permute_qk
    for name, info in gf.tensors.items():
        if name in _CONFIG_TENSORS:
            continue
        if name.endswith(".ffn_gate_up_exps.weight"):  # Gemma 4: every expert's gate and up stacked
            for half, piece in enumerate(("ffn_gate_exps", "ffn_up_exps")):
                hf = names.get(name.replace("ffn_gate_up_exps", piece), name)
                yield from _gguf_experts(gf, name, hf, cfg.num_experts, keep_quantized, (half, 2))
            continue
        hf = names.get(name, name)
        if "{e}" in hf:
            yield from _gguf_experts(gf, name, hf, cfg.num_experts, keep_quantized)
            continue
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
        if len(info.shape) == 2 and not unpermute and not hf.endswith(".A_log"):
            yield hf, DenseRows(gf, name, (info.shape[0], info.shape[1]))
            continue
        arr = gf.load_array(name)
        if unpermute:
            arr = unpermute_gguf(arr, heads)
        if hf.endswith(".A_log"):  # the converter stores A = -exp(A_log) (Mamba2, Gated DeltaNet)
            arr = np.log(-arr.astype(np.float32))
        if not arr.flags.writeable:
            arr = arr.copy()
        yield hf, torch.from_numpy(np.ascontiguousarray(arr))


def _expert_blocks(raw: np.ndarray, expert: int, ggml_type: int, rows: slice) -> QuantParts:
    return from_gguf_blocks(raw[expert][rows], ggml_type)


def _gguf_experts(
    gf: GGUFFile, name: str, hf: str, experts: int, keep_quantized: bool, part: tuple[int, int] = (0, 1)
) -> Iterator[tuple[str, Value]]:
    """A 3-D tensor of every expert's matrix ([experts, rows, cols]; a bias [experts, n]), one expert at a time:
    its slice of the stored blocks as QuantParts (never the whole tensor dequantized), or read dense. `part`:
    (i, n): the i-th of n equal row ranges of each expert's matrix (Gemma 4's gate and up in one tensor)."""
    info = gf.tensors[name]
    if len(info.shape) not in (2, 3) or info.shape[0] != experts or info.shape[1] % part[1]:
        raise ModelLoadError(
            f"{gf.path}: tensor {name} has shape {info.shape}, not one matrix for each of {experts} experts"
        )
    quant = keep_quantized and len(info.shape) == 3 and info.ggml_type in GGML_TYPES and info.shape[2] % 32 == 0
    n = info.shape[1] // part[1]
    rows = slice(part[0] * n, (part[0] + 1) * n)
    for e in range(experts):
        one = hf.replace("{e}", str(e))
        if quant:
            load = functools.partial(_expert_blocks, expert=e, ggml_type=info.ggml_type, rows=rows)
            yield one, gf.load_raw(name, load)
        elif len(info.shape) == 3:
            yield one, DenseRows(gf, name, (n, info.shape[2]), expert=e, first_row=rows.start)
        else:
            yield one, torch.from_numpy(gf.load_array(name, slice(e, e + 1))[0].copy())


_LAYER_NAME = re.compile(r"(model\.layers\.\d+\.)(.+)")
_TEXT_MODEL = "model.language_model."  # a multimodal checkpoint's text model (Family.multimodal_architectures)


def unfused(model: CausalLM, tensors: Iterator[tuple[str, Value]], where: str) -> Iterator[tuple[str, Value]]:
    """The checkpoint's tensors with each that holds several of the table's (the family's `unfuse`: 3-D
    experts, gate and up stacked, another name) split into those."""
    fam = family_of(model)
    rules = {rule.source: rule for rule in fam.unfuse}
    text_only = model.config.architecture in fam.multimodal_architectures
    for name, t in tensors:
        if text_only:  # a multimodal checkpoint: its text model's tensors, renamed; the other towers' skipped
            if name.startswith("model.") and not name.startswith(_TEXT_MODEL):
                continue
            name = name.replace(_TEXT_MODEL, "model.", 1)
        m = _LAYER_NAME.fullmatch(name)
        rule = rules.get(m.group(2)) if m else None
        if m is None or rule is None or not isinstance(t, torch.Tensor):
            yield name, t
            continue
        yield from _split(rule, m.group(1), name, t, model.config.num_experts, where)


def renamed(model: CausalLM, tensors: Iterator[tuple[str, Value]]) -> Iterator[tuple[str, Value]]:
    """The checkpoint's tensors under the family's names: a renamed prefix replaced, a skipped one left out."""
    fam = family_of(model)
    for name, t in tensors:
        if fam.skipped and name.startswith(fam.skipped):
            continue
        for old, new in fam.renamed:
            if name.startswith(old):
                name = new + name[len(old) :]
        yield name, t


def _split(rule: Unfuse, prefix: str, name: str, t: torch.Tensor, experts: int, where: str):
    if rule.experts and (t.dim() < 2 or t.shape[0] != experts):
        raise ModelLoadError(
            f"{where}: tensor {name} has shape {tuple(t.shape)}, not one for each of {experts} experts"
        )
    for e, w in enumerate(t if rule.experts else [t]):
        if rule.transposed and w.dim() == 2:
            w = w.t()
        n = len(rule.targets)
        pieces = [w[i::n] for i in range(n)] if rule.interleaved else w.chunk(n)
        for target, piece in zip(rule.targets, pieces):
            yield prefix + target.replace("{e}", str(e)), piece.contiguous()


def _reshapes(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether a stored tensor fills a parameter of another shape: [H] for [1, H], a conv's [C, K] for [C, 1, K]
    (llama.cpp's converter squeezes it), a 1-D parameter stored per group (Mamba2's norm, [groups, size])."""
    if shape == target or int(np.prod(shape)) != int(np.prod(target)):
        return False
    return [n for n in shape if n != 1] == [n for n in target if n != 1] or len(target) == 1


def _put(slot: Slot, value: Value, key: str, where: str) -> None:
    target = slot.target
    if not isinstance(value, QuantParts) and _reshapes(tuple(value.shape), tuple(target.shape)):
        if isinstance(value, torch.Tensor):
            value = value.reshape(target.shape)
        else:  # DenseRows: read into a view of the parameter in the stored shape
            target = target.view(value.shape)
    if tuple(value.shape) != tuple(target.shape):
        raise ModelLoadError(
            f"{where}: tensor {key} has shape {tuple(value.shape)}, expected {tuple(slot.target.shape)}"
        )
    if isinstance(value, DenseRows):
        value.copy_to(target)
    elif not isinstance(value, QuantParts):
        with torch.no_grad():
            target.copy_(value)


def _unused(name: str) -> bool:
    """Checkpoint tensors the model may skip: RoPE buffers, which it computes from the config."""
    return name.endswith("rotary_emb.inv_freq")


_STORED_16 = {torch.bfloat16: "BF16", torch.float16: "F16"}  # a matrix's dtype -> the GGML type of its rows


def as_stored(slot: Slot, t: Value) -> Value:
    """A 16-bit matrix of a matmul or embedding table as QuantParts of the kernels' bf16 / f16 format: the same
    values, so the C kernels (and the fused C step, which needs every weight in their tiles) run it losslessly;
    anything else (a bias, a float32 tensor, a router kept dense, an input size not in groups of 32) as given."""
    owner = slot.owner
    if (
        not isinstance(t, torch.Tensor)
        or t.dtype not in _STORED_16
        or t.dim() != 2
        or t.shape[1] % 32
        or slot.kind != "weight"
        or not isinstance(owner, (Linear, Embedding))
        or getattr(owner, "keep_dense", False)
    ):
        return t
    ggml_type = next(k for k, name in GGML_TYPES.items() if name == _STORED_16[t.dtype])
    return from_gguf_blocks(t.contiguous().view(torch.uint8).numpy(), ggml_type)  # rows as a GGUF stores them


def assign_weights(model: CausalLM, tensors: Iterator[tuple[str, Value]], where: str, keep_16bit: bool = False) -> None:
    """Copy HF-named tensors into the model (merging q/k/v and gate/up); error on anything missing or left over.
    QuantParts are kept quantized where every piece of their merged weight is, and packed as soon as the last
    piece is in (so loading holds one weight's plain form at a time, not the model's); else dequantized into
    place. `keep_16bit`: a checkpoint's bfloat16 / float16 matrices are kept as stored (`as_stored`)."""
    table = tensor_table(model)
    filled: set[str] = set()
    extra: list[str] = []
    pieces: dict[int, dict[int, tuple[QuantParts, Slot]]] = {}
    for name, t in unfused(model, renamed(model, tensors), where):
        slot = table.get(name)
        if slot is None:
            extra += [] if _unused(name) else [name]
            continue
        if keep_16bit:
            t = as_stored(slot, t)
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
    tables = [model.embed] + ([] if model.per_layer is None else [model.per_layer.embed])  # Gemma 4's per-layer one
    for table in tables:
        if table.weight.shape[-1] % 32 == 0:
            table.set_quantized(pack(quantize_rtn(table.weight, 8)))
    for lin in model.linears():
        if lin.tied or lin.quant is not None or lin.keep_dense:
            continue
        if lin.weight.shape[-1] % 32:
            log_once(f"input size {lin.weight.shape[-1]} is not a multiple of 32; it runs dense")
            continue
        lin.set_quantized(pack(quantize_rtn(lin.weight, 8 if lin is model.lm_head else bits)))
    model.finish_load()
