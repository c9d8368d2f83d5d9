#!/usr/bin/env bash
# GPU machine: GPU tests, then the 30B synthetic model under three placements with --profile.
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
python3 -m pytest -q -x -m gpu tests/ -p no:cacheprovider 2>&1 | tail -15
python3 -m pytest -q tests/ -p no:cacheprovider -x 2>&1 | tail -3
( time hm synth qwen3-30b-a3b ) 2>&1 | tail -4
P="The quick brown fox jumps over the lazy dog. $(printf 'word %.0s' {1..100})"
for PL in "-ngl 99" "-ngl 99 -ot exps=CPU"; do
  echo "=== $PL"
  hm run -m synth:qwen3-30b-a3b -p "$P" -n 24 --temp 0 $PL --profile 2>&1 | grep -v "^The quick" | tail -30
done
