#!/usr/bin/env bash
# On the GPU machine (carry .carry: the wheels and .carry/builtin from make_corpus.py):
#     bash benchmarks/builtin/run_gpu.sh MINUTES [train.py options]
# trains the built-in model for MINUTES (training, evaluation and export together; the script keeps its own
# clock) and writes into $OUT (else out/builtin): builtin.gguf (the file to ship), builtin-f16-0000{1,2}-of-00002.gguf
# (an F16 copy for quality comparisons), train_log.txt, train_meta.json, samples.txt and check.txt (the exported
# file run through hybridmoe, on the CPU and on the GPU). Total wall time: about MINUTES + 2 minutes (setup,
# the training script's own MINUTES, then the checks, CHECK_SECS=100 at most).
set -uo pipefail
MIN=${1:-6}
shift || true
export OUT=${OUT:-$PWD/out/builtin}
mkdir -p "$OUT"
if [ ! -f .carry/builtin/train.bin ]; then
  echo "no .carry/builtin/train.bin: run python benchmarks/builtin/make_corpus.py first and carry .carry" >&2
  exit 2
fi
# BUILTIN_NO_SETUP=1: skip the GPU machine's setup (a dry run here: ... run_gpu.sh 1 --preset tiny)
[ -n "${BUILTIN_NO_SETUP:-}" ] || source benchmarks/device_setup.sh
set +e
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
SECS=$(python3 -c "print(int(float('$MIN') * 60))")
# the script stops itself at its budget; timeout is the backstop (SIGTERM: it exports and exits; then SIGKILL)
timeout -k 20 $((SECS + 30)) python3 -u benchmarks/builtin/train.py --minutes "$MIN" --out "$OUT" "$@" 2>&1 \
  | tee "$OUT/train_log.txt"
M="$OUT/builtin.gguf"
# the checks share CHECK_SECS (default 100): each step gets what is left
END=$((SECONDS + ${CHECK_SECS:-100}))
left() { local l=$((END - SECONDS)); [ $l -gt 5 ] && echo $l || echo 5; }
{
  ls -la "$OUT"
  echo "=== run -ngl 0 (the CPU, as the README's first command; builds the C kernels first)"
  timeout $(left) python3 -m hybridmoe run -m "$M" -ngl 0 -p "The" -n 48 -s 1 --no-warmup
  echo "=== run -ngl 99 --chat (GPU)"
  timeout $(left) python3 -m hybridmoe run -m "$M" -ngl 99 --chat -p "What does the json module do?" -n 64 -s 3 --no-warmup
  if python3 -m hybridmoe perplexity --help >/dev/null 2>&1; then
    echo "=== perplexity -ngl 99 (held-out text, 10 chunks of 512)"
    timeout $(left) python3 -m hybridmoe perplexity -m "$M" -ngl 99 -f .carry/builtin/heldout.txt -c 512 --chunks 10 2>&1 | tail -6
  fi
} 2>&1 | tee "$OUT/check.txt"
exit 0
