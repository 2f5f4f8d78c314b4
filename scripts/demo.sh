#!/usr/bin/env bash
# The main job: compile a Hugging Face GPT-2 onto 4 CPU devices, train, compare with eager.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/setup.sh"
exec python "$here/../examples/demo.py" "$@"
