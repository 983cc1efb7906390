"""Structured outputs over tensor-parallel gloo ranks: only the DP group's leader compiles constraints and fills
masks, the other rank receives them, and the outputs are those of one process (valid under their schemas)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from moeplex.config import EngineConfig
from moeplex.engine import Engine
from moeplex.interfaces import JSON_SCHEMA, REGEX, Constraint
from moeplex.parallel import ParallelConfig
from moeplex.ranks.launcher import launch
from moeplex.request import FinishReason
from moeplex.sampling import SamplingParams

import grammar_ranks
from grammar_schemas import SCHEMAS
from ports import free_address

SCHEMA_COUNT = 6


def workload(engine: Engine):
    """Constrained rows (greedy and seeded), a free row between them, and one whose regex does not compile."""
    constraints = [Constraint(JSON_SCHEMA, json.dumps(s)) for s in SCHEMAS[:SCHEMA_COUNT]]
    params = [SamplingParams(max_new_tokens=48, constraint=c, **(dict(temperature=1.0, seed=i) if i % 2 else
                                                                 dict(temperature=0.0)))
              for i, c in enumerate(constraints)]
    params.append(SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    params.append(SamplingParams(max_new_tokens=12, temperature=0.0, constraint=Constraint(REGEX, "(unclosed")))
    prompts = [engine.encode(f"Answer {i} in JSON:") for i in range(len(params))]
    return prompts, params


LAYOUTS = {  # (parallel config, the overlap settings run, engine settings, the arch)
    "tp2": (dict(tp_size=2), [False, True], {}, "qwen3_moe"),
    # two DP groups of two ranks: each group's first rank (0 and 2) leads it, over its own sub-group
    "tp4-dp2-attention": (dict(tp_size=4, ep_size=4, dp_size=2, enable_dp_attention=True), [False],
                          dict(dispatcher="naive"), "deepseek_v3"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tp_ranks_share_the_leaders_masks(tiny_model_dir, layout):
    sizes, overlaps, settings, arch = LAYOUTS[layout]
    folder = tiny_model_dir(arch)
    alone = Engine(EngineConfig(model=folder, show_progress=False, dtype="fp32", max_total_tokens=4096, page_size=4))
    prompts, params = workload(alone)
    reference = [(r.output_ids, r.finish_reason, r.text, r.error) for r in alone.generate(prompts, params)]
    parallel = ParallelConfig(dist_init_addr=free_address(), timeout_s=120, **sizes)
    runs = launch(grammar_ranks.constrained_on_every_rank, parallel, parallel, folder, prompts, params, overlaps, settings)
    for outputs, books in runs:
        assert [o[:2] for o in outputs] == [r[:2] for r in reference]
        for (ids, reason, text, error), schema in zip(outputs, SCHEMAS[:SCHEMA_COUNT]):
            assert error is None, error
            if reason == FinishReason.STOP:
                jsonschema.validate(json.loads(text), schema)
        assert outputs[-1][1] == FinishReason.ABORT and "does not compile" in outputs[-1][3]
        group = parallel.attn_tp_size
        for rank, (compiles, filled, _) in enumerate(books):
            if rank % group == 0:
                assert compiles == SCHEMA_COUNT + 1 and filled > 0, "a leader compiles each constraint and fills masks"
            else:
                assert (compiles, filled) == (0, 0), f"rank {rank} compiled or filled masks itself"
    assert sum(o[1] == FinishReason.STOP for o in runs[0][0]) >= SCHEMA_COUNT - 1
