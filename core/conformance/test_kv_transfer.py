"""KV transfer contract: pages land byte for byte, DONE only after they have, and nothing lands after it may not.

Two instances of the backend, in two processes when it declares `cross_process` (a spawned child holds
the receiver, or the sender), else in this one, move random pages between pools of both layouts: MHA
(a key and a value tensor per layer) and MLA (one latent tensor per layer). Checked: every destination
page equals its source page and no other page changed; the metadata row comes back exactly; runs and
non-consecutive pages; several rooms at once; the moment either side reports DONE the bytes are already
there; writes for a room the receiver never expected or aborted are dropped and the sender sees FAILED;
after the receiver's `abort` returns its pages do not change again; `abort` is idempotent; `start` and
`poll` return at once; a peer with another KV layout is refused at `connect`; bad arguments raise at `start`.
Pools live in CUDA memory when the backend declares "cuda" and a GPU is visible, else in CPU memory.
"""

from __future__ import annotations

import inspect
import itertools
import random
import time

import attrs
import pytest
import torch

from moeplex.conformance.kv_transfer_peer import LocalPeer, PoolSpec, RemotePeer
from moeplex.conformance.plugin import load_plugin
from moeplex.interfaces import PluginError, TransferStatus

PENDING, DONE, FAILED = TransferStatus.PENDING, TransferStatus.DONE, TransferStatus.FAILED
WAIT_S = 20.0  # a transfer of a few KiB that takes longer than this is stuck
POLL_LIMIT_S = 0.2  # `start` and `poll` return well within this, whatever is in flight
LAYOUTS = {
    "mha": PoolSpec(layers=3, per_layer=2, token_shape=(2, 8)),  # key and value, [kv_heads, head_dim]
    "mla": PoolSpec(layers=3, per_layer=1, token_shape=(1, 24)),  # compressed latent + rope key
}
_seeds = itertools.count(1)


@pytest.fixture(scope="module")
def backend_cls(moeplex_plugin):
    cls = load_plugin(moeplex_plugin)
    if "cpu" not in cls.caps.devices and not torch.cuda.is_available():
        pytest.skip(f"kv_transfer '{moeplex_plugin.name}' registers only {sorted(cls.caps.devices)} memory and no CUDA GPU is visible")
    if cls.caps.needs_extra:
        try:
            cls().close()
        except PluginError as exc:  # its library is not installed here
            pytest.skip(str(exc))
    return cls


@pytest.fixture(scope="module")
def peers(backend_cls, moeplex_plugin):
    """(the sender's process, the receiver's process): this one and a child when the backend crosses processes."""
    local = LocalPeer(backend_cls)
    remote = RemotePeer(moeplex_plugin.kind, moeplex_plugin.name) if backend_cls.caps.cross_process else local
    yield local, remote
    local.shutdown()
    if remote is not local:
        remote.shutdown()


@attrs.define
class End:
    """One side of a transfer: the process that holds it and its id there."""

    peer: LocalPeer
    side: int

    def __call__(self, method: str, *args):
        return self.peer.call(self.side, method, *args)

    def pages(self, pages):
        return self.peer.pages(self.side, list(pages))


@pytest.fixture
def make_pair(peers, backend_cls):
    made: list[End] = []

    def make(layout: str = "mha", reverse: bool = False, **spec_changes) -> tuple[End, End]:
        device = "cuda" if "cuda" in backend_cls.caps.devices and torch.cuda.is_available() else "cpu"
        spec = attrs.evolve(LAYOUTS[layout], device=device, **spec_changes)
        send_peer, recv_peer = peers[::-1] if reverse else peers
        sender = End(send_peer, send_peer.new(spec, next(_seeds)))
        receiver = End(recv_peer, recv_peer.new(spec, next(_seeds)))
        made.extend([sender, receiver])
        return sender, receiver

    yield make
    for end in made:
        end.peer.drop(end.side)


def timed(end: End, method: str, *args):
    began = time.perf_counter()
    result = end(method, *args)
    took = time.perf_counter() - began
    assert took < POLL_LIMIT_S, f"`{method}` took {took:.3f} s; it must return at once"
    return result


def wait(end: End, room: int) -> TransferStatus:
    deadline = time.monotonic() + WAIT_S
    while (status := timed(end, "poll", room)) is PENDING:
        assert time.monotonic() < deadline, f"room {room} still pending after {WAIT_S:.0f} s"
        time.sleep(0.002)
    return status


def random_pages(rng: random.Random, pages: int, count: int) -> tuple[list[int], list[int]]:
    """Source and destination pages with runs (a block of consecutive pages on both sides) and scattered pages."""
    src = rng.sample(range(pages), count)
    dst = rng.sample(range(pages), count)
    run = min(4, count)
    s0, d0 = rng.randrange(pages - run), rng.randrange(pages - run)
    src[:run], dst[:run] = list(range(s0, s0 + run)), list(range(d0, d0 + run))
    if len(set(src)) != count or len(set(dst)) != count:
        return random_pages(rng, pages, count)
    return src, dst


def moved(sender: End, receiver: End, src, dst) -> bool:
    return all(torch.equal(a, b) for a, b in zip(sender.pages(src), receiver.pages(dst)))


def connect(sender: End, receiver: End) -> str:
    return sender("connect", receiver("endpoint"))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moves_pages_and_metadata(backend_cls, make_pair, layout):
    sender, receiver = make_pair(layout)
    rng = random.Random(layout)
    peer = connect(sender, receiver)
    src, dst = random_pages(rng, LAYOUTS[layout].pages, 11)
    untouched = [p for p in range(LAYOUTS[layout].pages) if p not in dst]
    before = receiver.pages(untouched)
    row = bytes(rng.randrange(256) for _ in range(37))
    receiver("expect", 1, dst)
    timed(sender, "start", 1, peer, src, dst, row)
    assert wait(receiver, 1) is DONE
    assert moved(sender, receiver, src, dst), "the receiver said DONE before every destination page equalled its source"
    assert wait(sender, 1) is DONE
    assert receiver("metadata", 1) == row
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.pages(untouched))), "a page outside the room changed"


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_done_means_the_bytes_landed(backend_cls, peers, side):
    """Whichever side is polled alone, the moment it says DONE the destination pages hold the source bytes.

    Both ends live in one process (the child for a cross-process backend; they still talk through the
    backend's own transport), which polls without sleeping and looks at the destination pages right after the
    poll that said DONE: a backend whose bytes land after its DONE is caught however soon after (a look from
    another process, a message away, let bytes 2 ms late through on some runs)."""
    peer = peers[1]
    spec = LAYOUTS["mha"]
    sender, receiver = End(peer, peer.new(spec, next(_seeds))), End(peer, peer.new(spec, next(_seeds)))
    try:
        link = connect(sender, receiver)
        rng = random.Random(side)
        for room in (10, 11, 12):
            src, dst = random_pages(rng, spec.pages, 9)
            want = sender.pages(src)
            receiver("expect", room, dst)
            sender("start", room, link, src, dst, b"row %d" % room)
            polled = sender if side == "sender" else receiver
            status, landed = peer.wait_landed(polled.side, room, receiver.side, dst, want, WAIT_S)
            assert status is not PENDING, f"room {room} still pending after {WAIT_S:.0f} s"
            assert status is DONE, f"room {room}: {status.value}"
            assert landed, f"the {side} reported DONE for room {room} before the bytes landed"
            assert wait(receiver if side == "sender" else sender, room) is DONE
    finally:
        peer.drop(sender.side)
        peer.drop(receiver.side)


def test_reverse_direction(backend_cls, make_pair):
    """Sender and receiver swap processes: the receiver is the test's own process this time."""
    sender, receiver = make_pair("mla", reverse=True)
    peer = connect(sender, receiver)
    src, dst = [3, 4, 5, 9, 1], [0, 1, 2, 20, 7]
    receiver("expect", 5, dst)
    sender("start", 5, peer, src, dst, b"")
    assert wait(receiver, 5) is DONE and moved(sender, receiver, src, dst)
    assert receiver("metadata", 5) == b""


@pytest.mark.parametrize(
    "src,dst",
    [([7, 6, 5, 4], [0, 1, 2, 3]), ([0, 2, 4, 6], [1, 3, 5, 7]), ([1, 2, 3, 10, 11], [20, 21, 22, 5, 6]), ([9], [9])],
    ids=["reversed", "strided", "two_runs", "one_page"],
)
def test_non_consecutive_pages(backend_cls, make_pair, src, dst):
    sender, receiver = make_pair("mha")
    peer = connect(sender, receiver)
    receiver("expect", 3, dst)
    sender("start", 3, peer, src, dst, b"x")
    assert wait(receiver, 3) is DONE and wait(sender, 3) is DONE
    assert moved(sender, receiver, src, dst)


def test_several_rooms_in_flight(backend_cls, make_pair):
    sender, receiver = make_pair("mla")
    peer = connect(sender, receiver)
    plan = {100: ([0, 1, 2], [5, 6, 7]), 101: ([3, 9], [0, 11]), 102: ([10, 12, 14, 15], [1, 2, 3, 4])}
    for room, (_, dst) in plan.items():
        receiver("expect", room, dst)
    for room, (src, dst) in plan.items():
        sender("start", room, peer, src, dst, b"room %d" % room)
    for room, (src, dst) in plan.items():
        assert wait(receiver, room) is DONE and wait(sender, room) is DONE
        assert moved(sender, receiver, src, dst) and receiver("metadata", room) == b"room %d" % room


def test_unexpected_room_is_dropped_and_fails(backend_cls, make_pair):
    sender, receiver = make_pair("mha")
    peer = connect(sender, receiver)
    before = receiver.pages([2, 3])
    sender("start", 77, peer, [0, 1], [2, 3], b"nobody asked")
    assert wait(sender, 77) is FAILED
    assert receiver("poll", 77) is FAILED
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.pages([2, 3]))), "bytes of an unexpected room landed"


def test_room_aborted_by_the_receiver_is_dropped(backend_cls, make_pair):
    sender, receiver = make_pair("mha")
    peer = connect(sender, receiver)
    before = receiver.pages([4, 5])
    receiver("expect", 8, [4, 5])
    receiver("abort", 8)
    sender("start", 8, peer, [0, 1], [4, 5], b"too late")
    assert wait(sender, 8) is FAILED
    assert receiver("poll", 8) is FAILED
    assert all(torch.equal(a, b) for a, b in zip(before, receiver.pages([4, 5]))), "bytes of an aborted room landed"


def test_nothing_lands_after_the_receiver_aborts(backend_cls, make_pair):
    """Aborting mid-transfer: once `abort` returned, the pages may go to another request and must not change."""
    sender, receiver = make_pair("mha", pages=64)
    peer = connect(sender, receiver)
    for room in range(200, 206):
        pages = list(range(64))
        receiver("expect", room, pages)
        sender("start", room, peer, pages[::-1], pages, b"")
        time.sleep(0.001 * (room - 200))
        receiver("abort", room)
        snapshot = receiver.pages(pages)
        assert receiver("poll", room) is FAILED
        status = wait(sender, room)
        assert all(torch.equal(a, b) for a, b in zip(snapshot, receiver.pages(pages))), (
            f"room {room}: a destination page changed after the receiver's abort returned (sender: {status.value})"
        )


def test_abort_is_idempotent_and_release_forgets(backend_cls, make_pair):
    sender, receiver = make_pair("mla")
    peer = connect(sender, receiver)
    receiver("expect", 9, [1, 2])
    sender("start", 9, peer, [1, 2], [1, 2], b"")
    for end in (sender, receiver):
        timed(end, "abort", 9)
        timed(end, "abort", 9)
        assert end("poll", 9) is FAILED
        end("release", 9)
        assert end("poll", 9) is FAILED  # a room it does not know
    receiver("abort", 12345)  # never seen: no error


def test_start_and_poll_return_at_once(backend_cls, make_pair):
    sender, receiver = make_pair("mha", pages=200, token_shape=(8, 64))  # 200 pages of 24 KiB (all regions): 5 MB
    peer = connect(sender, receiver)
    pages = list(range(200))
    receiver("expect", 1, pages)
    timed(sender, "start", 1, peer, pages, pages[::-1], b"big")
    for end in (sender, receiver):
        assert wait(end, 1) is DONE  # every poll on the way timed
    assert moved(sender, receiver, pages, pages[::-1])


def test_another_layout_is_refused_at_connect(backend_cls, make_pair):
    sender, _ = make_pair("mha")
    _, receiver = make_pair("mha", token_shape=(2, 16))
    with pytest.raises(PluginError):
        connect(sender, receiver)
    _, mla = make_pair("mla")
    with pytest.raises(PluginError):
        connect(sender, mla)


def test_bad_arguments_raise_at_start(backend_cls, make_pair):
    sender, receiver = make_pair("mha")
    peer = connect(sender, receiver)
    pages = LAYOUTS["mha"].pages
    receiver("expect", 4, [0, 1])
    with pytest.raises(ValueError):
        sender("start", 4, peer, [0, 1], [0, 1], bytes(LAYOUTS["mha"].metadata_bytes + 1))
    with pytest.raises(ValueError):
        sender("start", 4, peer, [0, 1], [0], b"")
    with pytest.raises(ValueError):
        sender("start", 4, peer, [0, pages + 1], [0, 1], b"")
    with pytest.raises(ValueError):
        sender("start", 4, peer, [0, 1], [0, pages + 1], b"")


DEAD_PEER_TIMEOUT_S = 2.0  # passed as `timeout_s` to a backend whose constructor takes it
DEAD_PEER_SLACK_S = 5.0  # beyond its timeout: a heartbeat period, the process's death noticed by the OS


@pytest.mark.parametrize("dies", ["receiver"])
def test_a_dead_peer_ends_every_wait_with_a_reason(backend_cls, moeplex_plugin, dies):
    """The receiver's process is killed (SIGKILL; for a backend whose peers share one process, its instance
    is closed and forgotten) with one room in flight and another started after: every poll on the sender
    leaves PENDING within the backend's `timeout_s` (built with a short one where the constructor takes it,
    as --disaggregation-transfer-config does), the late room FAILED, and each FAILED room says why."""
    takes_timeout = "timeout_s" in inspect.signature(backend_cls).parameters
    options = {"timeout_s": DEAD_PEER_TIMEOUT_S} if takes_timeout else {}
    limit = (DEAD_PEER_TIMEOUT_S if takes_timeout else WAIT_S) + DEAD_PEER_SLACK_S
    local = LocalPeer(backend_cls)
    dying = RemotePeer(moeplex_plugin.kind, moeplex_plugin.name) if backend_cls.caps.cross_process else LocalPeer(backend_cls)
    spec = attrs.evolve(LAYOUTS["mha"], pages=64)
    try:
        sender = End(local, local.new(spec, next(_seeds), options))
        receiver = End(dying, dying.new(spec, next(_seeds), options))
        link = connect(sender, receiver)
        pages = list(range(spec.pages))
        for room in (1, 2):
            receiver("expect", room, pages)
        sender("start", 1, link, pages[::-1], pages, b"in flight")
        dying.kill()
        died = time.monotonic()
        sender("start", 2, link, pages, pages, b"after the death")
        outcome = {}
        for room in (1, 2):
            while (status := timed(sender, "poll", room)) is PENDING:
                waited = time.monotonic() - died
                assert waited < limit, (
                    f"room {room} still pending {waited:.1f} s after the receiver died "
                    f"(timeout_s {options.get('timeout_s', 'default')})")
                time.sleep(0.01)
            outcome[room] = status
            if status is FAILED:
                assert sender("reason", room), f"room {room} FAILED without a reason"
        assert outcome[2] is FAILED, "a room started after the receiver died did not fail"
    finally:
        local.shutdown()
        dying.shutdown()
