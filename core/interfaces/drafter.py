"""Drafter contract: how speculative decoding proposes tokens for the target model to verify.

Each decode step the engine asks the drafter for up to `num_steps` tokens per decoding request, runs one
target forward over (last token + drafts) per request through the paged cache, accepts the longest
prefix the target agrees with (greedy) or passes rejection sampling (temperature > 0), and tells the
drafter what it kept (`observe`). Output equals non-speculative decoding whatever the drafter proposes;
a good drafter only makes it faster.

The engine calls, in this order: `kv_layers` (once, before it sizes the KV pool: extra per-token KV
the drafter keeps in the same pages as the target), `bind` (once, with a DrafterContext), then per
step `propose` for the decoding requests that draft and `observe` after every target forward (prefill chunks
included), and `finished` when a request ends or is preempted. The plain steps between drafting ones take the
engine's ordinary path (overlap schedule included): a drafter that reads hidden states (`needs_hidden`) observes
them too, once their tokens are read (under the overlap schedule after the next step was launched); one that
does not may miss them, and every token they added is in the next DraftRequest.token_ids. Under the overlap
schedule, a drafter that declares `drafts_on_device` drafts each verify step of a run from the step before it,
which the host has not read (DeviceTokens; with `needs_hidden`, its hidden rows too): inside such a run `observe`
comes only for the run's last verify step, once its tokens are read. (A drafter that observes without
`needs_hidden` has its verify steps run synchronously instead: it would miss the steps inside a run.)

Request ids: a rid names one live request; `finished(rid)` comes exactly once per request, after its last
`observe`, when it ends (length, stop, abort, failure). The same rid may then come back for a new request
(servers pass clients' ids through), so anything kept for a rid must go in `finished`. A preempted request is
not finished: it keeps its rid and is prefilled again, so `observe` may restart at an earlier position.
Draft ids must lie in 0 .. DrafterContext.vocab_size - 1: the engine drops a request's drafts that contain
another id and logs it once, naming the drafter.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Sequence

import attrs
import torch


@attrs.frozen
class DrafterCaps:
    needs_weights: bool = False  # uses the checkpoint's MTP (NextN) layers
    # reads the target's hidden states (before the final norm) in `observe` (and in DeviceTokens.hidden)
    needs_hidden: bool = False
    gives_probs: bool = False  # returns draft probabilities (rejection sampling with q); else drafts are point masses
    architectures: frozenset[str] | None = None  # model_type values it supports; None: every architecture
    # proposing costs little (host lookups, no forward): the adaptive policy asks for every request first and
    # then chooses among the drafts; otherwise it asks only for the drafts it chose to verify
    cheap_proposals: bool = False
    # `propose_on_device` drafts from state the drafter keeps on the device, given the tokens of a step the host
    # has not read yet (DeviceTokens), with no read back: such a drafter can draft for the step after a verify
    # step before that step's tokens reach the host (API 2)
    drafts_on_device: bool = False


@attrs.define
class DraftRequest:
    """What a drafter sees of one request: its ids so far and where its KV ends."""

    rid: str
    token_ids: Sequence[int]  # prompt + accepted output, the last one not yet through the target
    num_cached: int  # positions with target KV (len(token_ids) - 1 for a decoding request)
    pages: Sequence[int] = ()  # the request's KV page table; pages cover num_cached + 1 + num_steps positions
    # API 2: the most drafts the engine verifies for this request this step (None: num_steps); a drafter whose
    # drafts cost forwards may stop there (drafts beyond it are dropped)
    max_drafts: int | None = None


@attrs.define
class Drafts:
    tokens: list[list[int]]  # per request, 0..num_steps proposed ids
    probs: torch.Tensor | None = None  # [requests, num_steps, vocab] draft distributions (gives_probs)


@attrs.frozen
class TargetStep:
    """What one target forward kept, per request (`observe`): positions start .. start+len(next_ids)-1 of the
    request now hold valid target KV, and next_ids[i] is the token at position start+i+1 (prompt tokens inside
    a prompt, then the tokens the engine accepted; the last of a request whose next token was sampled is that
    token). Rejected draft positions are not in it."""

    rids: Sequence[str]
    starts: Sequence[int]
    next_ids: Sequence[Sequence[int]]
    pages: Sequence[Sequence[int]]
    hidden: torch.Tensor | None = None  # [sum(len(next_ids[i])), H] pre-final-norm hidden states (needs_hidden)


@attrs.frozen
class DeviceTokens:
    """Tokens a step emitted that the host has not read yet (API 2), one row per DraftRequest of the same
    `propose_on_device` call: row i's first counts[i] tokens follow requests[i].token_ids (0: none)."""

    tokens: torch.Tensor  # [R, W] int64 on the device
    counts: torch.Tensor  # [R] int64 on the device
    # [R, W, H] the target's pre-final-norm hidden state of each token's position (row i's k-th at
    # requests[i].num_cached + k: the position whose next token is tokens[i, k]); given to a drafter that declares
    # needs_hidden (API 2; None otherwise)
    hidden: torch.Tensor | None = None
    # the most drafts any row verifies in the step these drafts are for: a drafter whose drafts cost forwards may
    # stop there (None: num_steps; API 2)
    max_drafts: int | None = None


@attrs.frozen
class DeviceDrafts:
    """Drafts left on the device (API 2): row i's first counts[i] ids are request i's drafts, -1 after them."""

    tokens: torch.Tensor  # [R, num_steps] int64
    counts: torch.Tensor  # [R] int64


class StaticProposer(abc.ABC):
    """`propose_on_device` split at a graph's edge (API 2): the host half (`stage`) and a device half (`propose`)
    whose shapes depend only on its row count and that reads no host value, so the engine captures it in a CUDA
    graph with the rest of an overlapped verify step and replays it per step (where graphs are captured; elsewhere
    it simply runs). Its drafts equal `propose_on_device`'s for the same requests and pending tokens."""

    @abc.abstractmethod
    def stage(self, requests: Sequence[DraftRequest], rows: int) -> None:
        """On the host, before a `propose` of `rows` rows (rows >= len(requests)): what the host knows of each request
        (its token_ids), written to the proposer's own static inputs with a few tensor ops; rows beyond the
        requests are padding, which propose nothing."""

    @abc.abstractmethod
    def propose(self, pending: DeviceTokens) -> DeviceDrafts:
        """On the device, from the last `stage`: drafts for its rows (pending.tokens' row count, the staged `rows`),
        after each row's staged tokens and its first pending.counts[i] pending tokens. No host value is read."""

    def replayable(self) -> bool:
        """Whether graphs captured over this proposer earlier still read its current state (False: it moved its
        buffers, and the engine runs the step without them)."""
        return True


@attrs.frozen
class DrafterContext:
    """What `bind` gives: the target model (embedding, lm_head, MTP layers), the KV pool, the config, the
    pool layer ids of the drafter's own KV (as many as `kv_layers` returned), and `batch_of`, which makes the
    ForwardBatch of [(new token ids, prefix length, page table), ...] over the pool (a drafter's own forward);
    `batch_of(seqs, rows=True)` (API 2) makes one-token seqs decode rows even where one sits at position 0 (a
    prompt's first token): each reads the cache up to itself, the rows before it having written theirs.
    `vocab_size` is the target's vocabulary (logit rows; draft ids lie below it); 0 only where a caller built
    the context without it. `model` and `config` are the engine's own objects, not API: read what they hold
    through the fields here where one exists.

    `graphs_for(step, width)` (call it in `bind`: it captures there) takes a step of the drafter's own layers,
    `step(batch, hidden) -> tuple of tensors with one row per token` (`hidden` [B, width] in the model dtype,
    one row per token of `batch`), and returns a function of the same signature and results that replays the
    step from CUDA graphs captured per padded batch size when `batch` is a decode batch that fits (the step must
    then read no host value: build it from the batch's tensors, as the model's layers do), and runs the step
    itself otherwise; its `can_replay(rows)` says whether a decode batch of that many rows would replay now.
    Captured steps see padding rows beyond the batch (position 0, KV in the pool's scratch page, hidden 0):
    every output row must depend on its own row only. Where the engine has no graphs (a CPU, flags, plugins
    that are not graph-safe) or the capture fails, the step just runs eagerly."""

    model: Any
    kv: Any
    config: Any
    device: torch.device
    kv_layer_ids: Sequence[int] = ()
    batch_of: Callable[[Sequence[tuple[Sequence[int], int, Sequence[int]]]], Any] | None = None
    graphs_for: Callable[[Callable[[Any, torch.Tensor], tuple[torch.Tensor, ...]], int], Any] | None = None
    vocab_size: int = 0  # API 2


class Drafter(abc.ABC):
    caps: ClassVar[DrafterCaps]

    def __init__(self, num_steps: int):
        self.num_steps = num_steps

    def kv_layers(self, model: Any) -> list[list[tuple[int, ...]]]:
        """Per extra KV layer the drafter keeps in the pool, the per-token shapes (like model.kv_shapes())."""
        return []

    def bind(self, context: DrafterContext) -> None:
        """Called once at start-up, before any step (weights, own KV)."""

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> Drafts:
        """Draft tokens for each request (fewer, or none, where it has nothing good to say)."""

    def propose_on_device(self, requests: Sequence[DraftRequest], pending: DeviceTokens | None = None) -> DeviceDrafts:
        """A drafter that declares `drafts_on_device` (API 2): the drafts `propose` would give for each request's
        token_ids followed by its pending tokens, computed and left on the device (no read back)."""
        raise NotImplementedError(f"{type(self).__name__} does not declare DrafterCaps.drafts_on_device")

    def static_proposer(self, max_rows: int, pending_width: int) -> StaticProposer | None:
        """A drafter that declares `drafts_on_device` may offer its device drafting at static shapes (API 2): up to
        `max_rows` rows, pending tokens [rows, pending_width]. None (the default): its verify steps under the overlap
        schedule run `propose_on_device` eagerly."""
        return None

    def proposal_cost(self, n: int) -> float:
        """Seconds the device work of proposing `num_steps` drafts for each of n requests takes (API 2), measured
        now, on scratch state (the engine asks while it measures its own step costs, on every rank at once, at
        start-up or when a batch size is first used): the adaptive policy adds it to a verify step's cost. 0.0
        (the default): proposing costs nothing worth weighing (host lookups)."""
        return 0.0

    def proposal_costs(self, n: int) -> list[float]:
        """Seconds proposing k = 1 .. num_steps drafts for each of n requests takes (API 2), measured as
        `proposal_cost` is: a drafter that honours DraftRequest.max_drafts (a chain of forwards cut short) makes
        the policy weigh short verify steps at what they cost. Default: `proposal_cost(n)` for every k."""
        return [self.proposal_cost(n)] * max(self.num_steps, 1)

    def observe(self, step: TargetStep) -> None:
        """After every target forward: the positions the target kept and the tokens that followed them."""

    def finished(self, rid: str) -> None:
        """The request ended or was preempted: drop anything kept for it."""
