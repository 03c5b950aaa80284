"""Which layers keep which KV, and how one block pool serves them all (vLLM v1's KV-cache groups).

Layers attend alike in kinds: full attention, or a sliding window of w tokens. A block of the pool is one
block_size-token page of `layers_per_block` layers' K and V: the cache holds that many tensors (slots), and a
group is at most that many layers of one kind, its i-th layer in slot i (vLLM's uniform page size). Every group
has its own block table per request, so the blocks a sliding group no longer reads go back to the pool while the
full group keeps its own. A model of one kind is one group of every layer: one table, as a dense model always
had. A layer that reads another's KV (Gemma 4's shared layers) has no slot of its own: it reads its source's.

Why groups of equal size: every block of the pool must have the same size to be handed to any group; layers of
the kind with fewer layers set the size (or the larger count where the two are close, vLLM's 1.25 rule), so no
more than a few slots of a block go unused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that attend alike and share one block table: full attention (window None), or one sliding window."""

    window: int | None
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        return "full attention" if self.window is None else f"sliding window {self.window}"


@dataclass(frozen=True)
class KVCacheLayout:
    """The groups over one pool, and where each model layer's K/V live."""

    groups: tuple[KVCacheGroup, ...]
    layers_per_block: int  # cache tensors (slots): the layers one block id spans in a group
    layer_group: tuple[int, ...]  # per model layer: the group whose table it reads (its source's, if shared)
    layer_slot: tuple[int, ...]  # per model layer: the cache tensor it reads and writes
    kv_source: tuple[int, ...]  # per model layer: the layer whose KV it reads (itself unless shared)
    # model layers that keep a recurrent state instead of KV (linear attention: kv/state_slots.py); no group,
    # their layer_group / layer_slot entries are 0 and never read
    recurrent_layers: tuple[int, ...] = ()
    mlp_only_layers: tuple[int, ...] = ()  # model layers without a mixer (Nemotron-H's MLP blocks): no KV, no state

    @property
    def num_kv_layers(self) -> int:
        """Layers that store KV (a shared layer stores none)."""
        return sum(len(g.layers) for g in self.groups)

    def kinds(self) -> list[KVCacheGroup]:
        """The groups merged per kind (window): what kv-calc and /kv show as one line each."""
        by_window: dict[int | None, list[int]] = {}
        for g in self.groups:
            by_window.setdefault(g.window, []).extend(g.layers)
        return [KVCacheGroup(w, tuple(sorted(layers))) for w, layers in by_window.items()]


def kv_sources(windows: Sequence[int | None], num_kv_shared_layers: int = 0) -> list[int]:
    """Gemma 4's rule (transformers' kv_sharing_modes): the last `num_kv_shared_layers` layers read the KV of the
    last earlier layer of their own kind; every other layer its own."""
    n = len(windows)
    first = n - num_kv_shared_layers
    if num_kv_shared_layers <= 0:
        return list(range(n))
    if first <= 0:
        raise ValueError(f"num_kv_shared_layers {num_kv_shared_layers} leaves no layer of {n} to store KV")
    sources = list(range(n))
    for i in range(first, n):
        own = [j for j in range(first) if windows[j] == windows[i]]
        if not own:
            raise ValueError(f"layer {i} shares the KV of a kind ({windows[i]}) that no earlier layer stores")
        sources[i] = own[-1]
    return sources


def _group_size(counts: list[int]) -> int:
    """vLLM's rule: the smallest kind's layer count, or the largest where no kind has 1.25x the smallest."""
    lo, hi = min(counts), max(counts)
    return hi if hi < lo * 1.25 else lo


def kv_cache_layout(
    windows: Sequence[int | None],
    sources: Sequence[int] | None = None,
    hybrid: bool = True,
    recurrent: Sequence[int] = (),
    mlp_only: Sequence[int] = (),
) -> KVCacheLayout:
    """The layout for layers whose windows are `windows` (None: full) and which read the KV of `sources` (default:
    their own). `hybrid=False` (vLLM's --disable-hybrid-kv-cache-manager) makes one group of every layer whose
    blocks all stay to the end: the windows are then a mask only, nothing is freed. `recurrent`: layers that store
    no KV at all (a state slot each request holds instead); `mlp_only`: layers without a mixer, no KV nor state."""
    n = len(windows)
    src = list(sources) if sources is not None else list(range(n))
    own = [i for i in range(n) if src[i] == i and i not in recurrent and i not in mlp_only]
    kinds: dict[int | None, list[int]] = {}
    for i in own:
        kinds.setdefault(windows[i] if hybrid else None, []).append(i)
    order = sorted(kinds, key=lambda w: -1 if w is None else w)  # full attention first, then by window
    size = _group_size([len(kinds[w]) for w in order]) if kinds else 1
    groups: list[KVCacheGroup] = []
    layer_group, layer_slot = [0] * n, [0] * n
    for w in order:
        layers = kinds[w]
        for start in range(0, len(layers), size):
            chunk = tuple(layers[start : start + size])
            for slot, layer in enumerate(chunk):
                layer_group[layer], layer_slot[layer] = len(groups), slot
            groups.append(KVCacheGroup(w, chunk))
    for i in range(n):
        layer_group[i], layer_slot[i] = layer_group[src[i]], layer_slot[src[i]]
    return KVCacheLayout(
        tuple(groups), size, tuple(layer_group), tuple(layer_slot), tuple(src), tuple(recurrent), tuple(mlp_only)
    )


def window_blocks(num_tokens: int, window: int | None, block_size: int) -> int:
    """Blocks a group's table holds for a request of `num_tokens` tokens once those out of its next token's window
    went back (the sliding manager's rule); all of them without a window."""
    held = cdiv(num_tokens, block_size)
    if window is None:
        return held
    return held - max(0, (num_tokens - window + 1) // block_size)
