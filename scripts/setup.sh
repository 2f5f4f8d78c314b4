#!/usr/bin/env bash
# Create .venv (once) with the pinned CPU torch and stagewise installed in editable mode.
# Sourced by scripts/demo.sh and scripts/test.sh, so each command sets itself up on a fresh machine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.stagewise-setup-v4"
if [ ! -f "$stamp" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # Pin torch first: an unpinned torch pulls a multi-GB CUDA build.
  "$venv/bin/python" -m pip install -q "torch==2.13.0"
  "$venv/bin/python" -m pip install -q -e "$root[test]"
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
