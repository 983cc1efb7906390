#!/usr/bin/env bash
# Run the whole test suite (sets the project up first; a no-op when it already is).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=20 "$@"
