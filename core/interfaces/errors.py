"""The one error a plugin raises to refuse a world it cannot serve."""


class PluginError(ValueError):
    """A selection that cannot start; the message is one sentence naming what is available."""
