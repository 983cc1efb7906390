"""Penalties and biases of many requests in one kernel, in place on their logits rows.

Row r of the launch adjusts logits[rows[r]] with slot slots[r] of the penalty state: the bias row added, then
(where params[r, 3] says the request counts tokens) the repetition penalty over the tokens its prompt or output
holds and the frequency and presence penalties over its output counts. The torch code in core/penalties.py is the
reference: about twenty [rows, vocab] passes there, one here, which at batch 1 is the difference between tens of
small kernels and one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _penalize_kernel(logits_ptr, rows_ptr, slots_ptr, params_ptr, counts_ptr, seen_ptr, bias_ptr, vocab,
                     stride_logits, stride_state, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < vocab
    x = tl.load(logits_ptr + row * stride_logits + c, mask=ok, other=0.0)
    x += tl.load(bias_ptr + slot * stride_state + c, mask=ok, other=0.0)
    if tl.load(params_ptr + r * 4 + 3) != 0.0:
        rep = tl.load(params_ptr + r * 4)
        frequency = tl.load(params_ptr + r * 4 + 1)
        presence = tl.load(params_ptr + r * 4 + 2)
        n = tl.load(counts_ptr + slot * stride_state + c, mask=ok, other=0).to(tl.float32)
        seen = tl.load(seen_ptr + slot * stride_state + c, mask=ok, other=0).to(tl.int32)
        hit = (n > 0) | (seen != 0)
        x = tl.where(hit, tl.where(x > 0, x / rep, x * rep), x)
        x = x - frequency * n - presence * (n > 0).to(tl.float32)
    tl.store(logits_ptr + row * stride_logits + c, x, mask=ok)


def penalize_(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, params: torch.Tensor,
              counts: torch.Tensor, seen: torch.Tensor, bias: torch.Tensor) -> None:
    """logits [B, V] fp32 (unit column stride), changed in place in rows `rows` [R]; slots [R] their state rows;
    params [R, 4] fp32: repetition, frequency, presence penalty, and 1.0 where the request counts tokens."""
    vocab = logits.shape[-1]
    if not rows.numel():
        return
    if logits.stride(-1) != 1 or counts.stride() != bias.stride() or seen.stride() != bias.stride():
        raise ValueError("penalize_ wants unit column strides and state tensors of one layout")
    _penalize_kernel[(rows.numel(), triton.cdiv(vocab, BLOCK))](
        logits, rows, slots, params, counts, seen, bias, vocab, logits.stride(0), bias.stride(0), BLOCK=BLOCK,
        num_warps=8,
    )
