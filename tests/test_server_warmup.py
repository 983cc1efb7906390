"""The server's warm-up: one prefill step of each size class up to a full step, then nothing left behind."""

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.ranks.group import EngineGroup
from moeplex.hooks import hookimpl
from moeplex.sampling import SamplingParams
from moeplex.ranks.warmup import step_sizes, warm_up


def test_step_sizes_double_up_to_the_budget():
    assert step_sizes(100) == [16, 32, 64, 100]
    assert step_sizes(64) == [16, 32, 64]
    assert step_sizes(8) == [8]


class StepTokens:
    def __init__(self):
        self.extend: list[int] = []

    @hookimpl
    def moeplex_batch_scheduled(self, batch):
        if batch.mode.is_extend:
            self.extend.append(batch.num_tokens)


def test_warm_up_runs_a_step_of_each_size_and_leaves_the_engine_as_it_was(tiny_model_dir):
    config = EngineConfig(model=tiny_model_dir("deepseek_v3"), show_progress=False, max_total_tokens=512,
                          max_batched_tokens=96, chunked_prefill_size=40, max_running_requests=8, mixed_chunk=False)
    engine = Engine(config)
    steps = StepTokens()
    engine.hooks.register(steps)
    group = EngineGroup(engine)
    assert warm_up(group) > len(step_sizes(96))  # the prefills and the decodes after them
    assert set(step_sizes(96)) <= set(steps.extend)  # a prefill step of every size class
    assert not engine.has_work and not group.needs_round
    assert engine.kv.num_free_pages == engine.kv.num_pages  # every warm-up request gave its pages back, none cached
    assert engine.prefix_cache.queried_tokens == 0  # the warm-up's lookups are not the clients' hit rate
    assert group.admitted == [0]
    done = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2, temperature=0.0))
    assert len(done[0].output_ids) == 2
