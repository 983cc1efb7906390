"""Paged KV cache: one buffer per cached quantity per layer, handed out in pages."""

from __future__ import annotations

from collections import deque
from typing import Sequence

import torch


class KVPool:
    """Token slots grouped in pages of `page_size`; a request owns whole pages.

    `layer_shapes[l]` lists the per-token shape of everything layer l caches: for
    MHA/GQA a key and a value ([kv_heads, head_dim] each), for MLA one row of the
    compressed latent concatenated with the rope key.

    One page more than `num_pages` is allocated and never handed out: the scratch page, which
    the padding rows of a CUDA-graph batch write to and read from, so they touch no request's KV.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        layer_shapes: Sequence[Sequence[tuple[int, ...]]],
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        self.num_pages = num_pages
        self.page_size = page_size
        self.buffers = [
            [torch.zeros((num_pages + 1) * page_size, *shape, dtype=dtype, device=device) for shape in shapes]
            for shapes in layer_shapes
        ]
        self._free = deque(range(num_pages))
        self.scratch_page = num_pages

    @staticmethod
    def bytes_per_token(layer_shapes: Sequence[Sequence[tuple[int, ...]]], dtype: torch.dtype) -> int:
        elements = sum(int(torch.Size(shape).numel()) for shapes in layer_shapes for shape in shapes)
        return elements * torch.empty(0, dtype=dtype).element_size()

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def allocate(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` free pages, or None (taking nothing) when too few are free."""
        if num_pages > len(self._free):
            return None
        return [self._free.popleft() for _ in range(num_pages)]

    def release(self, pages: Sequence[int]) -> None:
        self._free.extend(pages)

    def layer(self, layer_id: int) -> list[torch.Tensor]:
        return self.buffers[layer_id]

    def slots(self, pages: Sequence[int], start: int, end: int) -> torch.Tensor:
        """KV slots of positions start .. end-1 of a sequence whose page table is `pages`."""
        positions = torch.arange(start, end)
        table = torch.tensor(pages, dtype=torch.int64)
        return table[positions // self.page_size] * self.page_size + positions % self.page_size
