"""Example moeplex plugins, found by moeplex through the entry points in pyproject.toml."""
