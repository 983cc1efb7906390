"""The kv_transfer kind and what each built-in backend promises beyond the shared contract (its faults and liveness).

The shared contract is the conformance suite (tests/test_kv_transfer_conformance.py runs it on every backend).
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import zmq

from moeplex import registry
from moeplex.cli import main
from moeplex.interfaces import KVTransfer, PluginError, TransferStatus, kv_regions, page_runs
from moeplex.plugins.kv_transfer.loopback import LoopbackTransfer
from moeplex.plugins.kv_transfer.zmq import ZmqTransfer

PENDING, DONE, FAILED = TransferStatus.PENDING, TransferStatus.DONE, TransferStatus.FAILED


def pool(seed: int, pages: int = 16, page_size: int = 4) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn((pages + 1) * page_size, 2, 8, generator=gen) for _ in range(2)] for _ in range(2)]


def pair(cls, page_size: int = 4, **options):
    a, b = pool(0, page_size=page_size), pool(1, page_size=page_size)
    sender, receiver = cls(**options), cls(**options)
    sender.register(kv_regions(a, page_size), 64)
    receiver.register(kv_regions(b, page_size), 64)
    return sender, receiver, a, b


def wait_while_pending(backend, room: int, limit_s: float = 10.0) -> TransferStatus:
    deadline = time.monotonic() + limit_s
    while (status := backend.poll(room)) is PENDING and time.monotonic() < deadline:
        time.sleep(0.005)
    return status


def test_kind_is_registered_and_listed(capsys):
    assert registry.KINDS["kv_transfer"] == ("moeplex.kv_transfer", KVTransfer)
    assert {"loopback", "zmq"} <= set(registry.discover("kv_transfer"))
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "KV transfer backends:" in out and "loopback" in out and "zmq" in out
    assert main(["plugins", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    zmq_entry = next(e for e in listing["kv_transfer"] if e["name"] == "zmq")
    assert zmq_entry["capabilities"]["cross_process"] is True


def test_unknown_backend_names_the_installed_ones():
    with pytest.raises(PluginError, match="installed kv_transfers: .*loopback.*zmq"):
        registry.lookup("kv_transfer", "mooncake")


def test_page_runs():
    assert page_runs([1, 2, 3, 7, 8], [4, 5, 6, 0, 1]) == [(1, 4, 3), (7, 0, 2)]
    assert page_runs([3, 2], [0, 1]) == [(3, 0, 1), (2, 1, 1)]
    with pytest.raises(ValueError):
        page_runs([1], [1, 2])


# --- loopback's injected faults ---------------------------------------------------------------------------
def test_loopback_delay_holds_the_bytes_back():
    sender, receiver, a, b = pair(LoopbackTransfer, delay_s=0.3)
    peer = sender.connect(receiver.endpoint())
    receiver.expect(1, [3])
    sender.start(1, peer, [2], [3], b"m")
    time.sleep(0.1)
    assert sender.poll(1) is PENDING and receiver.poll(1) is PENDING
    assert not torch.equal(b[0][0][12:16], a[0][0][8:12])
    assert wait_while_pending(receiver, 1) is DONE and torch.equal(b[0][0][12:16], a[0][0][8:12])
    sender.close(), receiver.close()


def test_loopback_injected_failure_and_drop():
    sender, receiver, _, b = pair(LoopbackTransfer, fail_rate=1.0)
    peer = sender.connect(receiver.endpoint())
    before = b[1][1].clone()
    receiver.expect(1, [0, 1])
    sender.start(1, peer, [0, 1], [0, 1], b"")
    assert wait_while_pending(sender, 1) is FAILED and receiver.poll(1) is FAILED
    sender.fail_rate, sender.drop_rate = 0.0, 1.0
    receiver.expect(2, [0, 1])
    sender.start(2, peer, [0, 1], [0, 1], b"")
    time.sleep(0.1)
    assert sender.poll(2) is PENDING and receiver.poll(2) is PENDING  # lost: only an abort ends it
    receiver.abort(2), sender.abort(2)
    assert sender.poll(2) is FAILED and receiver.poll(2) is FAILED and torch.equal(before, b[1][1])
    sender.close(), receiver.close()


# --- zmq: failures end every wait ---------------------------------------------------------------------------
def test_zmq_injected_failure_reaches_both_sides():
    sender, receiver, _, _ = pair(ZmqTransfer, fail_rate=1.0)
    peer = sender.connect(receiver.endpoint())
    receiver.expect(5, [1])
    sender.start(5, peer, [1], [1], b"")
    assert wait_while_pending(sender, 5) is FAILED
    assert wait_while_pending(receiver, 5) is FAILED
    sender.close(), receiver.close()


def test_zmq_receiver_gone_fails_the_sender_in_time():
    sender, receiver, _, _ = pair(ZmqTransfer, timeout_s=1.0, heartbeat_s=0.1)
    endpoint = receiver.endpoint()
    receiver.close()
    peer = sender.connect(endpoint)
    began = time.monotonic()
    sender.start(1, peer, [0, 1, 2], [0, 1, 2], b"")
    assert wait_while_pending(sender, 1) is FAILED
    assert 0.9 < time.monotonic() - began < 5
    sender.close()


def test_zmq_silent_sender_fails_a_begun_room():
    """A sender that delivered some pages and then went silent (killed mid-transfer): the room fails, no hang."""
    _, receiver, _, b = pair(ZmqTransfer, timeout_s=1.0, heartbeat_s=0.1)
    address = json.loads(receiver.endpoint())["address"]
    receiver.expect(9, [4, 5])
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    one_page = [r.page_bytes for r in receiver.regions]
    frames = [bytes(n) for n in one_page]
    dealer.send_multipart([b"P", json.dumps({"room": 9, "runs": [[4, 1]]}).encode(), *frames])
    deadline = time.monotonic() + 5
    while not torch.equal(b[0][0][16:20], torch.zeros(4, 2, 8)) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert receiver.poll(9) is PENDING  # one page of two landed
    dealer.close(linger=0)
    ctx.term()
    assert wait_while_pending(receiver, 9) is FAILED
    receiver.close()


def test_zmq_writes_outside_the_room_are_refused():
    _, receiver, _, b = pair(ZmqTransfer)
    address = json.loads(receiver.endpoint())["address"]
    receiver.expect(3, [4, 5])
    before = b[0][0].clone()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(address)
    frames = [bytes(r.page_bytes) for r in receiver.regions]
    dealer.send_multipart([b"P", json.dumps({"room": 3, "runs": [[6, 1]]}).encode(), *frames])
    assert dealer.poll(5000), "the receiver did not answer"
    kind, room, reason = dealer.recv_multipart()
    assert kind == b"F" and room == b"3" and b"not destination pages" in reason
    assert receiver.poll(3) is FAILED and torch.equal(before, b[0][0])
    dealer.close(linger=0)
    ctx.term()
    receiver.close()


def test_zmq_close_is_clean():
    sender, receiver, _, _ = pair(ZmqTransfer)
    peer = sender.connect(receiver.endpoint())
    receiver.expect(1, list(range(16)))
    sender.start(1, peer, list(range(16)), list(range(16)), b"")
    before = threading.active_count()
    sender.close()
    receiver.close()
    sender.close()  # idempotent
    assert threading.active_count() <= before - 2
    assert sender.poll(1) in (DONE, FAILED) and receiver.poll(1) in (DONE, FAILED)
    with pytest.raises(RuntimeError):
        sender.start(2, peer, [0], [0], b"")


def test_zmq_refuses_another_backends_endpoint():
    loop, _, _, _ = pair(LoopbackTransfer)
    sender, receiver, _, _ = pair(ZmqTransfer)
    with pytest.raises(PluginError, match="belongs to kv_transfer 'loopback'"):
        sender.connect(loop.endpoint())
    other = ZmqTransfer()
    other.register(kv_regions(pool(2, page_size=8), 8), 64)
    with pytest.raises(PluginError, match="same KV layout"):
        sender.connect(other.endpoint())
    for backend in (loop, sender, receiver, other):
        backend.close()


# --- nixl ------------------------------------------------------------------------------------------------------
def test_nixl_absent_says_which_extra_to_install(monkeypatch):
    from moeplex.plugins.kv_transfer import nixl

    def missing(name):
        raise ImportError(f"No module named '{name}'")

    monkeypatch.setattr(nixl.importlib, "import_module", missing)
    with pytest.raises(PluginError, match=r"install moeplex\[nixl\]") as err:
        registry.lookup("kv_transfer", "nixl")()
    assert str(err.value).count(". ") == 0  # one sentence
    assert registry.lookup("kv_transfer", "nixl").caps.needs_extra == "nixl"


def test_zmq_survives_a_stray_client():
    sender, receiver, a, b = pair(ZmqTransfer)
    ctx = zmq.Context()
    stray = ctx.socket(zmq.DEALER)
    stray.connect(json.loads(receiver.endpoint())["address"])
    stray.send_multipart([b"P", b"not json"])
    stray.send_multipart([b"garbage"])
    peer = sender.connect(receiver.endpoint())
    receiver.expect(1, [2, 3])
    sender.start(1, peer, [5, 6], [2, 3], b"ok")
    assert wait_while_pending(receiver, 1) is DONE and receiver.metadata(1) == b"ok"
    assert torch.equal(b[1][0][8:16], a[1][0][20:28])
    stray.close(linger=0)
    ctx.term()
    sender.close(), receiver.close()


def test_cuda_ipc_handles_travel_as_json():
    """The control socket reads JSON, not pickles: reduce_tensor's arguments survive the round trip."""
    from moeplex.plugins.kv_transfer.cuda_ipc import _ipc_args, _ipc_fields

    args = (torch.Tensor, torch.Size([8, 4]), (4, 1), 2, torch.storage.TypedStorage, torch.bfloat16, 0, b"\x01handle",
            4096, 512, False, b"/torch_123_ref", 7, b"\x00event", True)
    back = _ipc_args(json.loads(json.dumps(_ipc_fields(args))))
    assert back == args


@pytest.mark.parametrize("cls", [LoopbackTransfer, ZmqTransfer], ids=["loopback", "zmq"])
def test_failed_rooms_say_why(cls):
    sender, receiver, _, _ = pair(cls)
    peer = sender.connect(receiver.endpoint())
    sender.start(1, peer, [0], [0], b"")  # never expected
    assert wait_while_pending(sender, 1) is FAILED and "does not expect" in sender.reason(1)
    receiver.expect(2, [1])
    receiver.abort(2)
    assert receiver.reason(2) == "aborted"
    sender.faults.fail_rate = 1.0
    receiver.expect(3, [1])
    sender.start(3, peer, [1], [1], b"")
    assert wait_while_pending(sender, 3) is FAILED and sender.reason(3) == "injected failure"
    sender.release(3)
    assert sender.reason(3) == ""
    sender.close(), receiver.close()


def test_zmq_sender_abort_reaches_the_receiver_at_once():
    """Not after the 30 s silence deadline: the receiver hears X and fails the room (or it had already landed)."""
    sender, receiver, _, _ = pair(ZmqTransfer, chunk_bytes=1)  # one page a message
    peer = sender.connect(receiver.endpoint())
    for room in range(10):
        receiver.expect(room, list(range(16)))
        sender.start(room, peer, list(range(16)), list(range(16)), b"")
        sender.abort(room)
        assert sender.poll(room) is FAILED
        assert wait_while_pending(receiver, room, limit_s=3.0) in (FAILED, DONE)
    sender.close(), receiver.close()
