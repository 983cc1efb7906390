"""The decode graphs a speculating engine captures for verify steps that admit prompts beside a full grid
(speculation/build.graph_rows, cuda_graph.graph_sizes): what they hold, and where the engine captures none."""

import attrs

from moeplex.config import EngineConfig, ParallelConfig
from moeplex.cuda_graph import capture_sizes, graph_sizes
from moeplex.interfaces import Drafter, DrafterCaps
from moeplex.registry import lookup
from moeplex.speculation.build import graph_rows

CONFIG = EngineConfig(model="unused", speculative_algorithm="ngram", speculative_num_steps=3, max_running_requests=32,
                      cuda_graph_max_bs=256)


class HostDrafter(Drafter):  # drafts on the host: its verify steps read the step before, outside the overlap schedule
    caps = DrafterCaps()


class ObservingDrafter(Drafter):  # drafts on the device but learns from each step's tokens without hidden rows
    caps = DrafterCaps(drafts_on_device=True)

    def observe(self, step) -> None:
        pass


def test_capture_sizes_step_by_thirty_two_beyond_the_maximum():
    assert capture_sizes(16, 80) == [1, 2, 4, 8, 16, 48, 80]
    assert capture_sizes(16, 112) == [1, 2, 4, 8, 16, 48, 80, 112]
    assert capture_sizes(16, 20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(16, 16) == capture_sizes(16, 0) == capture_sizes(16) == capture_sizes(16, 9)


def test_a_verify_grid_of_the_most_requests_leaves_the_largest_graph_for_prompts_beside_it():
    for name in ("ngram", "nextn"):
        assert graph_rows(CONFIG, lookup("drafter", name), overlap_schedule=True) == 32 * 4 + 256
    ngram = lookup("drafter", "ngram")
    assert graph_rows(attrs.evolve(CONFIG, max_running_requests=64), ngram, True) == 64 * 4 + 256  # the defaults
    assert graph_rows(attrs.evolve(CONFIG, max_running_requests=64, speculative_num_steps=5, cuda_graph_max_bs=512),
                      ngram, True) == 64 * 6 + 512


def test_no_rows_beyond_the_largest_graph_where_verify_steps_admit_no_prompt():
    ngram = lookup("drafter", "ngram")
    assert graph_rows(CONFIG, None, True) == 0  # not speculating
    assert graph_rows(CONFIG, ngram, overlap_schedule=False) == 0
    assert graph_rows(CONFIG, HostDrafter, True) == graph_rows(CONFIG, ObservingDrafter, True) == 0
    for change in (dict(disable_prompt_graphs=True), dict(mixed_chunk=False),
                   dict(parallel=ParallelConfig(tp_size=2, ep_size=2, dp_size=2, enable_dp_attention=True))):
        assert graph_rows(attrs.evolve(CONFIG, **change), ngram, True) == 0, change
    assert graph_rows(attrs.evolve(CONFIG, mixed_chunk=True), ngram, True) == 32 * 4 + 256


def test_the_sizes_beyond_are_captured_unless_a_step_of_them_would_be_split():
    none, tbo = lookup("overlap", "none")(), lookup("overlap", "tbo")()
    assert graph_sizes(CONFIG, none, admit_rows=384) == capture_sizes(256) + [288, 320, 352, 384]
    assert graph_sizes(CONFIG, none) == capture_sizes(256)
    assert graph_sizes(CONFIG, tbo, admit_rows=384) == capture_sizes(256)  # split: no prompt is admitted anyway
    assert graph_sizes(CONFIG, lookup("overlap", "tbo")(min_tokens=300), admit_rows=384) == capture_sizes(256)
    assert graph_sizes(CONFIG, lookup("overlap", "tbo")(min_tokens=400), admit_rows=384)[-1] == 384
    assert graph_sizes(CONFIG, none, buffers=128, admit_rows=384) == capture_sizes(128)  # the dispatch buffers bound both
    plain_rows = attrs.evolve(CONFIG, disable_prompt_graphs=True)  # verify grids only: --max-running-requests x width
    assert graph_sizes(plain_rows, none)[-1] == 32 * 4
