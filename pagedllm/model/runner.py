"""`ModelRunner`: the one interface the engine calls. It owns the KV cache tensors and runs one step.

A step is a list of `SeqChunk`s, each a sequence's new tokens after `start_pos` already-cached tokens (computed
earlier or taken from the prefix cache) with the block table covering them. Prefill chunks and single decode
tokens mix freely in one flat batch. Block allocation, scheduling and sampling belong to the engine.

A hybrid model's linear-attention layers (layers/deltanet.py) keep a recurrent state per request instead of KV:
the runner owns `num_state_slots` rows of each layer's states, a chunk names its request's slot (the KV manager
hands them out: kv/state_slots.py), and a chunk at position 0 starts from zeros. The new states are written back
only once the whole step ran, so a step that raises leaves every slot as it was.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import pagedllm.model.kernels.kv_quant as kv_quant
from pagedllm.kv.kv_spec import KVCacheLayout
from pagedllm.kv.sizing import kv_bytes_per_block
from pagedllm.model.config import ModelConfig
from pagedllm.model.fused_step import FusedStep, fusable
from pagedllm.model.layers.attention import AttentionMetadata, StepIndex, build_metadata, group_step_index
from pagedllm.model.layers.deltanet import RecurrentStep
from pagedllm.model.layers.rope import shift_rotary
from pagedllm.model.loader import LoadedModel
from pagedllm.model.lora import LoRAManager


@dataclass
class SeqChunk:
    """New tokens of one sequence for this step."""

    token_ids: list[int]  # the new tokens to compute this step
    start_pos: int  # tokens of this sequence already in the cache (computed or prefix-cached)
    block_table: list[int]  # block ids covering at least start_pos + len(token_ids) tokens
    all_logits: bool = False  # logits for every new token, not only the last: prompt logprobs, and drafts to verify
    # Every KV-cache group's table, where the runner's layout has more than one (block_table is group 0's)
    group_tables: list[list[int]] | None = None
    # A hybrid model's recurrent-state slot of this sequence; None: the chunk's index in the step (tools, warm-up)
    state_slot: int | None = None
    lora_int_id: int = 0  # the LoRA adapter its tokens run under (0: the base model)
    # A hybrid model's prefix-cache checkpoints inside the chunk (--mamba-cache-mode all): (t, row) pairs, t
    # ascending with 0 < t < len(token_ids), to copy its recurrent state after its first t tokens into state row
    # `row` when the step commits
    state_marks: list[tuple[int, int]] | None = None

    def tables(self, num_groups: int) -> list[list[int]]:
        if self.group_tables is not None:
            return self.group_tables
        if num_groups != 1:
            raise ValueError(f"a chunk of {num_groups} KV-cache groups needs a block table for each")
        return [self.block_table]

    @property
    def num_logits(self) -> int:
        return len(self.token_ids) if self.all_logits else 1


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor that costs nothing until written: on a CPU, anonymous memory the OS zero-fills a page at
    a time on first touch. Why: `torch.zeros` writes every byte of the KV cache at start-up (the default budget
    is GiBs: seconds before the first answer, all of it resident at once); here only the blocks that requests
    use become resident, and reading an untouched one gives zeros all the same."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps `buf` alive


def bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: str, layout: KVCacheLayout | None = None) -> int:
    """Bytes per block of a cache of that --kv-cache-dtype name, as kv/sizing counts them: a block spans the
    layout's layers per block (every layer that stores KV, for a model of one group)."""
    layers = (layout or config.kv_layout()).layers_per_block
    return kv_bytes_per_block(layers, *config.kv_slot_shape, kv_dtype, block_size)


def layer_view(cache: torch.Tensor, cfg: ModelConfig, layer: int) -> torch.Tensor:
    """Layer `layer`'s [blocks, block_size, its KV heads, its row] view of a slot's cache tensor: the tensor itself
    where the layer has the slot's shape, else the front of each token's row (Gemma 4's layers of two shapes
    share slots, sized for the larger: ModelConfig.kv_slot_shape)."""
    nb, bs = cache.shape[:2]
    shape = kv_quant.cache_shape(nb, bs, cfg.layer_kv_heads(layer), cfg.layer_head_dim(layer), cache.dtype)
    if shape == tuple(cache.shape):
        return cache
    row = shape[2] * shape[3]
    if row > cache.shape[2] * cache.shape[3]:
        raise ValueError(f"layer {layer}'s KV rows of {row} do not fit a cache slot of {cache.shape[2:]}")
    return cache.view(nb, bs, -1)[..., :row].view(shape)


class ModelRunner:
    """Allocates [num_blocks, block_size, kv_heads, head_dim] K and V tensors per layer (head_dim + 2 bytes for a
    quantized cache: kv_quant.py); `execute` runs a step."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int,
        block_size: int,
        kv_dtype: torch.dtype | None = None,
        fused: bool = True,
        layout: KVCacheLayout | None = None,
        num_state_slots: int = 8,
    ) -> None:
        """`fused`: run the steps of a quantized model as one C call each (fused_step.py) where it can. `layout`:
        the KV-cache groups (default: one group of every layer); a chunk then brings one table per group.
        `num_state_slots`: recurrent-state rows of a hybrid model's linear layers (the engine: max_num_seqs)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.loaded = loaded
        self.model = loaded.model
        self.config = loaded.config
        self.device = loaded.device
        self.dtype = loaded.dtype
        self.kv_dtype = kv_dtype or loaded.dtype  # the cache may be narrower than the model (--kv-cache-dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        cfg = self.config
        self.layout = layout or cfg.kv_layout()
        shape = kv_quant.cache_shape(num_blocks, block_size, *cfg.kv_slot_shape, self.kv_dtype)
        # One (K, V) pair per slot of a block; a layer reads its slot's, with its group's table (kv_spec.py)
        self.kv_tensors: list[tuple[torch.Tensor, torch.Tensor]] = [
            (zeroed(shape, self.kv_dtype, self.device), zeroed(shape, self.kv_dtype, self.device))
            for _ in range(self.layout.layers_per_block)
        ]
        self.kv_caches = [  # per model layer
            (layer_view(k, cfg, i), layer_view(v, cfg, i))
            for i, (k, v) in enumerate(self.kv_tensors[slot] for slot in self.layout.layer_slot)
        ]
        # model layer -> its (conv, recurrent) states, one row per slot, for a hybrid model's linear layers
        self.states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i in cfg.linear_layers:
            mixer = self.model.decoder_layers[i].linear_attn
            assert mixer is not None
            conv, rec = mixer.state_shapes()
            self.states[i] = (
                torch.zeros((num_state_slots, *conv), dtype=self.dtype, device=self.device),
                torch.zeros((num_state_slots, *rec), dtype=torch.float32, device=self.device),
            )
        self.num_state_slots = num_state_slots if self.states else 0
        self.fused = (
            FusedStep(self.model, self.kv_caches, block_size, self.layout.layer_group, self.states)
            if fused and fusable(self.model, self.kv_caches, self.states)
            else None
        )
        self.lora: LoRAManager | None = None  # set by enable_lora

    def enable_lora(self, max_lora_rank: int, max_cpu_loras: int, lora_dtype: torch.dtype | None = None) -> LoRAManager:
        """Let chunks run under LoRA adapters (SeqChunk.lora_int_id), loaded into the returned manager (their
        values in `lora_dtype`: LoRAManager)."""
        self.lora = LoRAManager(self.model, max_lora_rank, max_cpu_loras, lora_dtype)
        return self.lora

    def _lora_ids(self, chunks: list[SeqChunk]) -> list[int] | None:
        """Each chunk's adapter id when any chunk has one (else None: a base-only step)."""
        ids = [c.lora_int_id for c in chunks]
        if not any(ids):
            return None
        if self.lora is None:
            raise ValueError("a chunk asks for a LoRA adapter but LoRA is not enabled")
        return ids

    @property
    def state_row_bytes(self) -> int:
        """Bytes of one state row over every linear layer (0 without them): a checkpoint's, laid across blocks."""
        return sum(
            conv[0].numel() * conv.element_size() + rec[0].numel() * rec.element_size()
            for conv, rec in self.states.values()
        )

    def _block_bytes(self, block_ids: Sequence[int]) -> list[torch.Tensor]:
        """The K/V memory of blocks `block_ids`, every slot's, as raw byte views (a quantized row's scale too)."""
        return [t[b].view(-1).view(torch.uint8) for b in block_ids for pair in self.kv_tensors for t in pair]

    def _state_bytes(self, row: int) -> list[torch.Tensor]:
        return [t[row].view(-1).view(torch.uint8) for pair in self.states.values() for t in pair]

    @torch.inference_mode()
    def state_to_blocks(self, row: int, block_ids: Sequence[int]) -> None:
        """Lay state row `row`'s bytes across the memory of blocks `block_ids` (a prefix-cache checkpoint stored in
        pool blocks: kv/state_slots.py); the blocks' bytes past the state's are left as they are."""
        _copy_bytes(torch.cat(self._state_bytes(row)), self._block_bytes(block_ids))

    @torch.inference_mode()
    def blocks_to_state(self, block_ids: Sequence[int], row: int) -> None:
        """Fill state row `row` from the bytes `state_to_blocks` laid across blocks `block_ids`."""
        _copy_bytes(torch.cat(self._block_bytes(block_ids)), self._state_bytes(row))

    @property
    def bytes_per_token(self) -> int:
        """What its tensors hold per token: a K and a V row per layer slot (with a quantized row's scale)."""
        k, _ = self.kv_tensors[0]
        return 2 * len(self.kv_tensors) * k[0, 0].numel() * k.element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def read_block(self, block_id: int) -> bytes:
        """A copy of one block's K and V in every slot, as bytes (what the disk tier stores)."""
        parts = [t[block_id].reshape(-1).view(torch.uint8) for pair in self.kv_tensors for t in pair]
        return torch.cat(parts).cpu().numpy().tobytes()

    def write_block(self, block_id: int, data: bytes) -> None:
        """Fill one block from `read_block`'s bytes (a block read back from the disk tier)."""
        if len(data) != self.bytes_per_block:
            raise ValueError(f"a block holds {self.bytes_per_block} bytes, got {len(data)}")
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        offset = 0
        for pair in self.kv_tensors:
            for t in pair:
                dst = t[block_id].view(-1).view(torch.uint8)
                dst.copy_(src[offset : offset + dst.numel()])
                offset += dst.numel()

    @property
    def can_shift_keys(self) -> bool:
        """Whether a stored key can be moved to another position by a rotation alone: not under dynamic NTK
        scaling, whose frequencies depend on the position itself (kv_blend is then off)."""
        return not any(getattr(rope, "dynamic", False) for rope in self.model.ropes.values())

    @torch.inference_mode()
    def copy_kv(self, src_slots: list[int], dst_slots: list[int], delta: int) -> None:
        """Copy the K/V rows of cache slots `src_slots` to `dst_slots` in every layer, the keys moved `delta`
        positions (RoPE composed by `shift_rotary`; a NoPE layer's keys are copied as they are). This is how a
        reused passage's KV lands where the passage sits in a prompt, and how a computed one is stored at
        position 0. A quantized cache holds each row after RoPE and after kv_quant's Hadamard rotation: its keys
        are dequantized (which undoes that rotation), shifted, then quantized again (one more rounding); values
        carry no position and are copied as bytes, so they stay exact on every dtype."""
        if not src_slots:
            return
        src = torch.tensor(src_slots, dtype=torch.long, device=self.device)
        dst = torch.tensor(dst_slots, dtype=torch.long, device=self.device)
        shift = torch.full((len(src_slots),), delta, dtype=torch.long, device=self.device)
        quantized = kv_quant.is_quantized(self.kv_dtype)
        for i, (layer, (kc, vc)) in enumerate(zip(self.model.decoder_layers, self.kv_caches)):
            if self.layout.kv_source[i] != i:
                continue  # its KV is its source's, moved with it
            kflat = kc.view(-1, *kc.shape[2:])
            vflat = vc.view(-1, *vc.shape[2:])
            vflat[dst] = vflat[src]
            rows = kflat[src]
            rope = self.model.ropes.get(layer.rope)  # none for NoPE layers (the decoder applies none then)
            if rope is None or delta == 0:
                kflat[dst] = rows
                continue
            inv_freq = rope.inv_freq
            if quantized:
                moved = shift_rotary(kv_quant.dequantize(rows, self.kv_dtype), inv_freq, shift)
                kflat.view(torch.uint8)[dst] = kv_quant.quantize(moved, self.kv_dtype)
            else:
                kflat[dst] = shift_rotary(rows.float(), inv_freq, shift).to(kc.dtype)

    @torch.inference_mode()
    def _forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        lens = [len(c.token_ids) for c in chunks]
        if any(n == 0 for n in lens):
            raise ValueError("every SeqChunk needs at least one new token")
        starts = [c.start_pos for c in chunks]
        by_group = self._group_tables(chunks)
        ixs = group_step_index(lens, starts, by_group, self.block_size)  # one builder for the fused and torch path
        lora_ids = self._lora_ids(chunks)
        if self.fused is not None:
            lora = None
            if lora_ids is not None:
                assert self.lora is not None
                lora = self.lora.fused_step(lora_ids, lens, self.fused.lora_group_rows)
            toks = [c.token_ids for c in chunks]
            slots, marks = (self._state_slots(chunks), self._state_marks(chunks)) if self.states else (None, None)
            return self.fused.run(toks, starts, by_group, [c.num_logits for c in chunks], ixs, lora, slots, marks)
        ids: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
        meta = self._metadata(lens, starts, by_group, ixs)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        rows: list[int] = []
        end = 0
        for c in chunks:
            end += len(c.token_ids)
            rows.extend(range(end - c.num_logits, end))
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        recurrent = self._recurrent(chunks)
        if lora_ids is None:
            logits = self.model(input_ids, meta, self.kv_caches, index, recurrent)
        else:
            assert self.lora is not None
            with self.lora.run(lora_ids, lens, self.device):
                logits = self.model(input_ids, meta, self.kv_caches, index, recurrent)
        if recurrent is not None:
            recurrent.commit()
        return logits

    def _state_marks(self, chunks: list[SeqChunk]) -> list[list[tuple[int, int]]]:
        """Each chunk's (t, row) state marks, checked: offsets ascending inside the chunk, rows distinct rows of
        the state tensors and none of the step's slots (both paths write a mark's row beside the slots)."""
        marks = [c.state_marks or [] for c in chunks]
        rows = [r for m in marks for _, r in m]
        for c, m in zip(chunks, marks):
            ts = [t for t, _ in m]
            if ts != sorted(set(ts)) or not all(0 < t < len(c.token_ids) for t in ts):
                raise ValueError(f"state marks {ts} are not ascending offsets inside a chunk of {len(c.token_ids)}")
        slots = set(self._state_slots(chunks))
        if len(set(rows)) != len(rows) or not all(0 <= r < self.num_state_slots and r not in slots for r in rows):
            raise ValueError(f"state mark rows {rows} are not distinct rows of {self.num_state_slots} apart from slots")
        return marks

    def _recurrent(self, chunks: list[SeqChunk]) -> RecurrentStep | None:
        """The step's state slots (None for a model without linear-attention layers)."""
        if not self.states:
            return None
        marks = self._state_marks(chunks)
        rows = [r for m in marks for _, r in m]
        return RecurrentStep(
            torch.tensor(self._state_slots(chunks), dtype=torch.long, device=self.device),
            [len(c.token_ids) for c in chunks],
            [c.start_pos == 0 for c in chunks],
            caches=self.states,
            marks=[[t for t, _ in m] for m in marks] if rows else [],
            mark_rows=torch.tensor(rows, dtype=torch.long, device=self.device) if rows else None,
        )

    def _state_slots(self, chunks: list[SeqChunk]) -> list[int]:
        """Each chunk's recurrent-state slot (its index in the step where it names none), checked distinct."""
        slots = [i if c.state_slot is None else c.state_slot for i, c in enumerate(chunks)]
        if len(set(slots)) != len(slots) or not all(0 <= s < self.num_state_slots for s in slots):
            raise ValueError(f"state slots {slots} are not distinct slots of {self.num_state_slots}")
        return slots

    def _group_tables(self, chunks: list[SeqChunk]) -> list[list[list[int]]]:
        """Per KV-cache group, each chunk's table."""
        per_chunk = [c.tables(len(self.layout.groups)) for c in chunks]
        return [[t[g] for t in per_chunk] for g in range(len(self.layout.groups))]

    def _metadata(
        self,
        lens: list[int],
        starts: list[int],
        by_group: list[list[list[int]]],
        ixs: list[StepIndex] | None = None,
    ) -> AttentionMetadata | list[AttentionMetadata]:
        """The step's attention metadata: one for a model of one group, else each layer its group's."""
        ixs = ixs or group_step_index(lens, starts, by_group, self.block_size)
        metas = [build_metadata(lens, starts, t, self.block_size, self.device, ix) for t, ix in zip(by_group, ixs)]
        return metas[0] if len(metas) == 1 else [metas[g] for g in self.layout.layer_group]

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """float32 logits for the last new token of each chunk (every new token of an `all_logits` chunk), in
        chunk order: [sum(c.num_logits), vocab]; writes K/V of all of them."""
        if not chunks:
            return torch.empty(0, self.config.vocab_size, dtype=torch.float32, device=self.device)
        return self._forward(chunks)

    @torch.inference_mode()
    def execute_hidden(self, chunks: list[SeqChunk]) -> list[torch.Tensor]:
        """Final (normed) hidden states, float32, of every new token: one [len(token_ids), hidden] tensor per
        chunk, for pooling requests (embeddings); writes their K/V as `execute` does. Always the torch path: the
        fused C step returns logits only."""
        lens = [len(c.token_ids) for c in chunks]
        if not chunks or any(n == 0 for n in lens):
            raise ValueError("execute_hidden needs chunks of at least one new token")
        ids = [t for c in chunks for t in c.token_ids]
        meta = self._metadata(lens, [c.start_pos for c in chunks], self._group_tables(chunks))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        lora_ids = self._lora_ids(chunks)
        recurrent = self._recurrent(chunks)
        if lora_ids is None:
            h = self.model.hidden_states(input_ids, meta, self.kv_caches, recurrent)
        else:
            assert self.lora is not None
            with self.lora.run(lora_ids, lens, self.device):
                h = self.model.hidden_states(input_ids, meta, self.kv_caches, recurrent)
        if recurrent is not None:
            recurrent.commit()
        return list(self.model.norm(h).float().split(lens))


def _copy_bytes(src: torch.Tensor, dst: list[torch.Tensor]) -> None:
    """`src`'s bytes into the views `dst` in order, until `src` ends. An empty view (a short-conv layer's recurrent
    state: it has none) takes nothing and the copy goes on past it."""
    offset = 0
    for view in dst:
        if offset >= src.numel():
            break
        n = min(view.numel(), src.numel() - offset)
        view[:n].copy_(src[offset : offset + n])
        offset += n
