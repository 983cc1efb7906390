"""The leader's transfer book, one rule at a time, on a clock the test moves: states, deadlines, combined polls."""

from __future__ import annotations

import pytest

from moeplex.config import EngineConfig
from moeplex.disagg.book import TransferBook
from moeplex.messages import GroupReport, GroupStats, Updates


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def book(mode: str, attn_tp: int = 1) -> tuple[TransferBook, Clock]:
    config = EngineConfig(model="unused", page_size=4, disaggregation_mode=mode, disaggregation_bootstrap_timeout=5,
                          disaggregation_transfer_timeout=10, disaggregation_lease=20)
    clock = Clock()
    return TransferBook(config, page_bytes=1000, attn_tp_size=attn_tp, clock=clock), clock


def report(finished=(), reserved=(), dp_rank=0) -> GroupReport:
    """A round in which the requests `finished` ((rid, error) each) each gained a last token and ended."""
    ends = {row: ("abort" if error else "length", None, error) for row, (_, error) in enumerate(finished)}
    updates = Updates(tuple(rid for rid, _ in finished), (7,) * len(finished), (), ("",) * len(finished), ends=ends)
    return GroupReport(dp_rank, updates, True, GroupStats(), tuple(reserved))


def finished(rid: str, error: str | None = None) -> tuple[str, str | None]:
    return rid, error


def test_prefill_goes_bootstrapping_waiting_transferring_done():
    b, clock = book("prefill")
    b.admitted("r", 0, room=1, prompt_len=9)
    assert b.stats().states["bootstrapping"] == 1
    assert b.destination("r", senders=1)
    assert b.stats().states["waiting"] == 1
    b.absorb([report([finished("r")])])
    assert b.stats().states["transferring"] == 1
    b.absorb_polls([{"r": "pending"}])
    assert b.decide() == []
    clock.now += 2
    b.absorb_polls([{"r": "done"}])
    [end] = b.decide()
    assert end.ok and end.rid == "r" and not b.pending
    assert b.stats().outcomes == {"done": 1} and b.bytes == 3 * 1000 and b.seconds == pytest.approx(2)


def test_prefill_lease_ends_a_transfer_never_confirmed():
    b, clock = book("prefill")
    b.admitted("r", 0, room=1, prompt_len=4)
    b.destination("r", 1)
    b.absorb([report([finished("r")])])
    clock.now += 19.9
    assert b.decide() == []
    clock.now += 0.2
    [end] = b.decide()
    assert not end.ok and "20 s lease" in end.reason
    b.absorb_polls([{"r": "done"}])  # the ack that comes after the lease: the pages are gone, it changes nothing
    assert b.decide() == [] and b.stats().outcomes == {"timeout": 1}


def test_prefill_without_a_decode_registration_times_out():
    b, clock = book("prefill")
    b.admitted("r", 0, room=1, prompt_len=4)
    clock.now += 5.1
    [end] = b.decide()
    assert not end.ok and "no decode server registered" in end.reason


def test_decode_needs_every_receiving_rank_done_and_fails_on_any():
    b, clock = book("decode", attn_tp=2)
    for rid in ("a", "b"):
        b.admitted(rid, 0, room=1, prompt_len=4)
    assert b.absorb([report(reserved=[("a", (3, 4)), ("b", (5, 6))])]) == [("a", 0, (3, 4)), ("b", 0, (5, 6))]
    assert b.stats().states["waiting"] == 2
    b.absorb_polls([{"a": "done", "b": "done"}, {"a": "pending", "b": "failed: injected failure"}])
    [end_b] = b.decide()
    assert (end_b.rid, end_b.ok) == ("b", False) and end_b.reason == "the KV transfer failed (injected failure)"
    b.absorb_polls([{"a": "done"}, {"a": "done"}])
    [end_a] = b.decide()
    assert (end_a.rid, end_a.ok) == ("a", True)


def test_decode_transfer_deadline_then_late_done_is_ignored():
    b, clock = book("decode")
    b.admitted("r", 0, room=1, prompt_len=4)
    b.absorb([report(reserved=[("r", (0,))])])
    clock.now += 10.1
    [end] = b.decide()
    assert not end.ok and end.reason == "the KV transfer did not finish within 10 s"
    b.absorb_polls([{"r": "done"}])
    assert b.decide() == []


def test_decode_waiting_for_pages_times_out_on_the_bootstrap_deadline():
    b, clock = book("decode")
    b.admitted("r", 0, room=1, prompt_len=4)
    clock.now += 5.1
    [end] = b.decide()
    assert "no KV pages for this request came free within 5 s" == end.reason


def test_a_request_that_fails_on_its_ranks_leaves_the_book():
    b, _ = book("prefill")
    b.admitted("r", 0, room=1, prompt_len=4)
    b.absorb([report([finished("r", error="sampling failed")])])
    assert not b.pending and b.stats().outcomes == {"failed": 1}


@pytest.mark.parametrize("backend, why", [
    ("loopback", "kv_transfer 'loopback' moves pages within one process only"),
    ("cuda-ipc", "kv_transfer 'cuda-ipc' registers cuda buffers, and this engine's KV cache is on cpu"),
])
def test_a_backend_that_cannot_serve_the_role_is_refused_before_start(backend, why):
    from moeplex.disagg.rank import transfer_backend

    config = EngineConfig(model="unused", disaggregation_mode="decode", disaggregation_transfer_backend=backend)
    with pytest.raises(ValueError, match=why):
        transfer_backend(config)


def test_decode_reports_each_request_whose_kv_landed_once_and_no_other():
    """The front end stops watching a request's prefill server once its KV landed (docs/pd.md): only a DONE on
    every receiving rank lands it; a failure, a timeout or a prefill-side DONE does not."""
    b, clock = book("decode", attn_tp=2)
    for rid in ("landed", "half", "failed", "late"):
        b.admitted(rid, 0, room=1, prompt_len=4)
    b.absorb([report(reserved=[(rid, (1,)) for rid in ("landed", "half", "failed", "late")])])
    b.absorb_polls([{"landed": "done", "half": "done", "failed": "failed: gone"}, {"landed": "done", "half": "pending"}])
    assert b.take_landed() == ("landed",) and b.take_landed() == ()
    clock.now += 11
    b.decide()  # "half" and "late" time out
    assert b.take_landed() == ()
    p, _ = book("prefill")
    p.admitted("r", 0, room=1, prompt_len=4)
    p.destination("r", 1)
    p.absorb([report([finished("r")])])
    p.absorb_polls([{"r": "done"}])
    assert p.take_landed() == ()
