"""The front end's per-step messages: a RequestUpdate survives the pipe, queued Outputs of a request join into one."""

from __future__ import annotations

import pickle

import attrs

from moeplex.messages import RequestUpdate
from moeplex.request import FinishReason
from moeplex.server.group import _joined
from moeplex.server.outputs import Output


def test_request_update_pickles_every_field():
    values = {"rid": "r-1", "new_ids": (5, 6), "new_logprobs": ({"token_id": 5, "logprob": -0.5},), "text_from": 3,
              "text": "ab", "finish_reason": FinishReason.STOP, "stop_reason": "b", "error": "boom", "cached_tokens": 16,
              "spec_counts": (1, 2, 3)}
    assert [f.name for f in attrs.fields(RequestUpdate)] == list(values)  # a new field must be pickled too
    update = RequestUpdate(**values)
    assert attrs.asdict(pickle.loads(pickle.dumps(update)), recurse=False) == values


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
