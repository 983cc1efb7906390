"""--load-format dummy: the weights `moeplex make-model` writes with the same seed, on any parallel layout."""

from __future__ import annotations

import torch

from moeplex.config import EngineConfig
from moeplex.models.make_model import write_checkpoint
from moeplex.models.setup import load_model
from moeplex.selection import resolve


def load(folder: str, **settings):
    config = EngineConfig(model=folder, show_progress=False, **settings)
    return load_model(folder, config, resolve(config))


def test_dummy_weights_equal_the_checkpoint_make_model_writes(tmp_path):
    for arch in ("deepseek_v3", "qwen3_moe", "mixtral"):
        folder = write_checkpoint(str(tmp_path / arch), arch, seed=3)
        written, dummy = load(folder), load(folder, load_format="dummy", seed=3)
        for (name, a), (_, b) in zip(written.state_dict().items(), dummy.state_dict().items()):
            assert torch.equal(a, b), f"{arch}: {name} differs"
        other_seed = load(folder, load_format="dummy", seed=4)
        assert not torch.equal(other_seed.lm_head.weight, dummy.lm_head.weight)


def test_dummy_weights_fill_every_replica_of_an_expert(tmp_path):
    folder = write_checkpoint(str(tmp_path / "m"), "qwen3_moe", seed=5)
    model = load(folder, load_format="dummy", seed=5, ep_num_redundant_experts=4)
    layer = model.moe_layers()[0]
    placement = model.moe_runtime.placement
    phy2log = placement.phy2log[0].tolist()
    for slot, expert in enumerate(phy2log):
        first = phy2log.index(expert)
        assert torch.equal(layer.w13[slot], layer.w13[first]) and torch.equal(layer.w2[slot], layer.w2[first])
    assert len(set(phy2log)) < len(phy2log)  # some expert has a replica
