#!/usr/bin/env bash
# The whole test suite and the lints, from a fresh clone: ruff, the layer contracts, the type check, pytest.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
cd "$here/.."
ruff check .
lint-imports
mypy
python -m pytest -q "$@"
