"""The step mask applied to logits: exactly the tokens whose bit is set keep their logit, the others become -inf,
for every row or some rows of a batch, in fp32 and bf16; a failed row becomes NaN; rows outside the mask are
untouched."""

from __future__ import annotations

import pytest
import torch

from moeplex.grammar.mask import BitTable, StepMask


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for i, row in enumerate(rows):
        for token in range(logits.shape[-1]):
            if not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [1, 3], [2]])
def test_masked_logits_match_the_bits(dtype, rows):
    generator = torch.Generator().manual_seed(len(rows))
    vocab = 70  # not a multiple of 32: the last word's high bits lie beyond the vocabulary
    logits = torch.randn(4, vocab, generator=generator).to(dtype)
    mask = StepMask.allowing_all(len(rows), 3)
    mask.bitmask.copy_(torch.randint(-2**31, 2**31 - 1, (len(rows), 3), generator=generator, dtype=torch.int64).int())
    table = BitTable()
    out = mask.apply(logits, rows, table)
    assert out.dtype == dtype and torch.equal(out, reference(logits, mask.bitmask, rows))
    mask.make_additive(table, dtype)  # made ahead, in the grammar's worker thread
    assert torch.equal(mask.apply(logits, rows, table), out)


def test_a_failed_row_is_nan_and_the_rest_masked():
    logits = torch.zeros(3, 40)
    mask = StepMask.allowing_all(2, 2)
    mask.bitmask[0] = 0
    mask.bitmask[0, 0] = 0b101  # tokens 0 and 2 only
    mask.fail(1)
    out = mask.apply(logits, [0, 2], BitTable())
    assert torch.isfinite(out[0]).tolist() == [t in (0, 2) for t in range(40)]
    assert torch.isnan(out[2]).all() and torch.equal(out[1], logits[1])
