"""CUDA-graph decode: the whole layer stack of a decode step captured once per batch size, then replayed.

A decode step launches hundreds of small kernels; replaying them as one graph removes the launch
cost that dominates small batches. A graph replays fixed addresses, so every captured step reads
one set of static input tensors (DecodeInputs) sized for the largest captured batch. A batch of B
requests is copied in and padded to the next captured size S; the padding requests decode one
token at position 0 whose KV lives in the KV pool's scratch page, so they touch no real request.

Graphs are used only where nothing in the step reads a host value or changes shape: a CUDA device,
a graph-safe attention backend, a dispatcher and MoE kernel that declare `graph_safe`, and no
expert-load recording (its counts would include the padding and its buffers are swapped between
recordings). An overlap strategy that splits a captured size splits it at capture, once: the
micro-batches are fixed per size, as SGLang's two-batch-overlap graph runner does.

Several ranks: every captured batch says that every rank holds `size` tokens (global_num_tokens),
so a dispatcher sized by the step's counts sees the padded count. Ranks holding the same requests
(tensor-parallel attention) pad alike; under DP attention the step's agreement (step_agreement.py)
picks one size for all ranks, and an idle rank replays it with padding rows only.

A speculative drafter's own decode steps (nextn's MTP layer) replay graphs of their own over the same static
inputs and sizes: speculation/graphs.py.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Callable, Sequence

import attrs
import torch

from .forward_batch import ForwardBatch, ForwardMode
from .interfaces import BatchMeta
from .kv_cache import KVPool

log = logging.getLogger(__name__)

WARMUP_RUNS = 2  # eager runs before a capture: Triton compiles, the allocator settles


BEYOND_STEP = 32  # the captured sizes above --cuda-graph-max-bs (a speculating engine's admissions: decode_graphs)


def capture_sizes(max_bs: int, beyond: int = 0) -> list[int]:
    """The batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 below max_bs, then max_bs; where `beyond`
    is more, every BEYOND_STEP rows above max_bs below it, then `beyond`."""
    if max_bs < 1:
        raise ValueError(f"the largest CUDA-graph batch must be at least 1, got {max_bs}")
    above = set(range(max_bs + BEYOND_STEP, beyond, BEYOND_STEP)) | {beyond} if beyond > max_bs else set()
    return sorted({s for s in (1, 2, 4) if s < max_bs} | set(range(8, max_bs, 8)) | {max_bs} | above)


def padded_size(batch_size: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size holding `batch_size` requests (None: too large for any graph)."""
    at = bisect.bisect_left(sizes, batch_size)
    return sizes[at] if at < len(sizes) else None


def why_no_graphs(config, device: torch.device, selection, attention_backend) -> str | None:
    """Why decode cannot use CUDA graphs on this engine, or None when it can."""
    if config.disable_cuda_graph:
        return "--disable-cuda-graph is set"
    if device.type != "cuda":
        return f"the device is {device.type}, not a CUDA GPU"
    if not attention_backend.graph_safe:
        return f"the {attention_backend.name} attention backend reads host-side lengths (triton does not)"
    for kind, name, plugin in (
        ("dispatcher", config.dispatcher, selection.dispatcher),
        ("moe_kernel", config.moe_kernel, selection.moe_kernel),
    ):
        if not getattr(plugin.caps, "graph_safe", False):
            return f"{kind} '{name}' does not declare itself graph-safe"
    return None


def max_pages_per_request(kv: KVPool, max_context: int | None) -> int:
    """Page-table width: the pages of the longest sequence the pool (and the model) can hold."""
    pages = kv.num_pages if max_context is None else min(kv.num_pages, kv.pages_for(max_context))
    return max(pages, 1)


@attrs.define
class DecodeInputs:
    """The static tensors every captured decode step reads: room for max_bs requests of max_pages pages.

    Rows beyond the live batch are padding requests: one token (id 0, position 0) whose KV goes to,
    and is read from, the scratch page.
    """

    input_ids: torch.Tensor  # [max_bs]
    positions: torch.Tensor  # [max_bs]
    out_cache_loc: torch.Tensor  # [max_bs]
    seq_lens: torch.Tensor  # [max_bs]
    page_table: torch.Tensor  # [max_bs, max_pages]
    rows: torch.Tensor  # [max_bs] 0, 1, ...: the rows whose logits a step returns
    page_size: int
    scratch_page: int

    @classmethod
    def allocate(cls, max_bs: int, max_pages: int, kv: KVPool, device: torch.device | str) -> DecodeInputs:
        def ints(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=device)

        inputs = cls(
            input_ids=ints(max_bs),
            positions=ints(max_bs),
            out_cache_loc=ints(max_bs),
            seq_lens=ints(max_bs),
            page_table=ints(max_bs, max_pages, dtype=torch.int32),
            rows=torch.arange(max_bs, device=device),
            page_size=kv.page_size,
            scratch_page=kv.scratch_page,
        )
        inputs.pad(0, max_bs)
        return inputs

    @property
    def max_bs(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def fits(self, batch: ForwardBatch) -> bool:
        table = batch.page_table
        return batch.batch_size <= self.max_bs and table is not None and table.shape[1] <= self.max_pages

    def pad(self, start: int, end: int) -> None:
        """Make rows start .. end-1 padding requests."""
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.out_cache_loc[start:end] = self.scratch_page * self.page_size
        self.seq_lens[start:end] = 1
        self.page_table[start:end, 0] = self.scratch_page

    def load(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode batch into rows 0 .. B-1 and pad rows B .. size-1 (a larger batch may have used them)."""
        count, width = batch.batch_size, batch.page_table.shape[1]
        self.input_ids[:count].copy_(batch.input_ids)
        self.positions[:count].copy_(batch.positions)
        self.out_cache_loc[:count].copy_(batch.out_cache_loc)
        self.seq_lens[:count].copy_(batch.seq_lens)
        self.page_table[:count, :width].copy_(batch.page_table)
        self.pad(count, size)

    def batch(self, size: int) -> ForwardBatch:
        """The decode batch of the first `size` rows, as a captured step sees it.

        Its CPU-side lengths claim the longest sequence a row may hold, so host-side choices made
        at capture (the attention's split count) suit every batch replayed later. It has no
        kv_indices: graph-safe attention reads the page table.
        """
        longest = self.max_pages * self.page_size
        device = self.input_ids.device
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            out_cache_loc=self.out_cache_loc[:size],
            seq_lens=self.seq_lens[:size],
            extend_lens=(1,) * size,
            prefix_lens=(longest - 1,) * size,
            kv_indices=torch.empty(0, dtype=torch.int64, device=device),
            kv_indptr=torch.zeros(size + 1, dtype=torch.int64, device=device),
            page_table=self.page_table[:size],
            page_size=self.page_size,
        )


Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]


class CudaGraphCapture:
    """Turns a step function into a replay function; all graphs share one memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def __call__(self, step: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for _ in range(WARMUP_RUNS):
                step()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            out = step()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class DecodeGraphs:
    """One captured decode step per batch size; a decode batch replays the smallest that holds it.

    `capture` turns a step function into a replay function (CudaGraphCapture on the GPU; the tests
    pass one that simply calls the step again, which checks everything but the capture itself).
    `cuts[size]`: where the overlap strategy splits that size into micro-batches (None: whole),
    fixed at capture.
    """

    def __init__(self, model, kv: KVPool, strategy, inputs: DecodeInputs, sizes: Sequence[int], capture: Capture,
                 world_size: int = 1, with_hidden: bool = False):
        self.model, self.inputs = model, inputs
        # with_hidden: the graphs also return every row's pre-norm hidden state (a drafter that reads them)
        self.with_hidden = with_hidden
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}
        self.cuts: dict[int, list[int] | None] = {}
        for size in sorted(sizes, reverse=True):  # largest first: the smaller graphs reuse its memory
            batch, rows = self.captured_batch(size, strategy, world_size), inputs.rows[:size]
            self.replays[size] = capture(
                lambda batch=batch, rows=rows: model(batch, kv, strategy, logits_at=rows, return_hidden=with_hidden)
            )
        self.sizes = sorted(self.replays)

    def captured_batch(self, size: int, strategy, world_size: int) -> ForwardBatch:
        """The batch a graph of `size` rows is captured with: every rank holds `size` tokens, all decode,
        and the strategy's split of that size (if any) taken for good."""
        batch = self.inputs.batch(size)
        cuts = strategy.cuts(BatchMeta(batch.mode, batch.extend_lens))
        self.cuts[size] = None if cuts is None else list(cuts)
        return attrs.evolve(
            batch, global_num_tokens=(size,) * world_size, overlap_split=cuts is not None, global_all_decode=True
        )

    @property
    def recording(self) -> bool:
        """Whether expert load is recorded now: no step replays then (the counts would include the padding)."""
        runtime = getattr(self.model, "moe_runtime", None)
        return runtime is not None and runtime.records_load

    def fits(self, batch: ForwardBatch) -> bool:
        """Whether this rank's batch could replay a graph (an idle batch can: as padding rows only)."""
        return (
            batch.mode in (ForwardMode.DECODE, ForwardMode.IDLE)
            and self.inputs.fits(batch)
            and batch.batch_size <= self.sizes[-1]
            and not self.recording
        )

    def size_for(self, batch: ForwardBatch) -> int | None:
        """The captured size this batch replays: agreed by every rank under DP attention (global_num_tokens set),
        else the smallest holding it; None: eager."""
        if batch.global_num_tokens is not None:
            return batch.graph_size
        if batch.mode != ForwardMode.DECODE or not self.fits(batch):
            return None
        return padded_size(batch.batch_size, self.sizes)

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.size_for(batch) is not None

    def run(self, batch: ForwardBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[B, vocab] logits of a decode batch, or of its `rows` only (a copy: the graph's output is overwritten by
        the next replay); an idle batch replays its agreed size with padding rows only and gets [0, vocab]."""
        out = self._replay(batch)
        return self._rows(out[0] if self.with_hidden else out, batch, rows)

    def run_with_hidden(self, batch: ForwardBatch, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, vocab] logits (or those of `rows`), [B, H] pre-norm hidden states) of a decode batch, from graphs
        captured with_hidden."""
        logits, hidden = self._replay(batch)
        return self._rows(logits, batch, rows), hidden[: batch.batch_size].clone()

    @staticmethod
    def _rows(logits: torch.Tensor, batch: ForwardBatch, rows: torch.Tensor | None) -> torch.Tensor:
        return logits[: batch.batch_size].clone() if rows is None else logits[rows]

    def replay_loaded(self, size: int, with_hidden: bool = False):
        """[size, vocab] logits of the graph of `size` over the static inputs as they are (a caller that wrote them
        itself: a graphed verify step), with `with_hidden` ([size, vocab] logits, [size, H] pre-norm hidden states)
        from graphs captured with them; the graph's own tensors, overwritten by the next replay."""
        out = self.replays[size]()
        if with_hidden:
            if not self.with_hidden:
                raise ValueError("hidden states asked of decode graphs captured without them")
            return out
        return out[0] if self.with_hidden else out

    def _replay(self, batch: ForwardBatch):
        size = self.size_for(batch)
        self.inputs.load(batch, size)
        return self.replays[size]()


def graph_sizes(config, strategy, buffers: int | None = None, admit_rows: int = 0) -> list[int]:
    """The decode batch sizes an engine captures. A speculative verify step is a decode batch of one row per request
    and draft; a prompt step run as rows (model_runner.prompt_rows) one row per token, so with prompt graphs every
    size up to --cuda-graph-max-bs may serve, and up to `admit_rows` (decode_graphs) where none is split into
    micro-batches by the overlap `strategy`. `buffers`: the most tokens a step's dispatch buffers hold (a captured
    step must fit them)."""
    largest = config.cuda_graph_max_bs
    if config.disable_prompt_graphs:
        largest = min(largest, config.max_running_requests * config.tokens_per_decode)
    if buffers is not None:
        largest, admit_rows = min(largest, buffers), min(admit_rows, buffers)
    if any(strategy.cuts(BatchMeta(ForwardMode.DECODE, (1,) * size)) is not None for size in {largest, admit_rows}
           if size):
        admit_rows = 0
    return capture_sizes(largest, admit_rows)


def decode_graphs(config, model, kv: KVPool, strategy, selection, world_size: int,
                  with_hidden: bool = False, admit_rows: int = 0) -> DecodeGraphs | None:
    """Capture the decode graphs this engine can use, or say (on a GPU) why it uses none. `with_hidden`: they
    also return the hidden states (a speculative drafter that reads them). `admit_rows`: the rows of a verify step
    that admits prompts beside a full grid (speculation/build.graph_rows), captured above --cuda-graph-max-bs in
    coarser steps where no size is split into micro-batches (a split size would keep admissions out anyway)."""
    device = torch.device(config.device)
    reason = why_no_graphs(config, device, selection, model.attention_backend)
    if not reason and world_size > 1 and not config.enable_multi_rank_cuda_graph:
        reason = (f"the engine spans {world_size} ranks, whose graphs have not yet run on several GPUs "
                  "(--enable-multi-rank-cuda-graph turns them on)")
    if not reason and model.moe_runtime.records_load:
        reason = "expert load is recorded every step (--enable-eplb, or a hook observes it)"
    if reason:
        if device.type == "cuda":
            log.info("decode runs without CUDA graphs: %s", reason)
        return None
    buffers = model.moe_runtime.ctx.max_tokens_per_rank \
        if getattr(selection.dispatcher.caps, "fixed_max_tokens", False) else None
    sizes = graph_sizes(config, strategy, buffers, admit_rows)
    max_pages = max_pages_per_request(kv, model.hf_config.get("max_position_embeddings"))
    inputs = DecodeInputs.allocate(sizes[-1], max_pages, kv, device)
    start = time.perf_counter()
    with torch.inference_mode():
        graphs = DecodeGraphs(model, kv, strategy, inputs, sizes, CudaGraphCapture(device), world_size, with_hidden)
    split = [size for size, cuts in graphs.cuts.items() if cuts is not None]
    log.info("captured CUDA graphs for decode batches of %s requests in %.1f s%s", sizes, time.perf_counter() - start,
             f" (split into micro-batches from {min(split)} on)" if split else "")
    return graphs
