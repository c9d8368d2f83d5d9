#!/usr/bin/env bash
# Several GPUs (issue 29), on a multi-GPU machine kind: bash benchmarks/gpu_multi.sh [SECTION...]
#   tests   the GPU-marked placement tests (two-GPU ones included)
#   table   benchmarks/multi_gpu.py on synth:qwen3-30b-a3b: logits vs all-CPU, plan's warnings and prediction,
#           bench pp512/tg128 for the two-GPU placements, issue 521's split up/gate case and its unsplit twin
#   bench   only `hybridmoe bench` (pp512, tg128, -r 2) of the same placements
source benchmarks/device_setup.sh
set +e
nvidia-smi -L
for s in "${@:-tests table}"; do
  for t in $s; do
  echo "=============== $t"
  case $t in
    tests) timeout 240 python3 -m pytest -q -m gpu tests/test_placement_runtime.py tests/test_gpu_decode.py \
             -p no:cacheprovider --tb=short 2>&1 | tail -15 ;;
    table) hm calibrate 2>&1 | tail -4
           ( time hm synth qwen3-30b-a3b ) 2>&1 | tail -4
           timeout 420 python3 benchmarks/multi_gpu.py -m synth:qwen3-30b-a3b --tokens 256 --steps 16 --bench -- \
             '-ngl 99 -ts 1/1' \
             '-ngl 99 -ts 1/1 --n-cpu-moe 24' \
             '-ngl 99 -ts 1/1 -ot exps=CPU' \
             '-ngl 99 -ts 1/1 -ot blk\.[0-7]\.ffn_gate_exps=CUDA0 -ot blk\.[0-7]\.ffn_(up|down)_exps=CUDA1 -ot exps=CPU' \
             '-ngl 99 -ts 1/1 -ot blk\.[0-7]\.ffn_.*_exps=CUDA1 -ot exps=CPU' 2> ${OUT:-/tmp}/multi_gpu.stderr; tail -5 ${OUT:-/tmp}/multi_gpu.stderr ;;
    bench) hm synth qwen3-30b-a3b 2>&1 | tail -1
           for P in '-ngl 99 -ts 1/1' '-ngl 99 -ts 1/1 --n-cpu-moe 24' '-ngl 99 -ts 1/1 -ot exps=CPU' \
                    '-ngl 99 -ts 1/1 -ot blk\.[0-7]\.ffn_.*_exps=CUDA1 -ot exps=CPU' \
                    '-ngl 99 -ts 1/1 -ot blk\.[0-7]\.ffn_gate_exps=CUDA0 -ot blk\.[0-7]\.ffn_(up|down)_exps=CUDA1 -ot exps=CPU'; do
             echo "### hybridmoe bench -m synth:qwen3-30b-a3b $P -p 512 -n 128 -r 2"
             read -ra A <<< "$P"
             timeout 100 python3 -m hybridmoe.cli bench -m synth:qwen3-30b-a3b "${A[@]}" -p 512 -n 128 -r 2 2>&1 \
               | grep -E "pp512|tg128|rror" | cut -c1-200
           done ;;
  esac
  done
done
