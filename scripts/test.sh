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
# The layer contracts and the type check run beside pytest: its workers leave a core partly idle
# (ranks waiting on each other, fresh interpreters starting); their output follows pytest's.
lints="$(mktemp -d)"
trap 'rm -rf "$lints"' EXIT
lint-imports > "$lints/imports" 2>&1 & imports=$!
mypy > "$lints/types" 2>&1 & types=$!
status=0
python -m pytest -q -n 2 --dist loadfile "${select[@]}" "$@" || status=$?
wait "$imports" || { cat "$lints/imports"; status=1; }
tail -n 1 "$lints/imports"
wait "$types" || { cat "$lints/types"; status=1; }
tail -n 1 "$lints/types"
exit "$status"
