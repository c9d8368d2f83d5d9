#!/usr/bin/env bash
# The GPU machine has no network and no gguf, pyyaml or tqdm (and maybe no regex) for its Python 3.12: fetch
# their wheels here into .carry/wheels (ignored by git), then pass carry: [".carry"] to the device tool.
# device_setup.sh installs them. `fetch_wheels.sh serve` adds the server's and the openai client's wheels (for
# benchmarks/serve_load.py and the server tests, where the GPU machine lacks them).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .carry/wheels
pip download -q --no-deps -d .carry/wheels gguf==0.19.0
pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .carry/wheels pyyaml tqdm regex
if [ "${1:-}" = serve ]; then
  pip download -q --only-binary=:all: --python-version 3.12 \
      --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .carry/wheels fastapi uvicorn openai httpx
fi
ls .carry/wheels
