"""Applying a token bitmask to logits on their device: int32 words, bit t % 32 of word t // 32 set where token t
may come next (the layout xgrammar and llguidance fill)."""

from __future__ import annotations

import torch

from ..transfer import to_device


class BitTable:
    """For each byte value b, a row of 8 additive logit masks: 0.0 where bit i of b is set, -inf where not. Adding
    table[bytes of the bitmask] to the logits masks every row in one gather and one add, the cheapest form on a
    CPU (half the time of unpacking the bits with shifts and a masked_fill) and one kernel each on a GPU. One table
    per device and dtype, made once."""

    def __init__(self):
        self._tables: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def __call__(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        table = self._tables.get((device, dtype))
        if table is None:
            bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
            table = self._tables[(device, dtype)] = torch.where(bits.bool(), 0.0, float("-inf")).to(device, dtype)
        return table


class StepMask:
    """One step's masks in one flat int32 buffer: the bitmask of its constrained rows, [rows, words], then one word
    per row that is 1 where the row's constraint failed to compile (its logits become NaN, so the sampler fails
    just that row). One buffer, so the tensor-parallel ranks of a DP group receive it in one broadcast."""

    def __init__(self, buffer: torch.Tensor, rows: int, words: int, any_failed: bool | None = None):
        self.buffer, self.rows, self.words = buffer, rows, words
        self.any_failed = any_failed  # None: not known on the host (a mask received on a device)
        self.additive: torch.Tensor | None = None  # [rows, words * 32] 0 / -inf, where made ahead (CPU logits)

    def make_additive(self, table: "BitTable", dtype: torch.dtype) -> None:
        """The additive form of the bitmask for CPU logits of `dtype`, made now (in the grammar's worker thread) so
        that applying it on the step loop is one add."""
        self.additive = self._additive(table(torch.device("cpu"), dtype), self)

    @staticmethod
    def _additive(lookup: torch.Tensor, mask: "StepMask") -> torch.Tensor:
        # index_select: half the CPU time of indexing with a tensor
        return lookup.index_select(0, mask.bitmask.view(torch.uint8).reshape(-1).int()).view(mask.rows, mask.words * 32)

    @classmethod
    def allowing_all(cls, rows: int, words: int) -> "StepMask":
        """A host mask to fill: every token allowed, no row failed; pinned where a CUDA device will read it."""
        buffer = torch.full((rows * (words + 1),), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())
        buffer[rows * words :] = 0
        return cls(buffer, rows, words, any_failed=False)

    @classmethod
    def receiving(cls, rows: int, words: int, device: torch.device) -> "StepMask":
        """Room on `device` for a mask another rank sends."""
        return cls(torch.empty(rows * (words + 1), dtype=torch.int32, device=device), rows, words)

    @property
    def bitmask(self) -> torch.Tensor:
        """[rows, words], contiguous (backends fill it in place)."""
        return self.buffer[: self.rows * self.words].view(self.rows, self.words)

    @property
    def failed(self) -> torch.Tensor:
        return self.buffer[self.rows * self.words :]

    def fail(self, row: int) -> None:
        self.failed[row] = 1
        self.any_failed = True

    def to(self, device: torch.device) -> "StepMask":
        """This mask on `device`; from pinned memory the copy does not make the host wait."""
        if device.type == "cpu":
            return self
        buffer = self.buffer.to(device, non_blocking=True) if self.buffer.is_pinned() else to_device(device, self.buffer)[0]
        return StepMask(buffer, self.rows, self.words, self.any_failed)

    def apply(self, logits: torch.Tensor, rows: list[int], table: BitTable) -> torch.Tensor:
        """`logits` [B, V] with the forbidden tokens of rows[i] at -inf (mask row i), failed rows all NaN. The int32
        words are read as little-endian bytes (every host and GPU here): byte j holds tokens 8j..8j+7."""
        mask = self.to(logits.device)
        width = logits.shape[-1]
        add = self.additive
        if add is None or add.device != logits.device or add.dtype != logits.dtype:
            add = self._additive(table(logits.device, logits.dtype), mask)
        add = add[:, :width]
        every = len(rows) == logits.shape[0]  # rows are ascending: then they are 0..B-1, and no gather is needed
        index = None if every else to_device(logits.device, torch.tensor(rows))[0]
        masked = (logits if every else logits[index]) + add
        if mask.any_failed is not False:
            masked = masked.masked_fill(mask.failed.bool()[:, None], float("nan"))
        return masked if every else logits.index_put((index,), masked)
