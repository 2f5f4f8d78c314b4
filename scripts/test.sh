#!/usr/bin/env bash
# The whole test suite (and the lint), from a fresh clone.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
cd "$here/.."
ruff check .
python -m pytest -q "$@"
