"""The front end's per-step messages: the round's Updates survive the pipe and rebuild each request, queued Outputs of a request join into one."""

from __future__ import annotations

import pickle

import attrs

from hypothesis import given, settings
from hypothesis import strategies as st

from moeplex.messages import Failure, GroupReport, GroupStats, LoopStats, RoundReport, Updates
from moeplex.ranks.worker import UpdateLog
from moeplex.request import FinishReason, Request
from moeplex.models.make_model import EOS, byte_level_tokenizer
from moeplex.sampling import SamplingParams
from moeplex.tokenizer import Detokenizer, whole_text
from moeplex.server.group import _joined
from moeplex.server.outputs import Output


def test_reports_pickle_every_field():
    values = {"rids": ("r-1", "r-2"), "ids": (5, 6, 7), "counts": (2, 1), "texts": ("ab", ""), "cuts": {1: 3},
              "logprobs": {0: ({"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -0.1})},
              "ends": {1: (FinishReason.STOP, "b", "boom")}, "cached": {0: 16}, "spec": {0: (1, 2, 3)},
              "prompt_logprobs": {0: (None, {"token_id": 7, "logprob": -1.0, "rank": 2, "top_logprobs": []})}}
    assert [f.name for f in attrs.fields(Updates)] == list(values)  # a new field must be pickled too
    assert attrs.asdict(pickle.loads(pickle.dumps(Updates(**values))), recurse=False) == values
    stats = LoopStats((GroupStats(*range(1, 10)), GroupStats(*range(11, 20))), (3, 4), 5, 6)
    report = RoundReport((Updates(**values),), (Failure("r-3", 400, "no"),), ((1, 2),), stats, (("r-4", 1, (7,)),), {"t": 1})
    assert pickle.loads(pickle.dumps(report)) == report  # every field of every message in it, set away from its default
    group = GroupReport(1, Updates(**values), True, GroupStats(*range(1, 10)), (("r-4", (7,)),))
    assert pickle.loads(pickle.dumps(group)) == group


class Mirror:
    def __init__(self, request: Request, detok: Detokenizer | None = None):
        self.request = request
        self.detok = detok


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from("grow cut logprob cache spec finish refuse".split()),
                                   st.integers(0, 3)), max_size=4), min_size=1, max_size=6))
def test_a_mirror_fed_the_updates_equals_the_request(rounds):
    """Whatever the requests do between rounds (tokens, text cut by a stop string, logprobs, cached tokens, spec
    counts, a finish, a refusal), one Updates per round makes the front end's mirrors equal to them. The requests have
    a stop string, so the engine grows their text and sends it."""
    requests = [Request(f"r{i}", [1, 2], SamplingParams(stop=("zz",))) for i in range(4)]
    log = UpdateLog(speculates=True)
    for request in requests:
        log.track(request)
    mirrors = {r.rid: Mirror(Request(r.rid, [1, 2], SamplingParams())) for r in requests}
    refused = {}
    for events in rounds:
        for kind, i in events:
            r = requests[i]
            if r.finished or r.rid in refused:
                continue
            if kind in ("grow", "cache", "spec"):  # cached tokens and spec counts change only with new tokens
                r.output_ids.extend(range(i + 1))
                r.text += "xy"[: i % 2 + 1]
            if kind == "cut":
                r.text = r.text[: len(r.text) // 2]
            elif kind == "logprob":
                r.logprobs.append({"token_id": i, "logprob": -1.0})
            elif kind == "cache":
                r.cached_tokens += 4
            elif kind == "spec":
                r.spec_verify_steps += 1
            elif kind == "finish":
                r.finish(FinishReason.STOP, stop_reason="y", error=None)
            elif kind == "refuse":
                refused[r.rid] = "no room"
                log.forget(r.rid)
                log.refused(r.rid, "no room")
        updates = pickle.loads(pickle.dumps(log.take()))
        assert len(set(updates.rids)) == len(updates.rids)
        updates.apply(mirrors)
    for r in requests:
        m = mirrors[r.rid].request
        if r.rid in refused:
            assert (m.finish_reason, m.error) == (FinishReason.ABORT, "no room")
            continue
        assert (m.output_ids, m.text, m.logprobs, m.cached_tokens, m.spec_counts, m.finish_reason, m.stop_reason) == (
            r.output_ids, r.text, r.logprobs, r.cached_tokens, r.spec_counts, r.finish_reason, r.stop_reason)
    assert len(log.take()) == 0  # nothing new: nothing sent


BYTES = byte_level_tokenizer()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.tuples(st.sampled_from([*range(0, 256, 9), 0xC3, 0xE2, 0x82, 0xAC, 0x80]), st.integers(0, 2)),
                         max_size=6), min_size=1, max_size=8),
       st.sampled_from([FinishReason.LENGTH, FinishReason.STOP, FinishReason.ABORT]))
def test_a_mirror_that_detokenizes_gets_the_engines_text(rounds, reason):
    """Without stop strings the engine sends ids only (its own text is made once, at the end) and the front end's
    detokenizer makes the text it streams: the same text, ending inside a character or not, flushed unless the
    request stopped, where a stop token ends it."""
    requests = [Request(f"r{i}", [1, 2], SamplingParams()) for i in range(3)]
    log = UpdateLog(speculates=False)
    for request in requests:
        log.track(request)
    mirrors = {r.rid: Mirror(Request(r.rid, [1, 2], SamplingParams()), Detokenizer(BYTES)) for r in requests}
    for events in rounds + [[(0, i) for i in range(3)]]:
        for token, i in events:
            requests[i].output_ids.append(token)
            requests[i].text = "never sent"  # the engine's text of a request without stop strings stays on the rank
        updates = pickle.loads(pickle.dumps(log.take()))
        assert not any(updates.texts)
        updates.apply(mirrors)
    for r in requests:
        if reason == FinishReason.STOP:
            r.output_ids.append(BYTES.token_to_id(EOS))
        r.finish(reason)
    pickle.loads(pickle.dumps(log.take())).apply(mirrors)
    for r in requests:
        stopped = reason == FinishReason.STOP
        assert mirrors[r.rid].request.text == whole_text(BYTES, r.output_ids, True, stopped)
        assert mirrors[r.rid].request.output_ids == r.output_ids


def out(index: int, text: str, ids: tuple[int, ...], **kw) -> Output:
    return Output(index, 7, text, ids, tuple({"token_id": i} for i in ids), **kw)


def test_queued_outputs_of_a_request_join_in_order():
    a1, b1, a2, a3 = out(0, "x", (1,)), out(1, "p", (9,)), out(0, "y", (2,)), out(0, "z", (3,), finish_reason="length")
    joined = _joined([a1, b1, a2, a3])
    assert joined == [out(0, "xyz", (1, 2, 3), finish_reason="length"), b1]


def test_nothing_joins_a_finished_output_or_a_failure():
    done, late = out(0, "x", (1,), finish_reason="stop"), out(0, "y", (2,))
    assert _joined([done, late]) == [done, late]
    tokens, failure = out(0, "x", (1,)), Output(0, 7, finish_reason="abort", error="gone", status=503)
    assert _joined([tokens, failure]) == [tokens, failure]  # the tokens before a failure are still sent



def test_a_front_end_behind_the_engine_sends_several_steps_in_one_event(tiny_model_dir):
    """The event loop stalls while the engine (on its own thread) keeps stepping: the reports that queued up reach the
    client as one event, with the same tokens and text as the whole completion."""
    import json
    import time

    import httpx
    from live_server import LiveServer

    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.server import ServerSettings, build_app

    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), dtype="fp32", show_progress=False, max_total_tokens=4096))
    app = build_app(engine, ServerSettings())
    body = {"prompt": [256, 72, 105], "max_tokens": 32, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with LiveServer(app) as server:
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: "):])["choices"][0])
                    if len(events) == 1:  # stall the server's event loop: the engine steps on meanwhile
                        app.state.engine_loop._events.call_soon_threadsafe(time.sleep, 0.5)
    assert [t for e in events for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert max(len(e["token_ids"]) for e in events) > 1, [len(e["token_ids"]) for e in events]


def test_stream_interval_sends_the_first_token_then_chunks_of_n(tiny_model_dir):
    """--stream-interval 4: the first token alone, then chunks of at least 4 tokens (the last may hold fewer), the
    same tokens and text as unchunked; a native request's sampling_params.stream_interval overrides the server's."""
    import json

    import httpx
    from live_server import LiveServer

    from moeplex.config import EngineConfig
    from moeplex.engine import Engine
    from moeplex.server import ServerSettings, build_app

    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), dtype="fp32", show_progress=False, max_total_tokens=4096))
    app = build_app(engine, ServerSettings(stream_interval=4))
    body = {"prompt": [256, 72, 105], "max_tokens": 23, "temperature": 0, "ignore_eos": True, "return_token_ids": True}

    def chunks(path: str, payload: dict, pick) -> list:
        got = []
        with httpx.stream("POST", f"{server.url}{path}", json=payload, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got.append(pick(json.loads(line[len("data: "):])))
        return got

    with LiveServer(app) as server:
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        events = chunks("/v1/completions", {**body, "stream": True}, lambda e: e["choices"][0])
        native = {"input_ids": [256, 72, 105], "stream": True,
                  "sampling_params": {"max_new_tokens": 23, "temperature": 0, "ignore_eos": True, "stream_interval": 10}}
        native_sizes = chunks("/generate", native, lambda e: e["meta_info"]["completion_tokens"])
    sizes = [len(e["token_ids"]) for e in events]
    assert [t for e in events for t in e["token_ids"]] == whole["token_ids"]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]) and sum(sizes) == 23, sizes
    assert len(sizes) <= 1 + -(-22 // 4) + 1, sizes  # not one event a token
    steps = [b - a for a, b in zip(native_sizes, native_sizes[1:])]
    assert native_sizes[0] == 1 and native_sizes[-1] == 23 and all(n >= 10 for n in steps[:-1]), native_sizes
