"""ForwardBatch: the one object that flows from the scheduler through the model runner into every plugin."""

from __future__ import annotations

import enum
import itertools

import attrs
import torch

from .transfer import to_device

TOKEN = "token"  # field indexed by token: sliced by token ranges when a batch is split
REQUEST = "request"  # field indexed by request: sliced by request ranges
RAGGED = "ragged"  # flat per-request runs delimited by the `indptr` field named in the metadata


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # at least one request adds more than its next token (prefill, chunked prefill, mixed)
    DECODE = 2  # every request adds exactly one token
    IDLE = 3  # this rank has no work but must join the step's collectives

    @property
    def is_extend(self) -> bool:
        return self is ForwardMode.EXTEND


def _per(axis: str, default=attrs.NOTHING, **metadata):
    return attrs.field(default=default, metadata={"axis": axis, **metadata})


@attrs.frozen
class ForwardBatch:
    """One step's inputs.  Token-indexed tensors have T rows, request-indexed ones B rows.

    Request i adds tokens positions[cu_extend[i]:cu_extend[i+1]], i.e. the positions
    prefix_lens[i] .. seq_lens[i]-1 of its sequence; their KV goes to out_cache_loc.
    kv_indices[kv_indptr[i]:kv_indptr[i+1]] are the KV slots of its whole sequence; the same slots
    as pages: token j of request i is in page page_table[i, j // page_size] (the form kernels and
    CUDA graphs read, since its shape does not follow the token count).
    """

    mode: ForwardMode
    input_ids: torch.Tensor = _per(TOKEN)  # [T]
    positions: torch.Tensor = _per(TOKEN)  # [T]
    out_cache_loc: torch.Tensor = _per(TOKEN)  # [T] KV slot written by each token
    seq_lens: torch.Tensor = _per(REQUEST)  # [B] sequence length after this step
    extend_lens: tuple[int, ...] = _per(REQUEST)  # new tokens per request (CPU side)
    prefix_lens: tuple[int, ...] = _per(REQUEST)  # tokens already in the KV cache (CPU side)
    kv_indices: torch.Tensor = _per(RAGGED, indptr="kv_indptr")  # [sum(seq_lens)] flattened KV slots
    kv_indptr: torch.Tensor = _per(REQUEST)  # [B + 1]
    page_table: torch.Tensor | None = _per(REQUEST, default=None)  # [B, >= longest sequence's pages]
    page_size: int = 1  # tokens per page of page_table
    # DP attention: the token count of every rank this step (None without DP attention)
    global_num_tokens: tuple[int, ...] | None = None
    # DP attention: whether every rank splits this step into micro-batches (None: decide locally)
    overlap_split: bool | None = None
    # DP attention: whether every rank with tokens decodes this step (None: read this rank's mode)
    global_all_decode: bool | None = None
    # DP attention: the captured decode-graph size every rank replays this step, idle ranks too (None: eager)
    graph_size: int | None = None
    # the token rows whose logits the step samples, where those are not each request's last new token (None):
    # a prompt run as decode rows, one row per token (model_runner.py), samples its last row only (host side)
    sample_rows: tuple[int, ...] | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens_cpu(self) -> tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens))

    @property
    def kv_indptr_cpu(self) -> list[int]:
        """kv_indptr's values from the host's lengths (reading the tensor on a GPU waits for the device). Not for
        a batch whose lengths are bounds (speculation/overlap.shift_rows: a decode batch moved on the device)."""
        return list(itertools.accumulate(self.seq_lens_cpu, initial=0))

    @property
    def last_token_index(self) -> torch.Tensor:
        """[B] index in T of each request's last new token (where its logits come from); `sample_rows` where set."""
        if self.sample_rows is not None:
            ends = torch.tensor(self.sample_rows, dtype=torch.int64)
        else:
            ends = torch.tensor(self.extend_lens, dtype=torch.int64).cumsum(0) - 1
        return to_device(self.input_ids.device, ends)[0]  # (a pageable copy would wait for the step in flight)

    @classmethod
    def idle(cls, device: torch.device | str = "cpu") -> "ForwardBatch":
        empty = torch.empty(0, dtype=torch.int64, device=device)
        return cls(
            mode=ForwardMode.IDLE,
            input_ids=empty,
            positions=empty,
            out_cache_loc=empty,
            seq_lens=empty,
            extend_lens=(),
            prefix_lens=(),
            kv_indices=empty,
            kv_indptr=torch.zeros(1, dtype=torch.int64, device=device),
            page_table=torch.empty(0, 1, dtype=torch.int64, device=device),
        )

    def slice_tokens(self, start: int, end: int) -> "ForwardBatch":
        """The micro-batch of tokens start .. end-1, as a batch of its own.

        Token-indexed fields are sliced generically (by their metadata); the request-level
        fields follow from the tokens kept: a request cut by the range keeps only its tokens
        inside it, and its cached prefix grows by the tokens before the cut.
        """
        lens = self.extend_lens
        firsts = [sum(lens[:i]) for i in range(len(lens))]
        kept = [i for i, first in enumerate(firsts) if first < end and first + lens[i] > start and lens[i] > 0]
        extend = tuple(min(firsts[i] + lens[i], end) - max(firsts[i], start) for i in kept)
        prefix = tuple(self.prefix_lens[i] + max(0, start - firsts[i]) for i in kept)
        seq = [p + n for p, n in zip(prefix, extend)]
        device = self.input_ids.device
        tokens = {name: getattr(self, name)[start:end] for name in self.fields_along(TOKEN)}
        first, last = (kept[0], kept[-1] + 1) if kept else (0, 0)
        if kept == list(range(first, last)) and all(e == lens[i] for e, i in zip(extend, kept)):
            # no request is cut (every decode split): views of the batch's own tensors, no host read, so a
            # micro-batch of a captured step reads the graph's static inputs
            seq_lens = self.seq_lens[first:last]
            table = None if self.page_table is None else self.page_table[first:last]
        else:
            seq_lens = to_device(device, torch.tensor(seq, dtype=torch.int64))[0]
            table = self.page_table
            if table is not None:
                table = table[to_device(table.device, torch.tensor(kept, dtype=torch.int64))[0]]
        if self.kv_indices.numel() == 0:  # a captured step's batch: attention reads the page table
            kv_indices, kv_indptr = self.kv_indices, torch.zeros(len(kept) + 1, dtype=torch.int64, device=device)
        else:
            indptr = self.kv_indptr.tolist()
            runs = [self.kv_indices[indptr[i] : indptr[i] + s] for i, s in zip(kept, seq)]
            kv_indices = torch.cat(runs) if runs else self.kv_indices[:0]
            kv_indptr = torch.zeros(len(kept) + 1, dtype=torch.int64)
            kv_indptr[1:] = torch.tensor(seq, dtype=torch.int64).cumsum(0)
            kv_indptr = kv_indptr.to(device)
        return attrs.evolve(
            self,
            **tokens,
            extend_lens=extend,
            prefix_lens=prefix,
            seq_lens=seq_lens,
            kv_indices=kv_indices,
            kv_indptr=kv_indptr,
            page_table=table,
        )

    @classmethod
    def fields_along(cls, axis: str) -> list[str]:
        """Names of the fields indexed by tokens (TOKEN) or by requests (REQUEST)."""
        return [f.name for f in attrs.fields(cls) if f.metadata.get("axis") == axis]
