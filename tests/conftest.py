"""Shared fixtures: tiny random checkpoints of every architecture, written once per test session."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

# The same examples on every run, so a CI run cannot fail by the luck of the draw; look further with
# HYPOTHESIS_PROFILE=explore (or pytest --hypothesis-profile=explore).
settings.register_profile("repeatable", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

if not torch.cuda.is_available():
    # Triton kernels run under its interpreter on CPU; the switch must be set before they are decorated
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moeplex.kernels import cpu_ext
from moeplex.models.make_model import ARCHES, write_checkpoint


def pytest_configure(config):
    """moeplex's C++ CPU kernels, built side by side before collection (test modules load them as they are
    collected, which on a fresh machine cache built them one after the other)."""
    cpu_ext.build_all()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """arch -> folder of a tiny random checkpoint written by `moeplex make-model`'s code."""
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            made[arch] = write_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, "tiny", seed=0)
        return made[arch]

    return get


@pytest.fixture(params=ARCHES)
def arch(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU; none is visible on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
