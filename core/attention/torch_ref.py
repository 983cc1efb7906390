"""Attention over the paged KV cache in plain torch (the `torch` backend, and every backend's extend path).

Extend: every request's keys and values are gathered from its KV slots (ForwardBatch.kv_indices)
and attended with causal masking offset by the request's cached prefix. Decode on CPU: request by
request, each gathering only its own slots and attending with one unmasked SDPA call, the query heads
of a KV head as that head's query rows (no padding, no KV repeated per head: on 2 cores this is 2-40x
faster than one padded SDPA call, whose GQA and masked cases fall to the math path), or, where PagedGather
measured it faster, read in place by moeplex's C++ kernel (in_place.py). Decode elsewhere:
all requests at once, their KV gathered into a [B, longest, ...] block with the padding masked out
(one launch instead of B).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..forward_batch import ForwardBatch, ForwardMode
from ..kernels import cpu as cpu_kernels
from .in_place import decode_in_place, in_place_takes, tiles_take


# SDPA's kernels on a GPU, all but cuDNN's: cuDNN builds an execution graph for every new shape (measured at
# hundreds of ms by others: sglang#4650, pytorch#191576), and here every prompt, catch-up or eager decode of a
# new length is a new shape (on an H100, runs of a steady batch with nextn's catch-ups read 314 -> 1784 tok/s as
# cuDNN's cache filled, 1773-2065 without it).
GPU_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def gpu_kernels(device: torch.device):
    """The context SDPA calls on `device` run in: GPU_SDPA on a GPU, anything on a CPU."""
    return sdpa_kernel(GPU_SDPA) if device.type == "cuda" else contextlib.nullcontext()


def write_kv(buffer: torch.Tensor, batch: ForwardBatch, values: torch.Tensor) -> None:
    buffer[batch.out_cache_loc] = values.to(buffer.dtype)


def gather_kv(buffer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """[sum(seq_lens), ...] cached rows of every request, request after request."""
    return buffer.index_select(0, batch.kv_indices)


def padded_rows(batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """([B * longest] positions in kv_indices order, [B, longest] mask of the real ones)."""
    longest = max(batch.seq_lens_cpu)
    cols = torch.arange(longest, device=batch.seq_lens.device)
    valid = cols[None, :] < batch.seq_lens[:, None]
    rows = (batch.kv_indptr[:-1, None] + cols[None, :]).clamp_max(max(batch.kv_indices.numel() - 1, 0))
    return rows.flatten(), valid


def _attend_padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] against k [B, L, Hkv, D], v [B, L, Hkv, Dv] -> [B, Hq, Dv]."""
    with gpu_kernels(q.device):
        out = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=valid[:, None, None, :], scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[2])
    return out.squeeze(2)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One request: q [Hq, D] against k [L, Hkv, D], v [L, Hkv, Dv] -> [Hq, Dv].

    The query heads of a KV head become that head's query rows (no KV repeated per head, no mask: every
    row sits at the last position), so SDPA takes its fused CPU kernel, which needs no per-shape set-up;
    bf16 matmuls here would go to oneDNN, which builds a kernel for every new length (~0.6 ms), and a
    request's length changes every step."""
    hkv = k.shape[1]
    out = F.scaled_dot_product_attention(
        q.view(1, hkv, q.shape[0] // hkv, q.shape[1]), k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale
    )
    return out.view(q.shape[0], v.shape[-1])


def _shares_keys(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """Whether the values are the keys' leading columns (MLA's latent), so one gather serves both."""
    return (
        value_cache.data_ptr() == key_cache.data_ptr()
        and value_cache.shape[:-1] == key_cache.shape[:-1]
        and all(a == b for a, b, n in zip(value_cache.stride(), key_cache.stride(), key_cache.shape) if n > 1)
    )


def decode_per_request(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch, scale: float,
    by_pages: bool = False,
) -> torch.Tensor:
    """Decode request by request, gathering only each request's own KV: one SDPA call per request, the query
    heads of a KV head as its query rows (see _attend_one), the outputs concatenated once. `by_pages`: gather
    the request's whole pages (page_table; one copy per page) instead of its slots (one per token), then cut
    to its length: which is faster depends on the processor (PagedGather measures it)."""
    shared = _shares_keys(key_cache, value_cache)
    hkv = key_cache.shape[1]
    queries = q.view(q.shape[0], 1, hkv, q.shape[1] // hkv, q.shape[2]).unbind(0)
    lengths = batch.kv_indptr.diff().tolist()
    outs = []
    for query, (k, v) in zip(queries, request_rows(key_cache, value_cache, batch, lengths, by_pages, shared)):
        k = k.transpose(0, 1)[None]
        # MLA: the keys serve as values whole (the fused kernel wants one width), cut to the latent below
        v = k if shared else v.transpose(0, 1)[None]
        outs.append(F.scaled_dot_product_attention(query, k, v, scale=scale))
    if not outs:
        return q.new_empty(0, q.shape[1], value_cache.shape[-1])
    out = torch.cat(outs).view(q.shape[0], q.shape[1], -1)
    return out[..., : value_cache.shape[-1]] if shared else out


def request_rows(key_cache, value_cache, batch: ForwardBatch, lengths: list[int], by_pages: bool, shared: bool = False):
    """Per request, its (keys, values) rows [length, Hkv, D] gathered from the cache (values None when shared)."""
    if by_pages:
        size = batch.page_size
        key_pages = key_cache.unflatten(0, (-1, size))
        value_pages = None if shared else value_cache.unflatten(0, (-1, size))
        for row, length in enumerate(lengths):
            pages = batch.page_table[row, : -(-length // size)]
            k = key_pages.index_select(0, pages).flatten(0, 1)[:length]
            yield k, None if shared else value_pages.index_select(0, pages).flatten(0, 1)[:length]
        return
    for slots in batch.kv_indices.split(lengths):
        yield key_cache.index_select(0, slots), None if shared else value_cache.index_select(0, slots)


class PagedGather:
    """How CPU decode reads each request's KV on this processor: gathered by slots (one copy per token) or by whole
    pages for SDPA, or read in place by moeplex's C++ kernel (in_place.py) where it builds and takes the shapes.
    Each way's whole decode is timed once per machine (measured_choice) and cache shape, on the first decode batch
    with enough rows (its own requests' KV), and the fastest kept. On an AMD EPYC copying whole 16-token pages
    beat the per-token copies 1.5x; on a Xeon the per-token copies had won."""

    MIN_ROWS = 1024  # a first batch smaller than this decides nothing yet (too little to time)
    ROUNDS = 3
    def __init__(self):
        self.choices: dict[tuple, str] = {}

    def way(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch) -> str:
        """"slots", "pages", "in_place" or "in_place_tiles" for this cache shape: measured on this batch if not yet
        decided."""
        ways = self.ways(q, key_cache, value_cache, batch)
        if len(ways) == 1:
            return ways[0]
        key = (tuple(key_cache.shape), tuple(value_cache.shape), key_cache.dtype, batch.page_size, ways)
        if key not in self.choices:
            what = (f"{tuple(key_cache.shape[1:])} {tuple(value_cache.shape[1:])} {key_cache.dtype} page {batch.page_size}"
                    f" q heads {q.shape[1]} {'/'.join(ways)}")
            if batch.kv_indices.numel() < self.MIN_ROWS or q.shape[0] == 0:
                # too small to time: an earlier process's measurement on this machine, if any, else slots for now
                stored = cpu_kernels.stored_choice("decode_attention", what)
                if stored not in ways:
                    return "slots"
                self.choices[key] = stored
            else:
                self.choices[key] = cpu_kernels.measured_choice(
                    "decode_attention", what, lambda: self._measure(q, key_cache, value_cache, batch, ways))
        return self.choices[key]

    @staticmethod
    def ways(q, key_cache, value_cache, batch: ForwardBatch) -> tuple[str, ...]:
        ways = ["slots"]
        if batch.page_table is not None and batch.page_size > 1 and key_cache.shape[0] % batch.page_size == 0:
            ways.append("pages")
        if in_place_takes(q, key_cache, value_cache):
            ways.append("in_place")
            if tiles_take(q, key_cache, value_cache):
                ways.append("in_place_tiles")
        return tuple(ways)

    def _measure(self, q, key_cache, value_cache, batch: ForwardBatch, ways: tuple[str, ...]) -> str:
        clock = cpu_kernels.measuring_clock()
        best = {way: float("inf") for way in ways}
        for round in range(self.ROUNDS + 1):  # the first round warms up
            for way in ways:
                start = clock()
                decode_by(way, q, key_cache, value_cache, batch, 1.0)
                if round:
                    best[way] = min(best[way], clock() - start)
        return min(best, key=best.get)


def decode_by(way: str, q, key_cache, value_cache, batch: ForwardBatch, scale: float) -> torch.Tensor:
    if way in ("in_place", "in_place_tiles"):
        return decode_in_place(q, key_cache, value_cache, batch, scale, tiles=way == "in_place_tiles")
    return decode_per_request(q, key_cache, value_cache, batch, scale, by_pages=way == "pages")


def paged_decode_attention(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch, scale: float,
    gather: PagedGather | None = None,
) -> torch.Tensor:
    """Decode straight from the cache buffers: on CPU per request, or in place, as `gather` measured fastest; else
    one gather per buffer into the padded block."""
    if q.device.type == "cpu":
        way = "slots" if gather is None else gather.way(q, key_cache, value_cache, batch)
        return decode_by(way, q, key_cache, value_cache, batch, scale)
    return decode_padded(q, key_cache, value_cache, batch, scale)


def decode_padded(
    q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """Decode in one SDPA call over every request's KV gathered into a padded [B, longest, ...] block."""
    rows, valid = padded_rows(batch)
    slots = batch.kv_indices.index_select(0, rows)
    k = key_cache.index_select(0, slots).view(*valid.shape, *key_cache.shape[1:])
    v = value_cache.index_select(0, slots).view(*valid.shape, *value_cache.shape[1:])
    return _attend_padded(q, k, v, valid, scale)


def ragged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    """q [T, Hq, D]; k [S, Hkv, D], v [S, Hkv, Dv] in kv_indices order -> [T, Hq, Dv]."""
    if batch.mode == ForwardMode.DECODE and q.device.type == "cpu":
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        indptr = batch.kv_indptr.tolist()
        for i in range(q.shape[0]):
            out[i] = _attend_one(q[i], k[indptr[i] : indptr[i + 1]], v[indptr[i] : indptr[i + 1]], scale)
        return out
    if batch.mode == ForwardMode.DECODE:
        rows, valid = padded_rows(batch)
        k = k.index_select(0, rows).view(*valid.shape, *k.shape[1:])
        v = v.index_select(0, rows).view(*valid.shape, *v.shape[1:])
        return _attend_padded(q, k, v, valid, scale)
    with gpu_kernels(q.device):
        return _extend(q, k, v, batch, scale)


def flash_value_width(q: torch.Tensor, v: torch.Tensor) -> int:
    """The value width a causal prompt's SDPA call gets: the query's where they differ on a GPU (MLA's 192-wide
    keys against 128-wide values), because the flash kernel takes one width for all three, and without it SDPA
    falls to the memory-efficient kernel, ~1.9x slower on a DeepSeek-V3 prompt (docs/attention.md); the zero
    columns added are cut from the output. The values' own width elsewhere."""
    fits = q.is_cuda and v.shape[-1] < q.shape[-1] <= 256
    return q.shape[-1] if fits else v.shape[-1]


def _extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch, scale: float) -> torch.Tensor:
    """ragged_attention of an extend batch: one causal SDPA call per request."""
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    gqa = q.shape[1] != k.shape[1]
    width = flash_value_width(q, v)
    t0 = 0
    indptr = batch.kv_indptr_cpu  # (reading kv_indptr itself on a GPU would wait for the device, in every layer)
    for i, (prefix, n) in enumerate(zip(batch.prefix_lens, batch.extend_lens)):
        ks, vs = k[indptr[i] : indptr[i + 1]], v[indptr[i] : indptr[i + 1]]
        qs = q[t0 : t0 + n]
        if prefix:
            # query j sits at position prefix + j and may see keys 0 .. prefix + j
            positions = torch.arange(prefix + n, device=q.device)
            causal = dict(attn_mask=positions[None, :] <= (prefix + torch.arange(n, device=q.device))[:, None])
        else:
            causal = dict(is_causal=True)  # no mask to build, and SDPA may pick its flash kernel
            if width != vs.shape[-1]:
                vs = F.pad(vs, (0, width - vs.shape[-1]))
        # 4-D [1, heads, tokens, dim]: SDPA's flash and memory-efficient kernels take nothing else and
        # would fall back to the math path, which materializes every score in fp32
        out[t0 : t0 + n] = F.scaled_dot_product_attention(
            *(x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs)), scale=scale, enable_gqa=gqa, **causal
        )[0, ..., : v.shape[-1]].transpose(0, 1)
        t0 += n
    return out
