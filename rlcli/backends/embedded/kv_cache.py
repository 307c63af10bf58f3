"""The embedded engine's KV cache: one dense, preallocated tensor of keys and values per layer.

Active sequences always occupy rows ``0..B-1`` ("slot compaction": when a sequence finishes, the
last active rows move into the freed rows, see :meth:`KVCache.move_rows`), so decode attention
reads the contiguous views ``cache[:B, :, :L]`` with no gather. No paging: the cache is sized
``max_batch_size x max_model_len``.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated keys and values: per layer ``[rows, kv_heads, max_len, head_dim]``.

    Zero-initialised: attention reads ``cache[:B, :, :L]`` and masks the positions a row has
    not written, and a masked position still contributes ``0 * value``, so every value must be
    finite (uninitialised memory can hold NaN). Positions a row has not written hold zeros or a
    previous occupant's (finite) values. ``free()`` releases the memory (sleep) and
    ``allocate()`` restores it; contents are not preserved.
    """

    def __init__(
        self, n_layers: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device
    ):
        self.shape = (rows, kv_heads, max_len, head_dim)
        self.n_layers, self.dtype, self.device = n_layers, dtype, torch.device(device)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self._buffer: torch.Tensor | None = None
        self.allocate()

    @property
    def allocated(self) -> bool:
        return self._buffer is not None

    @property
    def address(self) -> int | None:
        """Device address of the cache (one buffer holds every layer's keys and values), or None when freed."""
        return None if self._buffer is None else self._buffer.data_ptr()

    def allocate(self) -> None:
        # Always an inference tensor: the compiled decode layers guard on it, and a cache that
        # came back as a different kind of tensor after sleep/wake recompiled them (3-5 s on the H200).
        if self._buffer is None:
            with torch.inference_mode():
                self._buffer = torch.zeros((2, self.n_layers, *self.shape), dtype=self.dtype, device=self.device)
            self.k = list(self._buffer[0].unbind(0))
            self.v = list(self._buffer[1].unbind(0))

    def free(self) -> None:
        self.k, self.v, self._buffer = [], [], None

    def write_prefill(self, layer: int, dest_rows, src_index, k: torch.Tensor, v: torch.Tensor) -> None:
        length = k.shape[2]
        self.k[layer][dest_rows, :, :length] = k[src_index].to(self.dtype)
        self.v[layer][dest_rows, :, :length] = v[src_index].to(self.dtype)

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, length: int) -> None:
        """Copy rows ``src`` into rows ``dst`` (positions ``0..length-1``), every layer."""
        if length <= 0:
            return
        for t in self.k + self.v:
            t[dst, :, :length] = t[src, :, :length]
