"""LoRA adapters on one base model: reading them (PEFT folders, llama.cpp GGUF adapters), checking them against
the model, and keeping the loaded ones (vLLM's --max-cpu-loras, least recently used dropped first).

An adapter becomes, per targeted matmul, one A [R, in] and one B [out, R] (layers/lora.py) in float32,
the scale (lora_alpha / r, or / sqrt(r) with use_rslora; llama.cpp: adapter.lora.alpha / r) folded into B, and the
q/k/v (gate/up) pieces stacked into the merged matmul the decoder runs. The base weights are never touched.
A step runs its adapters' term through LoRAHook on the torch path, or through csrc/lora.c inside the fused C
step (`LoRAManager.fused_step` builds its rows and `fused_mats` its matrices).

The two file forms:
- PEFT: adapter_config.json (r, lora_alpha, use_rslora, target_modules) and adapter_model.safetensors with
  `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r].
- GGUF (llama.cpp's convert_lora_to_gguf.py): general.type = adapter, adapter.type = lora, adapter.lora.alpha,
  tensors `<weight>.lora_a` [r, in] and `.lora_b` [out, r] (llama-adapter.cpp's orientation: a's ne = {in, r},
  b's ne = {r, out}); for families whose Q/K rows the converter permuted, lora_b's rows of q and k are too, and
  are un-permuted here as the base model's are.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
from collections import Counter, OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

import pagedllm.model.kernels.cpu_kernel as cpu_kernel
from pagedllm.errors import ModelLoadError, UserError
from pagedllm.lora_request import LoRARequest
from pagedllm.model.formats.gguf_file import GGUFFile
from pagedllm.model.layers.decoder import CausalLM
from pagedllm.model.layers.lora import LoRABatch, LoRAHook, LoRAKey, LoRAStack, LoRAWeight
from pagedllm.model.weights import (
    LORA_SLOTS,
    LoRATarget,
    family_of,
    gguf_target_names,
    lora_targets,
    unpermute_gguf,
)

logger = logging.getLogger("pagedllm")

# the fused C step's LoRA structures (csrc/lora.h), read from the header itself; cpu_kernel.load() checks their sizes
_LORA_STRUCTS = cpu_kernel.c_structs("lora.h")
_Mat, _Step = _LORA_STRUCTS["LoraMat"], _LORA_STRUCTS["LoraStep"]

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class LoRAError(ModelLoadError):
    """An adapter that cannot be applied to this model: the message names the adapter and the tensor."""


@dataclass
class LoRAPiece:
    """One targeted module's matrices as read: a [r, in], b [out, r] (float32) and the scale to apply."""

    module: str  # the Hugging Face module name, e.g. model.layers.0.self_attn.q_proj
    a: torch.Tensor
    b: torch.Tensor
    scale: float


@dataclass
class LoRAModel:
    """A loaded adapter: its weights by (layer, slot), ready for LoRAHook."""

    name: str
    int_id: int
    path: str
    rank: int
    weights: dict[LoRAKey, LoRAWeight]
    fused: FusedMats | None = None  # its matrices as the fused C step reads them, made on first use

    @property
    def nbytes(self) -> int:
        return sum(w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size() for w in self.weights.values())


@dataclass
class FusedMats:
    """One adapter's matrices for the fused C step: a LoraMat (csrc/lora.h) per (layer, slot), A and B transposed
    (A^T [in, R], B^T [R, out]: both halves sum rows of them), and the tensors they point into."""

    table: ctypes.Array[ctypes.Structure]
    keep: list[torch.Tensor]
    max_rank: int


@dataclass
class FusedLoRA:
    """A step's LoRA rows for the fused C step (csrc/lora.h's LoraStep, StepBatch.lora): the rows of each adapter
    together, in groups of at most `lora_group_rows()`, and every array the structure points into."""

    step: ctypes.Structure
    keep: list[object]


def fused_mats(lora: LoRAModel, layers: int, dtype: torch.dtype) -> FusedMats:
    """The adapter's LoraMat table, [layers * LORA_SLOTS] (r 0 where it adapts nothing), its matrices in `dtype`
    (float32 or bfloat16: LoraStep.bf16), kept on the adapter."""
    if lora.fused is None:
        table = (_Mat * (layers * len(LORA_SLOTS)))()
        keep = []
        for (layer, slot), w in lora.weights.items():
            at, bt = w.a.T.to(dtype).contiguous(), w.b.T.to(dtype).contiguous()
            pieces = torch.tensor(w.pieces or [(0, w.b.shape[0], 0, w.b.shape[1])], dtype=torch.int64)
            keep += [at, bt, pieces]
            i = layer * len(LORA_SLOTS) + LORA_SLOTS.index(slot)
            table[i] = _Mat(at.data_ptr(), bt.data_ptr(), pieces.data_ptr(), at.shape[1], len(pieces))
        lora.fused = FusedMats(table, keep, max(w.a.shape[0] for w in lora.weights.values()))
    return lora.fused


def _peft_pieces(name: str, path: str) -> list[LoRAPiece]:
    from safetensors import safe_open

    try:
        with open(os.path.join(path, PEFT_CONFIG)) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {PEFT_CONFIG} in {path}: {e}") from None
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')} is not LORA")
    unsupported = [
        (cfg.get("use_dora"), "use_dora (DoRA)"),
        (cfg.get("modules_to_save"), "modules_to_save"),
        (cfg.get("alpha_pattern"), "alpha_pattern"),
        (cfg.get("fan_in_fan_out"), "fan_in_fan_out"),
        (cfg.get("bias", "none") != "none" or cfg.get("lora_bias"), "LoRA biases"),
    ]
    bad = [what for hit, what in unsupported if hit]
    if bad:
        raise LoRAError(f"LoRA adapter {name!r}: {', '.join(bad)} not supported")
    alpha, rslora = float(cfg.get("lora_alpha", cfg.get("r", 8))), bool(cfg.get("use_rslora", False))
    tensors: dict[str, torch.Tensor] = {}
    file = os.path.join(path, PEFT_WEIGHTS)
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for missing / corrupt files
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {file}: {e}") from None
    pieces = []
    for key in sorted(tensors):
        if ".lora_B." in key:
            continue
        if ".lora_A." not in key:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA A or B matrix")
        module = key.removeprefix(PEFT_PREFIX).split(".lora_A.")[0]
        b_key = key.replace(".lora_A.", ".lora_B.")
        if b_key not in tensors:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key} has no {b_key}")
        a, b = tensors[key].float(), tensors[b_key].float()
        r = a.shape[0]
        pieces.append(LoRAPiece(module, a, b, alpha / (math.sqrt(r) if rslora else r)))
    orphans = [k for k in tensors if ".lora_B." in k and k.replace(".lora_B.", ".lora_A.") not in tensors]
    if orphans:
        raise LoRAError(f"LoRA adapter {name!r}: tensor {orphans[0]} has no lora_A")
    return pieces


def _gguf_pieces(name: str, path: str, model: CausalLM) -> list[LoRAPiece]:
    with GGUFFile(path) as gf:
        md = gf.metadata
        if md.get("general.type") != "adapter" or md.get("adapter.type", "lora") != "lora":
            raise LoRAError(
                f"LoRA adapter {name!r}: {path} is a GGUF file but not a LoRA adapter "
                f"(general.type = {md.get('general.type')!r}, adapter.type = {md.get('adapter.type')!r})"
            )
        arch = str(md.get("general.architecture"))
        names = gguf_target_names(model, arch)
        alpha = float(md.get("adapter.lora.alpha", 0.0))
        permuted = family_of(model).gguf_permute_qk
        cfg = model.config
        pieces = []
        for tname in sorted(gf.tensors):
            if tname.endswith(".lora_b"):
                continue
            if not tname.endswith(".lora_a"):
                raise LoRAError(f"LoRA adapter {name!r}: tensor {tname} is not a lora_a or lora_b")
            base = tname.removesuffix(".lora_a")
            if base + ".lora_b" not in gf.tensors:
                raise LoRAError(f"LoRA adapter {name!r}: tensor {tname} has no {base}.lora_b")
            module = names.get(base)
            if module is None:
                raise LoRAError(f"LoRA adapter {name!r}: tensor {tname}: the model has no matmul {base} to adapt")
            a = np.array(gf.load_array(tname), dtype=np.float32)
            b = np.array(gf.load_array(base + ".lora_b"), dtype=np.float32)
            if permuted and module.endswith(("q_proj", "k_proj")) and b.ndim == 2:
                heads = cfg.num_heads if module.endswith("q_proj") else cfg.num_kv_heads
                if b.shape[0] % (2 * heads) == 0:
                    b = unpermute_gguf(b, heads)
            r = a.shape[0] if a.ndim == 2 else 0
            pieces.append(
                LoRAPiece(module, torch.from_numpy(a), torch.from_numpy(b), alpha / r if alpha and r else 1.0)
            )
    return pieces


def read_lora(req: LoRARequest, model: CausalLM) -> list[LoRAPiece]:
    """The adapter's pieces from a PEFT folder or a GGUF file."""
    path = req.lora_path
    if os.path.isdir(path):
        return _peft_pieces(req.lora_name, path)
    if os.path.isfile(path):
        return _gguf_pieces(req.lora_name, path, model)
    raise LoRAError(f"LoRA adapter {req.lora_name!r}: {path} is neither a PEFT folder nor a GGUF file")


def build_lora(req: LoRARequest, model: CausalLM, max_rank: int, dtype: torch.dtype = torch.float32) -> LoRAModel:
    """Read an adapter and check it against the model: every target one of its matmuls, the shapes its, the rank
    at most `max_rank` (--max-lora-rank); then stack each matmul's pieces (float32)."""
    name = req.lora_name
    targets = lora_targets(model)
    grouped: dict[LoRAKey, list[tuple[LoRATarget, LoRAPiece]]] = {}
    rank = 0
    for p in read_lora(req, model):
        t = targets.get(p.module)
        if t is None:
            raise LoRAError(f"LoRA adapter {name!r}: target module {p.module} is not a matmul this model can adapt")
        if p.a.ndim != 2 or p.b.ndim != 2 or p.a.shape[0] != p.b.shape[1]:
            raise LoRAError(
                f"LoRA adapter {name!r}: {p.module}: A {tuple(p.a.shape)} and B {tuple(p.b.shape)} are not a LoRA "
                "pair (A [r, in], B [out, r])"
            )
        r = p.a.shape[0]
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {name!r}: {p.module} has rank {r}, above --max-lora-rank {max_rank}")
        want = (t.end - t.start, t.linear.in_features)
        if (p.b.shape[0], p.a.shape[1]) != want:
            raise LoRAError(
                f"LoRA adapter {name!r}: {p.module}: A {tuple(p.a.shape)} and B {tuple(p.b.shape)} do not fit the "
                f"model's weight of shape {want}"
            )
        rank = max(rank, r)
        grouped.setdefault((t.layer, t.slot), []).append((t, p))
    if not grouped:
        raise LoRAError(f"LoRA adapter {name!r}: {req.lora_path} holds no LoRA matrices")
    device = model.lm_head.weight.device  # float32 whatever the model's dtype: the term is computed in it
    weights = {}
    for key, parts in grouped.items():
        lin = parts[0][0].linear
        total = sum(p.a.shape[0] for _, p in parts)
        b = torch.zeros(lin.out_features, total)
        col, pieces = 0, []
        for t, p in sorted(parts, key=lambda part: part[0].start):
            r = p.a.shape[0]
            b[t.start : t.end, col : col + r] = p.b * p.scale
            pieces.append((t.start, t.end, col, col + r))
            col += r
        a = torch.cat([p.a for _, p in sorted(parts, key=lambda part: part[0].start)])
        if dtype == torch.bfloat16:  # rounded to it: both paths compute the term from these values
            a, b = a.bfloat16().float(), b.bfloat16().float()
        weights[key] = LoRAWeight(a.to(device).contiguous(), b.to(device).contiguous(), pieces)
    return LoRAModel(name, req.lora_int_id, req.lora_path, rank, weights)


Stacked = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # A.T, B.T of a set of adapters, and each column's adapter


class LoRAManager:
    """The adapters loaded for one model, by id. At most `max_cpu_loras` are kept: loading one more drops the
    least recently used adapter that no request holds (one that requests hold is never dropped: the count is
    exceeded until they finish). `run(ids)` runs a step's rows under their adapters."""

    def __init__(
        self, model: CausalLM, max_lora_rank: int, max_cpu_loras: int, lora_dtype: torch.dtype | None = None
    ) -> None:
        """`lora_dtype` (vLLM's --lora-dtype): the adapters' values, float32 or bfloat16; default the model's (a
        bfloat16 model's adapters in bfloat16, as vLLM keeps them: half the bytes a step reads)."""
        self.model, self.max_lora_rank, self.max_cpu_loras = model, max_lora_rank, max_cpu_loras
        self.lora_dtype = lora_dtype or (torch.bfloat16 if model.dtype == torch.bfloat16 else torch.float32)
        self.adapters: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self.holds: Counter[int] = Counter()  # requests holding each adapter
        self.batch = LoRABatch()
        # the stacked weights of the last sets of adapters that ran together: steps repeat their set for long
        self._stacks: OrderedDict[tuple[int, ...], dict[LoRAKey, Stacked]] = OrderedDict()
        for t in lora_targets(model).values():
            t.linear.lora = LoRAHook(self.batch, (t.layer, t.slot))

    def add(self, req: LoRARequest) -> LoRAModel:
        """The adapter of `req`, loaded now if it is not yet; an id already loaded from another path is refused
        (ids name adapters in the KV cache's keys: one id must always mean the same weights)."""
        have = self.adapters.get(req.lora_int_id)
        if have is not None:
            if have.path != req.lora_path:
                raise UserError(
                    f"LoRA adapter {req.lora_name!r}: id {req.lora_int_id} is already adapter {have.name!r} "
                    f"from {have.path}"
                )
            self.adapters.move_to_end(req.lora_int_id)
            return have
        lora = build_lora(req, self.model, self.max_lora_rank, self.lora_dtype)
        self.adapters[req.lora_int_id] = lora
        self._stacks.clear()
        logger.info("loaded LoRA adapter %s (id %d, rank %d) from %s", lora.name, lora.int_id, lora.rank, lora.path)
        free = [i for i in self.adapters if self.holds[i] == 0 and i != req.lora_int_id]
        while len(self.adapters) > self.max_cpu_loras and free:
            self.adapters.pop(free.pop(0))
        return lora

    def hold(self, int_id: int) -> None:
        self.holds[int_id] += 1

    def release(self, int_id: int) -> None:
        self.holds[int_id] -= 1
        if self.holds[int_id] <= 0:
            del self.holds[int_id]

    def remove(self, int_id: int) -> bool:
        """Unload an adapter; refused (UserError) while requests hold it. False: it was not loaded."""
        if self.holds[int_id] > 0:
            name = self.adapters[int_id].name if int_id in self.adapters else str(int_id)
            raise UserError(f"LoRA adapter {name!r} is in use by {self.holds[int_id]} running request(s)")
        self._stacks.clear()
        return self.adapters.pop(int_id, None) is not None

    def _stacked(self, ids: tuple[int, ...]) -> dict[LoRAKey, Stacked]:
        """Per matmul, the adapters `ids`' A and B stacked along R and transposed (a = A.T [in, sum R], b = B.T
        [sum R, out], float32: LoRAStack), and each column's adapter (its index in ids)."""
        got = self._stacks.get(ids)
        if got is not None:
            self._stacks.move_to_end(ids)
            return got
        adapters = [self.adapters[i] for i in ids]
        got = {}
        owners: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}  # one tensor per column layout: masks share
        for key in dict.fromkeys(k for lora in adapters for k in lora.weights):
            parts = [(j, lora.weights[key]) for j, lora in enumerate(adapters) if key in lora.weights]
            a = torch.cat([w.a for _, w in parts]).T.float().contiguous()  # [in, sum R]
            b = torch.cat([w.b for _, w in parts], dim=1).T.float().contiguous()  # [sum R, out]
            layout = tuple((j, w.a.shape[0]) for j, w in parts)
            if layout not in owners:
                cols = [torch.full((r,), j, dtype=torch.long) for j, r in layout]
                owners[layout] = torch.cat(cols).to(a.device)
            got[key] = (a, b, owners[layout])
        self._stacks[ids] = got
        while len(self._stacks) > 4:
            self._stacks.popitem(last=False)
        return got

    def fused_step(self, ids: list[int], lens: list[int], group_rows: int) -> FusedLoRA:
        """The LoRA rows of a step for the fused C step: chunk i (lens[i] rows, in order) under adapter ids[i] (0:
        the base, whose rows the step leaves alone); each adapter's rows together, in groups of at most
        `group_rows` (the rows that share each read of its matrices: sgmv for a prefill chunk or many decode
        tokens, bgmv for one)."""
        present = sorted(set(ids) - {0})
        half = self.lora_dtype == torch.bfloat16
        mats = [fused_mats(self.adapters[i], len(self.model.decoder_layers), self.lora_dtype) for i in present]
        slot = {lid: j for j, lid in enumerate(present)}
        owner = np.repeat(np.array([slot.get(i, -1) for i in ids], dtype=np.int64), lens)
        rows = np.flatnonzero(owner >= 0)
        rows = rows[np.argsort(owner[rows], kind="stable")].astype(np.int64)
        counts = np.bincount(owner[rows], minlength=len(present)).tolist()
        groups, first = [], 0
        for j, count in enumerate(counts):
            groups += [(j, first + k, min(group_rows, count - k)) for k in range(0, count, group_rows)]
            first += count
        grp = np.array(groups, dtype=np.int64).reshape(-1)
        max_rank = max(m.max_rank for m in mats)
        tmp = np.empty(len(owner) * max_rank, dtype=np.float32)
        tables = (ctypes.c_void_p * len(mats))(*[ctypes.addressof(m.table) for m in mats])
        step = _Step(
            adapters=ctypes.addressof(tables),
            rows=rows.ctypes.data,
            groups=grp.ctypes.data,
            tmp=tmp.ctypes.data,
            A=len(mats),
            n=len(rows),
            G=len(groups),
            max_rank=max_rank,
            layers=len(self.model.decoder_layers),
            bf16=int(half),
        )
        return FusedLoRA(step, [mats, tables, rows, grp, tmp])

    @contextmanager
    def run(self, ids: list[int], lens: list[int], device: torch.device) -> Iterator[None]:
        """While inside, rows of chunk i (lens[i] of them, in order) run under adapter ids[i] (0: the base)."""
        present = tuple(sorted(set(ids) - {0}))
        slot = {lid: j for j, lid in enumerate(present)}
        starts = np.cumsum([0, *lens]).tolist()
        rows: list[int] = []
        owner: list[int] = []
        for i, (lid, n) in enumerate(zip(ids, lens)):
            if lid:
                rows.extend(range(starts[i], starts[i] + n))
                owner.extend([slot[lid]] * n)
        row_owner = torch.tensor(owner, dtype=torch.long, device=device)
        masks: dict[int, torch.Tensor] = {}  # by the column owners' identity: layers of one layout share one
        stacks = {}
        for key, (at, bt, col_owner) in self._stacked(present).items():
            mask = None
            if len(present) > 1:
                mask = masks.get(id(col_owner))
                if mask is None:
                    mask = masks[id(col_owner)] = (row_owner[:, None] == col_owner[None, :]).float()
            stacks[key] = LoRAStack(at, bt, mask)
        self.batch.rows, self.batch.stacks = torch.tensor(rows, dtype=torch.long, device=device), stacks
        self.batch.all_rows = len(rows) == starts[-1]
        try:
            yield
        finally:
            self.batch.rows, self.batch.stacks, self.batch.all_rows = None, {}, False
