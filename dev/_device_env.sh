# Sourced by the device scripts: run from the repository root, with OUT (default: $1) created and src importable.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$1}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
