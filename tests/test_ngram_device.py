"""The device-side n-gram drafter proposes exactly what the host one does, given the same history."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeplex.interfaces import DeviceTokens, DraftRequest, Drafter, DrafterCaps, DrafterContext
from moeplex.plugins.drafters.ngram import NgramDrafter, lookup
from moeplex.plugins.drafters.ngram_device import SLACK, lookup_batch


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=5),
       st.integers(1, 5), st.integers(1, 3), st.integers(1, 4), st.integers(2, 40))
def test_lookup_batch_equals_lookup(histories, max_n, min_n, count, window):
    width = max(len(h) for h in histories) + 3  # junk after each row's length must not be read
    buffer = torch.full((len(histories), width), 2, dtype=torch.int64)
    for r, ids in enumerate(histories):
        buffer[r, : len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(h) for h in histories])
    drafts, counts = lookup_batch(buffer, lengths, max_n, min_n, count, window)
    for r, ids in enumerate(histories):
        tail = np.asarray(ids, dtype=np.int64)[-window:]
        want = lookup(tail, max_n, min_n, count) if tail.size > 1 else []
        assert drafts[r, : counts[r]].tolist() == want
        assert (drafts[r, counts[r] :] == -1).all()


def _host_drafts(drafter: NgramDrafter, requests, extra) -> list[list[int]]:
    full = [DraftRequest(r.rid, list(r.token_ids) + e, len(r.token_ids) + len(e) - 1) for r, e in zip(requests, extra)]
    return drafter.propose(full).tokens


@pytest.mark.parametrize("growth", [3, 40])
@pytest.mark.parametrize("seed", range(6))
def test_the_device_drafter_proposes_what_the_host_drafter_does(seed, growth):
    """Requests that grow, pending tokens the host has not read, rows rewritten when full (a small window), rids
    finished and reused for another sequence: every step, the same drafts as the host drafter's on the whole ids."""
    rng = random.Random(seed)
    host, device = NgramDrafter(3), NgramDrafter(3)
    host.window = device.window = 6  # rows are rewritten every ~70 tokens
    live: dict[str, list[int]] = {}
    for step in range(60):
        if len(live) < 5 and rng.random() < 0.3:
            rid = str(rng.randrange(8))
            if rid not in live:
                live[rid] = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        if not live:
            continue
        rids = rng.sample(sorted(live), rng.randint(1, len(live)))
        requests = [DraftRequest(rid, list(live[rid]), len(live[rid]) - 1) for rid in rids]
        width = rng.randint(1, 5)
        extra = [[rng.randrange(4) for _ in range(rng.randint(0, width))] for _ in rids]
        pending = None
        if any(extra) or rng.random() < 0.5:
            tokens = torch.tensor([e + [rng.randrange(9)] * (width - len(e)) for e in extra], dtype=torch.int64)
            pending = DeviceTokens(tokens, torch.tensor([len(e) for e in extra]))
        else:
            extra = [[] for _ in rids]
        got = device.propose_on_device(requests, pending)
        assert [got.tokens[i, : got.counts[i]].tolist() for i in range(len(rids))] == _host_drafts(host, requests, extra)
        for rid, e in zip(rids, extra):  # the host reads the pending tokens, and a few more come
            live[rid] += e + [rng.randrange(4) for _ in range(rng.randint(0, growth))]
        for rid in list(live):
            if rng.random() < 0.1:
                del live[rid]
                host.finished(rid)
                device.finished(rid)


def test_many_requests_grow_the_buffer_and_finished_rows_are_reused():
    drafter = NgramDrafter(2)
    requests = [DraftRequest(str(i), [1, 2, 3, 1, 2, i], 5) for i in range(20)]
    got = drafter.propose_on_device(requests)
    assert [got.tokens[i, : got.counts[i]].tolist() for i in range(20)] == drafter.propose(requests).tokens
    rows = drafter._on_device.buffer.shape[0]
    for i in range(20):
        drafter.finished(str(i))
    drafter.propose_on_device(requests)
    assert drafter._on_device.buffer.shape[0] == rows


def test_too_many_pending_tokens_are_refused():
    drafter = NgramDrafter(2)
    pending = DeviceTokens(torch.zeros(1, SLACK + 1, dtype=torch.int64), torch.tensor([1]))
    with pytest.raises(ValueError, match="pending tokens"):
        drafter.propose_on_device([DraftRequest("a", [1, 2], 1)], pending)


def test_a_drafter_without_the_capability_says_so():
    class HostOnly(Drafter):
        def propose(self, requests):
            raise AssertionError

    assert not DrafterCaps().drafts_on_device  # the default: today's host path
    with pytest.raises(NotImplementedError, match="drafts_on_device"):
        HostOnly(2).propose_on_device([])


@pytest.mark.gpu
def test_on_gpu_the_device_drafter_proposes_what_the_host_drafter_does():
    """The same drafts from a CUDA buffer (pinned copies in, pending tokens written on the device, no read back)."""
    rng = random.Random(5)
    host, device = NgramDrafter(3), NgramDrafter(3)
    device.bind(DrafterContext(model=None, kv=None, config=None, device=torch.device("cuda")))
    live = {str(i): [rng.randrange(5) for _ in range(rng.randint(2, 200))] for i in range(16)}
    for _ in range(20):
        requests = [DraftRequest(rid, list(ids), len(ids) - 1) for rid, ids in live.items()]
        extra = [[rng.randrange(5) for _ in range(rng.randint(0, 4))] for _ in requests]
        tokens = torch.tensor([e + [0] * (4 - len(e)) for e in extra], dtype=torch.int64, device="cuda")
        got = device.propose_on_device(requests, DeviceTokens(tokens, torch.tensor([len(e) for e in extra], device="cuda")))
        assert got.tokens.device.type == "cuda"
        assert [got.tokens[i, : got.counts[i]].tolist() for i in range(len(requests))] == _host_drafts(host, requests, extra)
        for (rid, ids), e in zip(live.items(), extra):
            ids += e + [rng.randrange(5)]
