"""Lifecycle and observation hooks reach a pluggy implementation."""

from __future__ import annotations

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.forward_batch import ForwardMode
from moeplex.hooks import hookimpl, make_plugin_manager
from moeplex.sampling import SamplingParams


class Recorder:
    def __init__(self):
        self.events = []
        self.expert_tokens = 0

    @hookimpl
    def moeplex_engine_started(self, engine):
        self.events.append("started")

    @hookimpl
    def moeplex_batch_scheduled(self, batch):
        self.events.append(batch.mode)

    @hookimpl
    def moeplex_forward_done(self, batch, logits):
        assert logits.shape[0] == batch.batch_size

    @hookimpl
    def moeplex_expert_load_recorded(self, layer_id, counts):
        self.expert_tokens += int(counts.sum())

    @hookimpl
    def moeplex_request_finished(self, request):
        self.events.append(("finished", request.rid, request.finish_reason.value))


def test_hooks_observe_the_engine(tiny_model_dir):
    recorder = Recorder()
    pm = make_plugin_manager(load_entry_points=False)
    pm.register(recorder)
    engine = Engine(EngineConfig(model=tiny_model_dir("deepseek_v3"), show_progress=False, max_total_tokens=512), hooks=pm)
    engine.generate([[256, 1, 2, 3]], SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True))
    assert recorder.events[0] == "started"
    assert recorder.events[1] == ForwardMode.EXTEND and ForwardMode.DECODE in recorder.events
    assert recorder.events[-1] == ("finished", "0", "length")
    moe_layers = len(engine.model.moe_layers())
    top_k = engine.model.moe_layers()[0].gate.spec.top_k
    # 4 prompt tokens + 2 decoded inputs, each routed to top_k experts in every MoE layer
    assert recorder.expert_tokens == (4 + 2) * top_k * moe_layers
