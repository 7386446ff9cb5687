"""One forward's per-step inputs, built once and read by every layer (nano-vllm's utils/context.py is the model):
positions, rotary cos/sin, the cache and the slots to write, the attention mask and how many cache slots it
covers. The target and the EAGLE-3 drafter build theirs with the same `forward_context` and `attention_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from specscope.runtime.kv_cache import KVCache


class RowInputs(NamedTuple):
    """The per-token inputs in the row kernels' layout (one sequence): cos/sin [T, D], slots [T], mask [T, S] or
    None."""
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class ForwardContext:
    positions: torch.Tensor            # [B, T] position ids
    cos: torch.Tensor                  # [B, 1, T, D] in the activations' dtype
    sin: torch.Tensor
    cache: KVCache | None = None
    slots: torch.Tensor | None = None  # [B, T] cache slots the new keys/values go to
    mask: torch.Tensor | None = None   # bool [B, T, S] (True = may attend); None = all of 0..kv_len-1
    kv_len: int = 0                    # cache slots 0..kv_len-1 are attended over

    def attend(self, attn, q, k, v) -> torch.Tensor:
        """attn's queries q [B, Hq, T, D] over this step's keys and values (k, v [B, Hkv, T, D]) and the cached
        ones -> [B, T, Hq * D]. Where keys live is the step's business: the cache here, the unrolled steps'
        keys in training (train/ttt.py)."""
        B, _, T, _ = q.shape
        if self.cache is not None:
            self.cache.write(attn.layer, self.slots, k, v)
            k, v = self.cache.k[attn.layer, :B, :, :self.kv_len], self.cache.v[attn.layer, :B, :, :self.kv_len]
            k, v = k.to(q.dtype), v.to(q.dtype)   # a bf16 cache under fp32 activations (the bf16 precision)
        attn_mask = self.mask[:, None] if self.mask is not None else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=attn.n_kv != attn.n_heads)
        return y.transpose(1, 2).reshape(B, T, attn.q_size)

    @cached_property
    def rows(self) -> RowInputs:
        """Sequence 0's inputs for the row kernels (models/kernels.py), sliced once for all layers."""
        return RowInputs(self.cos[0, 0], self.sin[0, 0], self.slots[0].contiguous(),
                         None if self.mask is None else self.mask[0].contiguous())


def region_inputs(parts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward over several sequences, each in its own region of one cache: parts are (positions [n],
    slots [n] and mask [n, S_local] in the region's own coordinates, the region's first slot). -> positions and
    slots [1, N], mask [1, N, S] with each part's block at its region's columns and nothing else open, so a row
    attends to its own sequence only (the row kernels then give it the bits it gets alone)."""
    if len(parts) == 1 and parts[0][3] == 0:     # one sequence at the cache's start: its own inputs as they are
        pos, slots, mask, _ = parts[0]
        return pos[None], slots[None], mask[None]
    N = sum(int(p[0].numel()) for p in parts)
    S = max(base + mask.shape[1] for _, _, mask, base in parts)
    out = torch.zeros(N, S, dtype=torch.bool, device=parts[0][0].device)
    r = 0
    for pos, _, mask, base in parts:
        n = pos.numel()
        out[r:r + n, base:base + mask.shape[1]] = mask
        r += n
    return (torch.cat([p[0] for p in parts])[None], torch.cat([p[1] + p[3] for p in parts])[None], out[None])


def attention_mask(positions: torch.Tensor, cache: KVCache | None, slots, mask, window: int | None,
                   slot_positions: bool = False, lazy_window: bool = False):
    """(mask or None, kv_len) for queries at `positions` [B, T] written to `slots`.

    The caller's mask, else causal: over the given tokens without a cache, over slots with one (when more than
    one token is new, or a window will apply). A sliding `window` then hides keys `window` or more
    positions back. Key positions are what the cache recorded for each slot, or with `slot_positions` the slot
    indices themselves (the drafter's cache: its committed slots are positions and tree nodes sit within `depth`
    of their query). `lazy_window` applies the window only once it can hide something (the drafter's choice; the
    target also masks a one-token decode step)."""
    T = positions.shape[1]
    if cache is None:
        kv_len, kpos = 0, positions[:, None, :]
        if mask is None:
            mask = positions[:, None, :] <= positions[:, :, None]
    else:
        kv_len = mask.shape[-1] if mask is not None else int(slots.max()) + 1
        if mask is None and (T > 1 or (window and not lazy_window)):
            mask = torch.arange(kv_len, device=slots.device)[None, None, :] <= slots[:, :, None]
        kpos = torch.arange(kv_len, device=slots.device)[None, None, :] if slot_positions \
            else cache.pos[:positions.shape[0], :kv_len][:, None, :]
    if not window or (lazy_window and max(kv_len, T) <= window):
        return mask, kv_len
    near = (positions[:, :, None] - kpos) < window
    return (near if mask is None else mask & near), kv_len


def forward_context(positions: torch.Tensor, rope: Callable[[int], torch.Tensor], dtype: torch.dtype,
                    cache: KVCache | None = None, slots=None, mask=None, window: int | None = None,
                    slot_positions: bool = False, lazy_window: bool = False) -> ForwardContext:
    """The context of one forward over `positions` [B, T]: slots default to the positions; with a cache (and not
    `slot_positions`) each slot's position is recorded for later windows. rope(n): the [2, P, D] float32 table
    covering positions below n (the drafter grows its own)."""
    if cache is not None:
        if slots is None:
            slots = positions
        if not slot_positions:
            cache.pos[:positions.shape[0]].scatter_(1, slots, positions)
    mask, kv_len = attention_mask(positions, cache, slots, mask, window, slot_positions, lazy_window)
    # with a cache every position sits at or below its slot, so kv_len bounds them without a device sync
    table = rope(kv_len + 1 if cache is not None else int(positions.max()) + 1)
    cos, sin = table[0][positions].to(dtype)[:, None], table[1][positions].to(dtype)[:, None]
    return ForwardContext(positions, cos, sin, cache, slots, mask, kv_len)
