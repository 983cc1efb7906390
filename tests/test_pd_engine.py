"""Disaggregation inside one process, one rank each: a prefill engine's KV pages and first token reach a decode
engine, which then answers exactly as a co-located engine does, and both pools end where they started.

The transfer here is a copy between the two engines' pools made by a small in-test backend (`Copier`): these
tests are about the engines' side of the contract (what is held, reserved, sent, admitted and freed), the
backends have their own conformance suite. The leader's decisions (EndTransfer) are made by the test.
"""

from __future__ import annotations

import pytest
import torch

from moeplex.config import EngineConfig
from moeplex.disagg import rank as rank_module
from moeplex.engine import Engine
from moeplex.interfaces import KVTransfer, KVTransferCaps, TransferStatus
from moeplex.messages import EndTransfer, SendKV
from moeplex.sampling import SamplingParams

PAGE = 4


class Copier(KVTransfer):
    """Copies at start() between instances of this process (endpoint: an index into `instances`)."""

    caps = KVTransferCaps()
    instances: list["Copier"] = []

    def __init__(self):
        self.index = len(Copier.instances)
        Copier.instances.append(self)
        self.expected: dict[int, list[int]] = {}
        self.rows: dict[int, bytes] = {}
        self.status: dict[int, TransferStatus] = {}

    def register(self, regions, metadata_bytes):
        self.regions = regions

    def endpoint(self) -> bytes:
        return str(self.index).encode()

    def connect(self, peer: bytes) -> str:
        return peer.decode()

    def expect(self, room, dst_pages):
        self.expected[room] = list(dst_pages)
        self.status[room] = TransferStatus.PENDING

    def start(self, room, peer, src_pages, dst_pages, metadata):
        target = Copier.instances[int(peer)]
        if target.expected.get(room) is None:  # not expected (or aborted): dropped
            self.status[room] = TransferStatus.FAILED
            return
        for mine, theirs in zip(self.regions, target.regions):
            n = mine.page_bytes // mine.tensor[0].numel() // mine.tensor.element_size()  # tokens per page
            for s, d in zip(src_pages, dst_pages):
                theirs.tensor[d * n : (d + 1) * n] = mine.tensor[s * n : (s + 1) * n]
        target.rows[room] = metadata
        target.status[room] = self.status[room] = TransferStatus.DONE

    def poll(self, room):
        return self.status.get(room, TransferStatus.FAILED)

    def metadata(self, room):
        return self.rows[room]

    def abort(self, room):
        self.expected.pop(room, None)
        self.status[room] = TransferStatus.FAILED

    def reason(self, room):
        return "aborted"


@pytest.fixture
def engines(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(rank_module, "lookup", lambda kind, name: Copier)
    folder = tiny_model_dir("deepseek_v3")

    def make(mode: str, **extra) -> Engine:
        config = EngineConfig(model=folder, page_size=PAGE, max_total_tokens=256, chunked_prefill_size=8,
                              show_progress=False, disaggregation_mode=mode, **extra)
        return Engine(config)

    return make("prefill"), make("decode"), make("none")


def run_pd(p: Engine, d: Engine, prompt: list[int], params: SamplingParams, room: int):
    """One request through both engines, the test acting as both leaders; the decode request at its end."""
    rp = p.add_request(prompt, _one(params), room=room)
    rd = d.add_request(prompt, params, room=room)
    d.step()  # reserves the pages and expects the room
    (rid, pages), = d.pd.take_reserved()
    assert rid == rd.rid and len(pages) == d.kv.pages_for(len(prompt) + 1)
    p.pd.send_to(SendKV(rp.rid, pages, (d.pd.endpoint(),)))
    while rp.rid not in p.pd.held:
        p.step()
    assert p.pd.polls() == {rp.rid: "done"} and d.pd.polls() == {rd.rid: "done"}
    p.pd.end(EndTransfer(rp.rid, True))
    d.pd.end(EndTransfer(rd.rid, True))
    while d.has_work:
        d.step()
    return rp, rd


def _one(params: SamplingParams) -> SamplingParams:
    import attrs

    return attrs.evolve(params, max_new_tokens=1)


@pytest.mark.parametrize("length", [3, PAGE, 2 * PAGE, 21])  # within one page, one page, a page boundary, chunked
def test_decode_continues_exactly_as_colocated(engines, length):
    p, d, co = engines
    torch.manual_seed(0)
    prompt = torch.randint(1, 200, (length,)).tolist()
    params = SamplingParams(max_new_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)
    reference = co.generate([prompt], params)[0]
    free_p, free_d = p.kv.num_free_pages + (p.prefix_cache.num_pages if p.prefix_cache else 0), d.kv.num_free_pages
    rp, rd = run_pd(p, d, prompt, params, room=7)
    assert rd.output_ids == reference.output_ids
    assert rp.output_ids == reference.output_ids[:1]
    assert [e["token_id"] for e in rd.logprobs] == [e["token_id"] for e in reference.logprobs]
    assert [e["logprob"] for e in rd.logprobs] == pytest.approx([e["logprob"] for e in reference.logprobs], abs=1e-5)
    assert d.kv.num_free_pages == free_d
    assert p.kv.num_free_pages + p.prefix_cache.num_pages == free_p  # its prompt pages went to P's prefix cache


def test_first_token_that_stops_ends_on_the_decode_side(engines):
    p, d, co = engines
    prompt = [5, 6, 7, 8, 9]
    first = co.generate([prompt], SamplingParams(max_new_tokens=1, temperature=0.0))[0].output_ids[0]
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=(first,))
    rp, rd = run_pd(p, d, prompt, params, room=9)
    assert rd.output_ids == [first] and rd.finish_reason == "stop"
    assert d.kv.num_free_pages == d.kv.num_pages


def test_source_pages_stay_held_until_the_leader_ends_the_transfer(engines):
    p, d, _ = engines
    rp = p.add_request([1, 2, 3, 4, 5, 6], _one(SamplingParams(temperature=0.0)), room=3)
    while rp.rid not in p.pd.held:
        p.step()
    held = len(rp.pages)
    p.prefix_cache.evict(p.kv.num_pages)  # the tree's share of them is locked: eviction cannot take it
    assert p.kv.num_free_pages == p.kv.num_pages - held
    assert p.has_work  # the rounds go on while pages wait for their transfer
    p.abort(rp.rid)  # the decode side gave up: the leader's Abort frees them
    assert rp.rid not in p.pd.held and p.kv.num_free_pages + p.prefix_cache.num_pages == p.kv.num_pages
    assert not p.has_work


def test_decode_failure_closes_the_room_before_freeing(engines):
    p, d, _ = engines
    rd = d.add_request([1, 2, 3, 4, 5], SamplingParams(max_new_tokens=4, temperature=0.0), room=11)
    d.step()
    d.pd.take_reserved()
    backend = d.pd.backend
    assert backend.expected[11]
    d.pd.end(EndTransfer(rd.rid, False, "the KV transfer did not finish within 1 s"))
    assert 11 not in backend.expected  # aborted: a late write is dropped
    assert rd.error == "the KV transfer did not finish within 1 s" and rd.finish_reason == "abort"
    assert d.kv.num_free_pages == d.kv.num_pages and not d.has_work


def test_decode_waits_for_pages_then_reserves(engines):
    p, d, _ = engines
    big = list(range(1, 256))  # 255 tokens + 1: the whole pool of 64 pages of 4
    first = d.add_request(big, SamplingParams(max_new_tokens=1), room=1)
    second = d.add_request([1, 2, 3], SamplingParams(max_new_tokens=1), room=2)
    d.step()
    assert [rid for rid, _ in d.pd.take_reserved()] == [first.rid]
    assert list(d.pd.queued) == [second]
    d.abort(first.rid)
    d.step()
    assert [rid for rid, _ in d.pd.take_reserved()] == [second.rid]


def test_a_constrained_request_decodes_as_colocated(engines):
    """Structured outputs across the split: P masks the first token, D builds the matcher, feeds it that token and
    masks the rest; the output is the co-located one, and it follows the schema."""
    import json

    from moeplex.interfaces import Constraint

    p, d, co = engines
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    params = SamplingParams(max_new_tokens=32, temperature=0.0, constraint=Constraint("json_schema", json.dumps(schema)))
    prompt = list(range(5, 14))
    reference = co.generate([prompt], params)[0]
    rp, rd = run_pd(p, d, prompt, params, room=11)
    assert rd.output_ids == reference.output_ids and rp.output_ids == reference.output_ids[:1]
    value = json.loads(rd.text)
    assert value["ok"] in (True, False) and value["n"] in (1, 2, 3) and set(value) == {"ok", "n"}
