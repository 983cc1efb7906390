"""Applying a token bitmask to logits on their device: int32 words, bit t % 32 of word t // 32 set where token t
may come next (the layout xgrammar and llguidance fill)."""

from __future__ import annotations

import torch

from ..transfer import to_device


def bitmask_rows(rows: int, words: int) -> torch.Tensor:
    """A CPU bitmask of `rows` rows, all tokens allowed; pinned where a CUDA device will read it."""
    return torch.full((rows, words), -1, dtype=torch.int32, pin_memory=torch.cuda.is_available())


def allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool from [rows, words] int32 bits, on the bitmask's device."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def _to(device: torch.device, bitmask: torch.Tensor) -> torch.Tensor:
    """The bitmask on `device`; already pinned (bitmask_rows), so the copy starts without another host copy."""
    if device.type == "cpu":
        return bitmask
    if bitmask.is_pinned():
        return bitmask.to(device, non_blocking=True)
    return to_device(device, bitmask)[0]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """`logits` [B, V] with forbidden tokens at -inf; `bitmask` holds one row per entry of `rows` (the logits rows
    it constrains; every row when None). The copy to the device does not wait for it (pinned memory)."""
    mask = _to(logits.device, bitmask)
    keep = allowed(mask, logits.shape[-1])
    if rows is None:
        return logits.masked_fill(~keep, float("-inf"))
    index = to_device(logits.device, rows)[0]
    return logits.index_put((index,), logits[index].masked_fill(~keep, float("-inf")))
