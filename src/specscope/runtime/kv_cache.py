"""A preallocated key/value cache.

Storage is [layers, batch, kv_heads, max_len, head_dim]; tokens are written at explicit slots, so a whole draft
tree can occupy slots past the committed length, and `compact` moves the accepted ones into place. The storage is
allocated once for the request's length and never reallocated.
"""

from __future__ import annotations

import torch

from specscope.errors import SpecscopeError


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_len: int,
                 batch: int = 1, device="cpu", dtype=torch.float32):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._rows = (None, None, [], [])
        # position id held by each slot (-1 = empty); used for sliding-window masks
        self.pos = torch.full((batch, max_len), -1, dtype=torch.long, device=device)
        self.max_len = max_len
        self.length = 0  # committed tokens (batch row 0; batched callers track their own lengths)

    @classmethod
    def for_model(cls, cfg, max_len: int, batch: int = 1, device="cpu", dtype=torch.float32) -> "KVCache":
        return cls(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_len, batch, device, dtype)

    def _row_views(self):
        if self._rows[0] is not self.k or self._rows[1] is not self.v:   # (re)made whenever the storage changes
            self._rows = (self.k, self.v, list(self.k[:, 0]), list(self.v[:, 0]))
        return self._rows

    @property
    def k_rows(self) -> list[torch.Tensor]:
        """Per-layer views of sequence 0, [kv_heads, max_len, head_dim] (what the CPU row kernels take)."""
        return self._row_views()[2]

    @property
    def v_rows(self) -> list[torch.Tensor]:
        return self._row_views()[3]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """k, v: [B, Hkv, T, D] written at slots [B, T] (rounded to the cache's dtype, e.g. a bf16 cache)."""
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if k.shape[0] == 1:
            self.k[layer, 0].index_copy_(1, slots[0], k[0])
            self.v[layer, 0].index_copy_(1, slots[0], v[0])
        else:
            b = torch.arange(k.shape[0], device=k.device)[:, None]
            self.k[layer][b, :, slots] = k.transpose(1, 2)
            self.v[layer][b, :, slots] = v.transpose(1, 2)

    def check_room(self, needed: int):
        if needed > self.max_len:
            raise SpecscopeError(
                f"sequence needs {needed} KV slots but the cache holds {self.max_len}; "
                f"shorten the prompt or lower --max-new-tokens")

    def compact(self, keep_slots: list[int], dst: int | None = None, end: int | None = None):
        """Move the entries at `keep_slots` (ascending, all >= dst) to dst.., and mark dst + len(keep)..end - 1
        empty. By default dst is the committed length, which then grows by what was kept, and end the cache's
        (one sequence in a cache of its own); the batched engine passes its sequence's region."""
        n = len(keep_slots)
        own = dst is None
        dst = self.length if own else dst
        if keep_slots != list(range(dst, dst + n)):
            keep = torch.tensor(keep_slots, dtype=torch.long, device=self.k.device)
            self.k[:, 0, :, dst:dst + n] = self.k[:, 0, :, keep]
            self.v[:, 0, :, dst:dst + n] = self.v[:, 0, :, keep]
            self.pos[0, dst:dst + n] = self.pos[0, keep]
        if own:
            self.length += n
        self.pos[0, dst + n:end] = -1

    def truncate(self, length: int):
        self.length = length
        self.pos[:, length:] = -1
