#!/usr/bin/env bash
# The whole test suite and the lints, from a fresh clone: ruff, the layer contracts, the type check, pytest
# on two workers (pytest-xdist, a test file to a worker: its module fixtures are built once).
# --quick: the edit loop: the same lints, then every test not marked `slow` (spawned ranks, torchrun,
# memory-flatness loops, the Hugging Face matrices); the full command still runs everything.
# Further arguments go to pytest (a later `-n 4` overrides the worker count).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
cd "$here/.."
select=()
if [ "${1:-}" = "--quick" ]; then
  select=(-m "not slow")
  shift
fi
ruff check .
lint-imports
mypy
python -m pytest -q -n 2 --dist loadfile "${select[@]}" "$@"
