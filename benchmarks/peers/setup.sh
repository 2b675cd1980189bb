#!/usr/bin/env bash
# Create one virtual environment per peer framework under benchmarks/.peers/ (git-ignored).
# The benchmark suite runs a peer only when its venv exists; a failed install skips that peer.
# Usage: bash benchmarks/peers/setup.sh [openai-agents] [pydantic-ai] [openrath]
set -u
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mkdir -p .peers && echo "*" > .peers/.gitignore  # never committed
peers=("$@")
[ ${#peers[@]} -eq 0 ] && peers=(openai-agents pydantic-ai openrath)
for peer in "${peers[@]}"; do
  case "$peer" in
    openai-agents) pkgs="openai-agents" ;;
    pydantic-ai) pkgs="pydantic-ai-slim[openai]" ;;
    openrath) pkgs="openrath" ;;
    *) echo "unknown peer $peer"; continue ;;
  esac
  echo "== $peer: $pkgs"
  if "$PY" -m venv ".peers/$peer" && ".peers/$peer/bin/python" -m pip install -q $pkgs; then
    echo "$peer ready"
  else
    echo "$peer: install failed; the suite will skip it"
    rm -rf ".peers/$peer"
  fi
done
