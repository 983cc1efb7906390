"""Start-up refuses unknown or incompatible plugin selections with one sentence naming what is available."""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
from pathlib import Path

import attrs
import pytest

from moeplex import cli, registry
from moeplex.ranks import offline
from moeplex.config import EngineConfig
from moeplex.interfaces import BalancerCaps, DispatcherCaps, DrafterCaps, KernelCaps, KVTransferCaps, OverlapCaps
from moeplex.parallel import ParallelConfig
from moeplex.registry import PluginError
from moeplex.selection import resolve

import fake_plugins


@pytest.fixture
def fake_distribution(tmp_path, monkeypatch):
    fake_plugins.write_distribution(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.dirname(__file__))
    importlib.invalidate_caches()
    yield
    sys.modules.pop("fake_plugins", None)


def config(**kwargs) -> EngineConfig:
    return EngineConfig(model="unused", **kwargs)


def one_sentence(message: str) -> bool:
    return message.endswith(".") and message.count(". ") == 0


def test_builtins_are_discovered_through_entry_points():
    assert {"local"} <= set(registry.discover("dispatcher"))
    assert {"torch"} <= set(registry.discover("moe_kernel"))
    assert {"static"} <= set(registry.discover("balancer"))
    assert {"none"} <= set(registry.discover("overlap"))
    info = registry.discover("dispatcher")["local"]
    assert info.distribution == "moeplex" and info.version


def test_the_default_selection_resolves():
    sel = resolve(config(), has_gpu=False)
    assert sel.dispatcher.__name__ == "LocalDispatcher"


@pytest.mark.parametrize("kind,flag", [("dispatcher", "dispatcher"), ("moe_kernel", "moe_kernel"), ("balancer", "balancer"), ("overlap", "overlap")])
def test_unknown_names_are_refused_naming_the_installed_ones(kind, flag):
    with pytest.raises(PluginError) as err:
        resolve(config(**{flag: "no-such-plugin"}), has_gpu=False)
    message = str(err.value)
    assert "no-such-plugin" in message and one_sentence(message)
    for name in registry.discover(kind):
        assert name in message


def test_incompatible_layout_is_refused(fake_distribution):
    with pytest.raises(PluginError) as err:
        resolve(config(dispatcher="fake-masked", moe_kernel="fake-fp32-standard"), ep_size=2, has_gpu=False)
    message = str(err.value)
    assert "masked layout" in message and "torch" in message and one_sentence(message)


def test_layout_bridged_by_an_adapter_is_accepted(fake_distribution):
    sel = resolve(config(dispatcher="fake-masked"), ep_size=2, has_gpu=False)
    assert sel.moe_kernel.__name__ == "TorchMoEKernel"


def test_gpu_plugins_are_refused_without_a_gpu(fake_distribution):
    with pytest.raises(PluginError, match="needs a CUDA GPU and none is visible; dispatchers that run here: .*local"):
        resolve(config(dispatcher="fake-gpu"), ep_size=2, has_gpu=False)
    assert resolve(config(dispatcher="fake-gpu"), ep_size=2, has_gpu=True)


def test_rank_counts_are_checked(fake_distribution):
    with pytest.raises(PluginError, match="serves one EP rank only, but --ep-size is 4"):
        resolve(config(dispatcher="local"), ep_size=4, has_gpu=False)
    with pytest.raises(PluginError, match="needs more than one EP rank; dispatchers for one rank: .*local"):
        resolve(config(dispatcher="fake-many-ranks"), ep_size=1, has_gpu=False)


def test_dtype_the_kernel_cannot_compute_is_refused(fake_distribution):
    with pytest.raises(PluginError, match="does not compute in bf16; kernels that do: .*torch"):
        resolve(config(moe_kernel="fake-fp32-standard", dtype="bf16"), has_gpu=False)


def test_broken_plugins_name_their_distribution(fake_distribution):
    with pytest.raises(PluginError, match="not a subclass of MoEKernel"):
        resolve(config(moe_kernel="fake-broken"), has_gpu=False)
    with pytest.raises(PluginError, match="fake-moeplex-plugins 0.1 failed to import"):
        resolve(config(moe_kernel="fake-missing"), has_gpu=False)


def test_a_one_rank_dispatcher_is_refused_from_the_configs_ep_size():
    """The check reads --ep-size from the config, so the launcher refuses before any rank starts."""
    two_ranks = ParallelConfig(tp_size=2, ep_size=2)
    with pytest.raises(PluginError) as err:
        resolve(config(dispatcher="local", parallel=two_ranks), has_gpu=False)
    message = str(err.value)
    assert "--ep-size is 2" in message and "can span ranks here: naive." in message and one_sentence(message)


def test_the_command_line_refuses_before_any_rank_starts(monkeypatch, capsys):
    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were started")

    monkeypatch.setattr(offline, "launch", no_ranks)
    code = cli.main(["generate", "--tp-size", "2", "--ep-size", "2", "--dispatcher", "local", "--input-ids", "1,2"])
    assert code == 2
    assert "serves one EP rank only, but --ep-size is 2" in capsys.readouterr().err


def test_start_up_logs_the_selected_plugins_with_their_distributions(caplog):
    with caplog.at_level(logging.INFO, logger="moeplex.selection"):
        resolve(config(), has_gpu=False, announce=True)
    lines = [r.getMessage() for r in caplog.records if r.name == "moeplex.selection"]
    v = importlib.metadata.version("moeplex")
    assert lines == [
        f"plugins: dispatcher local (moeplex {v}), moe_kernel torch (moeplex {v}), "
        f"balancer static (moeplex {v}), overlap none (moeplex {v}), grammar_backend xgrammar (moeplex {v})"
    ]


def test_start_up_line_names_the_drafter_and_the_transfer_backend(caplog):
    v = importlib.metadata.version("moeplex")
    with caplog.at_level(logging.INFO, logger="moeplex.selection"):
        resolve(config(speculative_algorithm="ngram", disaggregation_mode="prefill",
                       disaggregation_transfer_backend="loopback"), has_gpu=False, announce=True)
    line = [r.getMessage() for r in caplog.records if r.name == "moeplex.selection"][0]
    assert line.endswith(f"overlap none (moeplex {v}), grammar_backend xgrammar (moeplex {v}), drafter ngram (moeplex {v}), "
                         f"kv_transfer loopback (moeplex {v})")


def test_fp8_rows_need_a_kernel_that_takes_them(fake_distribution):
    with pytest.raises(PluginError) as err:
        resolve(config(dispatcher="fake-fp8", moe_kernel="fake-fp32-standard", dispatch_fp8=True), has_gpu=False)
    message = str(err.value)
    assert "does not take" in message and "torch" in message and one_sentence(message)
    assert resolve(config(dispatcher="fake-fp8", dispatch_fp8=True), has_gpu=False)


@pytest.mark.parametrize("caps_class", [DispatcherCaps, KernelCaps, BalancerCaps, OverlapCaps, KVTransferCaps, DrafterCaps])
def test_every_capability_is_documented(caps_class):
    docs = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    missing = [field for field in attrs.fields_dict(caps_class) if f"`{field}`" not in docs]
    assert not missing, f"docs/plugins.md does not say what {caps_class.__name__} {missing} mean"


def test_dispatchers_declare_no_capability_nothing_reads():
    """combine does exactly what ExpertOutput says is left, whoever the dispatcher is: no cap for it. The old
    `combine_applies_weights` is only a deprecated keyword (tests/test_api_compat.py), set by no built-in."""
    from moeplex.interfaces import deprecation

    assert deprecation.is_deprecated_field(DispatcherCaps, "combine_applies_weights")
    for name in registry.discover("dispatcher"):
        assert deprecation.in_use(registry.lookup("dispatcher", name).caps) == [], name
