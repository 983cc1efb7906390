"""The n-gram lookup as tensor ops over a device-side history buffer: drafting with no read back to the host.

`lookup_batch` is ngram.lookup for every request of a step at once: over a [requests, length] buffer of token
ids it matches the last max_n tokens against every earlier position (one comparison of the whole buffer per
suffix length, a running product for "the k tokens before matched too"), takes the longest match, the latest
occurrence of it, and the tokens that followed. Its drafts equal lookup's on the same ids (tests/test_ngram_device.py).

`DeviceHistories` keeps each request's latest tokens in one buffer [slots, width] on the device. The host writes
the tokens it knows (only those added since the last call: a few per request per step, one copy for the batch);
tokens of a step the host has not read yet (DeviceTokens) are written on the device, after the known ones, and
later overwritten by the host with the very same ids when it reads them. A row keeps at least the last `window`
tokens (the lookup's search range): when it fills up it is rewritten from the last `window` tokens.

`StaticLookup` is the same drafting at fixed shapes, for a CUDA graph (StaticProposer): the rows are gathered by a
static slot index over the buffer's whole row width (columns beyond a row's length never match), their lengths a
static [max_rows] input, padding rows read the buffer's scratch row with length 0 and draft nothing. The host's part
per step is the known ids' index_put (only when there are new ones) and one copy of the rows' slots and lengths.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from moeplex.interfaces import DeviceDrafts, DeviceTokens, DraftRequest, StaticProposer

from .host_copies import pinned, to_device

SLACK = 64  # columns kept free after a row's known tokens: room for a step's pending tokens


def lookup_batch(history: torch.Tensor, lengths: torch.Tensor, max_n: int, min_n: int, count: int,
                 window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row r of `history` [R, L] (its first lengths[r] ids, searched in the last `window` of them): up to
    `count` tokens that followed the latest earlier occurrence of the longest suffix of length max_n .. min_n,
    as ([R, count] ids with -1 after them, [R] their counts).

    A fixed, small number of kernels whatever max_n (it runs in every overlapped verify step, at the buffer's
    whole width): ids outside the window become -2 (no id), each position's last max_n ids are a view
    (unfold) compared with the suffix at once, and the matched length is the run of equal ids from the end.
    The longest match and its latest position come from one max over length x width + position."""
    rows, width = history.shape
    device = history.device
    pos = torch.arange(width, device=device)[None, :]
    last = (lengths - 1)[:, None]
    low = (lengths - window).clamp_min(0)[:, None]  # the window's first column
    suffix = history.gather(1, (last - torch.arange(max_n - 1, -1, -1, device=device)[None, :]).clamp_min(0))
    inside = torch.where(pos >= low, history, -2)
    ends = F.pad(inside, (max_n - 1, 0), value=-2).unfold(1, max_n, 1)  # [R, L, max_n]: ids e - max_n + 1 .. e
    differs = (ends != suffix[:, None, :]).flip(-1)  # [..., k]: id e - k differs from the suffix's k-th from last
    first = torch.where(differs.any(-1), differs.to(torch.uint8).argmax(-1), max_n)  # matched ids ending at e
    key = torch.where((pos < last) & (first > 0), first * width + pos, -1)  # an occurrence ends before the last id
    best = key.max(dim=1).values
    longest, end = best.div(width, rounding_mode="floor"), best.remainder(width)
    found = (best >= 0) & (longest >= min_n) & (lengths > 1)
    counts = torch.where(found, (lengths - 1 - end).clamp_max(count), 0)  # (no host scalar copied to the device)
    steps = torch.arange(count, device=device)[None, :]
    drafts = history.gather(1, ((end + 1)[:, None] + steps).clamp(0, width - 1))
    return torch.where(steps < counts[:, None], drafts, -1), counts


class DeviceHistories:
    """Each live request's latest token ids, one row of a device buffer per request (rows reused after `drop`)."""

    def __init__(self, window: int, device: torch.device, slots: int = 8):
        self.window = window
        self.width = 2 * window + SLACK
        self.device = torch.device(device)
        self.buffer = torch.zeros(slots + 1, self.width, dtype=torch.int64, device=self.device)
        self.scratch = slots  # a row no request owns: static padding rows read (and write) it
        self.free = list(range(slots - 1, -1, -1))
        # per rid: [slot, offset (sequence index of column 0), known (sequence length written), its last id]
        self.rows: dict[str, list[int]] = {}

    def view(self, requests: Sequence[DraftRequest], pending: DeviceTokens | None) -> tuple[torch.Tensor, torch.Tensor]:
        """([R, L] the requests' rows, [R] their lengths in it) with the pending tokens after the known ones."""
        meta = self.write_known(requests)
        slots = torch.tensor([m[0] for m in meta], dtype=torch.int64)
        known = torch.tensor([m[2] - m[1] for m in meta], dtype=torch.int64)  # columns written per row
        pending_width = pending.tokens.shape[1] if pending is not None else 0
        if pending_width > SLACK:
            raise ValueError(f"{pending_width} pending tokens per request: at most {SLACK}")
        width = int(known.max()) + pending_width
        slots, known = to_device(self.device, torch.stack([slots, known]))
        if pending is not None:  # after the known ids, on the device; the host writes the same ids once it reads them
            cols = known[:, None] + torch.arange(pending_width, device=self.device)[None, :]
            self.buffer[slots[:, None], cols] = pending.tokens
            known = known + pending.counts
        return self.buffer[slots, :width], known

    def drop(self, rid: str) -> None:
        meta = self.rows.pop(rid, None)
        if meta is not None:
            self.free.append(meta[0])

    def write_known(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        """Copy each request's ids added since the last call into its row (one copy for all of them); their rows'
        [slot, offset, known, last id]."""
        rows, cols, values = [], [], []
        for request in requests:
            ids, n = request.token_ids, len(request.token_ids)
            meta = self.rows.get(request.rid)
            if meta is None:
                meta = self.rows[request.rid] = [self._slot(), 0, 0, -1]
            slot, offset, known, last = meta
            if n < known or (known and ids[known - 1] != last):  # a different sequence under this rid: rewrite
                offset = known = 0
            if n - offset + SLACK > self.width:  # full: keep the last `window` ids, from column 0
                offset = known = max(n - self.window, 0)
            if n > known:
                rows += [slot] * (n - known)
                cols += range(known - offset, n - offset)
                values += ids[known:n]
            meta[1:] = [offset, n, ids[n - 1] if n else -1]
        if values:
            index = to_device(self.device, torch.tensor([rows, cols, values], dtype=torch.int64))
            self.buffer[index[0], index[1]] = index[2]
        return [self.rows[r.rid] for r in requests]

    def _slot(self) -> int:
        if not self.free:  # twice the rows (a new buffer: graphs over the old one no longer replay)
            size = self.scratch
            grown = torch.zeros(2 * size + 1, self.width, dtype=torch.int64, device=self.device)
            grown[:size] = self.buffer[:size]
            self.buffer, self.scratch = grown, 2 * size
            self.free = list(range(2 * size - 1, size - 1, -1))
        return self.free.pop()


class StaticLookup(StaticProposer):
    """lookup_batch over DeviceHistories at fixed shapes: up to max_rows rows, pending tokens [rows, pending_width]."""

    def __init__(self, histories: DeviceHistories, max_rows: int, pending_width: int, max_n: int, min_n: int,
                 count: int):
        if pending_width > SLACK:
            raise ValueError(f"{pending_width} pending tokens per request: at most {SLACK}")
        self.histories, self.max_n, self.min_n, self.count = histories, max_n, min_n, count
        self.buffer = histories.buffer  # the one the graphs read
        # per row: slot, known ids, 1 (0: padding); padding reads the scratch row at length 0
        self.meta = torch.tensor([[histories.scratch, 0, 0]] * max_rows, dtype=torch.int64, device=histories.device)
        self.rows = 0
        self.pending_cols = torch.arange(pending_width, device=histories.device)

    def stage(self, requests: Sequence[DraftRequest], rows: int) -> None:
        meta = self.histories.write_known(requests)
        scratch = self.histories.scratch
        staged = [[m[0], m[2] - m[1], 1] for m in meta] + [[scratch, 0, 0]] * (rows - len(requests))
        self.meta[:rows].copy_(pinned(self.histories.device, torch.tensor(staged, dtype=torch.int64)),
                               non_blocking=True)
        self.rows = rows

    def propose(self, pending: DeviceTokens) -> DeviceDrafts:
        rows = pending.tokens.shape[0]
        slots, known, live = self.meta[:rows].unbind(1)
        cols = known[:, None] + self.pending_cols[None, : pending.tokens.shape[1]]
        self.buffer[slots[:, None], cols] = pending.tokens  # padding rows all write the scratch row: harmless
        history = self.buffer[slots]
        tokens, counts = lookup_batch(history, (known + pending.counts) * live, self.max_n, self.min_n, self.count,
                                      self.histories.window)
        return DeviceDrafts(tokens, counts)

    def replayable(self) -> bool:
        return self.histories.buffer is self.buffer
