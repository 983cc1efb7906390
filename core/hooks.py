"""Lifecycle and observation hooks any installed package can implement (entry-point group `moeplex.hooks`)."""

from __future__ import annotations

import pluggy

PROJECT = "moeplex"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class HookSpecs:
    @hookspec
    def moeplex_engine_started(self, engine):
        """The engine has loaded its model and plugins and is ready to take requests."""

    @hookspec
    def moeplex_batch_scheduled(self, batch):
        """The scheduler chose the ForwardBatch of the next step."""

    @hookspec
    def moeplex_forward_done(self, batch, logits):
        """A forward step finished; `logits` holds one row per request of `batch`."""

    @hookspec
    def moeplex_expert_load_recorded(self, layer_id, counts):
        """Tokens routed to each logical expert of one MoE layer in one step ([E] tensor)."""

    @hookspec
    def moeplex_placement_changed(self, placement):
        """The balancer's new Placement has been applied to the experts."""

    @hookspec
    def moeplex_request_finished(self, request):
        """A request finished (stopped, hit its length limit, or was aborted)."""


def make_plugin_manager(load_entry_points: bool = True) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(HookSpecs)
    if load_entry_points:
        pm.load_setuptools_entrypoints("moeplex.hooks")
    return pm
