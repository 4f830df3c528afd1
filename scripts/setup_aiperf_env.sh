#!/usr/bin/env bash
# Create aiperf's own environment in $VENV (default <repo>/.venv-aiperf, gitignored via `.venv-*/`):
# aiperf's pins (huggingface-hub<2, pandas~=2.3, pillow~=12.3, psutil~=7.0, pyzmq~=26.4, rich~=14.1)
# conflict with the project's, so it never joins .venv. ~1.2 GB, no torch; about 3 minutes here.
# The version is read from gemma4lab/serving/aiperf.py (AIPERF_VERSION), never copied.
#
#   scripts/setup_aiperf_env.sh      # then: pytest tests/test_aiperf.py (it finds .venv-aiperf/bin/aiperf)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv-aiperf}"
PYTHON="${PYTHON:-python3.11}"
VERSION="$(sed -n 's/^AIPERF_VERSION = "\(.*\)"$/\1/p' "$REPO/gemma4lab/serving/aiperf.py")"
[ -n "$VERSION" ] || { echo "error: no AIPERF_VERSION in gemma4lab/serving/aiperf.py" >&2; exit 1; }
if [ -x "$VENV/bin/aiperf" ] && [ "$("$VENV/bin/aiperf" --version 2>/dev/null | tail -1)" = "$VERSION" ]; then
  echo "aiperf $VERSION already in $VENV"; exit 0
fi
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet "aiperf==$VERSION"
echo "aiperf $("$VENV/bin/aiperf" --version | tail -1) in $VENV"
