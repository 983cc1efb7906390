"""The README's commands run as written after `bash scripts/setup.sh`: each Python tool comes from its .venv."""

from __future__ import annotations

import os
import re

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
BARE = re.compile(r"^(?:python3?|pytest) ")  # the system's, not the set-up's environment (pip lines install elsewhere)


def commands(text: str) -> list[str]:
    """Each line of a fenced bash block and each inline `code` span that reads as a command."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        found += [line.strip() for line in block.splitlines() if line.strip()]
    found += re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return found


def test_readme_commands_use_the_set_up_environment():
    with open(README) as f:
        bare = [c for c in commands(f.read()) if BARE.match(c)]
    assert not bare, f"README commands outside .venv: {bare}"
