#!/usr/bin/env bash
# One GPU-machine call: GPU tests (incl. ik's quant files on a real GPU), issue 25's fault repro, a short bench,
# long prompts on the GPU (longprompt), the exact CPU prompt path's cost (promptcost), batched decode (batch, gpubatch,
# gpumoe, gpumoestep, gpumoebase, gpumoetiles, gpummq, gpummqtiles, gpummqstep, gpummqbase), the users' expert
# types' kernels (gputypes, typesbench).
# Usage: bash benchmarks/gpu_check.sh SECTION...
# Needs the quant vectors beside the repository: run_gpu copies them in as .gpu_testdata when present.
source benchmarks/device_setup.sh
set +e
if [ -d .gpu_testdata ]; then mkdir -p ../shared/testdata && ln -sfn "$PWD/.gpu_testdata" ../shared/testdata/quant-vectors; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# `ab N LABEL CMD...`: CMD N times with the code before (.carry/base_src: a copy of an earlier commit's src/) and
# after (src/) on the path, alternated; `types` and `bench_rows`: bench_types.py's and bench's table rows
ab() {
  local n=$1 label=$2 r v
  shift 2
  for r in $(seq "$n"); do for v in base src; do
    echo "### $label$v, round $r"
    ( if [ $v = base ]; then export PYTHONPATH=$PWD/.carry/base_src:/tmp/hm-site; fi; "$@" )
  done; done
}
types() { timeout 200 python3 benchmarks/bench_types.py --repeat 2 "$@" 2>&1 | grep -E "^\| [IQ]"; }
# `share_sweep PRESET COUNT...`: tg128 with experts in RAM at each decode-share count (auto: the planner's)
share_sweep() {
  local p=$1 v
  shift
  python3 -m hybridmoe.cli synth "$p" 2>&1 | tail -1
  for v in "$@"; do
    echo "### synth:$p -ot exps=CPU, decode share $v"
    ( [ "$v" = auto ] || export HYBRIDMOE_DECODE_SHARE=$v
      timeout 120 python3 -m hybridmoe.cli bench -m synth:$p -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3 --roofline 2>&1 \
        | grep -E "tg128" )
  done
  find "$HYBRIDMOE_CACHE" -name "synth-$p-v*.gguf" -delete
}
bench_rows() { timeout 150 python3 -m hybridmoe.cli bench "$@" 2>&1 | grep -E "^\| " | tail -2; }
# `oss_ab FILE "TEST FLAGS" PLACEMENT...`: a gpt-oss-20b file's bench rows, before (base) / after, in each placement
# (its flags after -ngl 99; `gpu`: all on the GPU)
oss_ab() {
  local f=$1 t=$2 pl flags
  shift 2
  for pl in "$@"; do
    flags=$pl
    [ "$pl" = gpu ] && flags=
    # shellcheck disable=SC2086
    ab 1 "gpt-oss-20b ${pl/#gpu/all on GPU}, " bench_rows -m "$f" -ngl 99 $flags $t -r "${REPS:-2}"
  done
}
for s in "$@"; do
  echo "=============== $s"
  case $s in
    gputests) HYBRIDMOE_CACHE=/tmp/hm-test timeout 420 python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --tb=short 2>&1 | tail -25 ;;
    # the same tests, one process per file (a CUDA fault is sticky: it fails every later test of its process),
    # three files at a time, synchronous launches so a fault names its kernel; logs under $OUT/gpufiles
    # (SKIP_FILES: a grep -E pattern of files to leave out)
    gpufiles) d=${OUT:-/tmp}/gpufiles; mkdir -p $d
              python3 -c "from hybridmoe.kernels import cpu; assert cpu._load()"
              grep -l "mark.gpu" tests/test_*.py tests/quant/test_*.py \
                | grep -v -E "${SKIP_FILES:-^$}" | xargs -P 3 -I{} sh -c \
                'f={}; CUDA_LAUNCH_BLOCKING=1 OMP_NUM_THREADS=4 timeout 400 python3 -m pytest -q -s -m gpu $f \
                   -p no:cacheprovider --tb=long -rfE > '$d'/$(basename $f .py).log 2>&1; echo "$f rc $?"'
              grep -h -E "^(FAILED|ERROR)|passed|failed" $d/*.log | cut -c1-200
              tar czf $d.tgz -C $d . && rm -r $d ;;
    # the Triton kernels' tests on the GPU (they run in Triton's interpreter without one; not marked gpu, so
    # gputests / gpufiles' `-m gpu` leave them out)
    triton) HYBRIDMOE_CACHE=/tmp/hm-test timeout 400 python3 -m pytest -q tests/test_gpu_decode.py tests/test_gpu_batch.py \
              tests/test_gpu_dequant_types.py -p no:cacheprovider --tb=short -rfE 2>&1 | tail -40 ;;
    # issue 25: 300- and 1,000-token prompts on the GPU against transformers (the per-case error lines), and the
    # placements the static decode step refuses instead of failing its capture
    longprompt) HYBRIDMOE_CACHE=/tmp/hm-test timeout 540 python3 -m pytest -q -m gpu tests/test_prompt_precision.py \
                  tests/test_static_steps.py -p no:cacheprovider -s --tb=short 2>&1 \
                  | grep -E "(F32|F16|BF16|Q[0-9]_[0-9K]) (all-gpu|exps-cpu)|passed|failed|Error|assert" | tail -60 ;;
    # issue 25: the exact CPU prompt path against the bf16 tiles, interleaved on one loaded model (prompt_cost.py);
    # all on the CPU (hm_prompt_step; -nopo, else -ngl 0 may offload a prompt's ops to the GPU), then hybrid (the
    # eager decoder; a 512-token ubatch uploads the CPU experts)
    promptcost) ( time python3 -m hybridmoe.cli synth qwen3-30b-a3b ) 2>&1 | tail -4
                timeout 300 python3 benchmarks/prompt_cost.py -m synth:qwen3-30b-a3b -ngl 0 -nopo -p 512 -r 2 2>&1 | tail -14
                timeout 200 python3 benchmarks/prompt_cost.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU -p 512 -r 2 \
                  2>&1 | tail -14 ;;
    quantgpu) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/quant -p no:cacheprovider --tb=short 2>&1 | tail -8 ;;
    fault) timeout 150 python3 -u benchmarks/fault_repro.py /tmp 2>&1 | tail -30 ;;
    types) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/test_gpu_dequant_types.py tests/test_mixes.py \
             tests/quant/test_random_blocks.py -p no:cacheprovider --tb=short 2>&1 | tail -12 ;;
    typesdq) timeout 300 python3 benchmarks/bench_gpu_dequant.py dequant --json ${OUT:-/tmp}/bench_gpu_dequant_dq.json 2>&1 | tail -25 ;;
    typespp) timeout 560 python3 benchmarks/bench_gpu_dequant.py pp --layers 12 --json ${OUT:-/tmp}/bench_gpu_dequant_pp.json 2>&1 | tail -12 ;;
    runtime) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/test_gpu_decode.py tests/test_placement_runtime.py \
               -p no:cacheprovider --tb=short 2>&1 | tail -12 ;;
    # issue 27: forward_batch on a real GPU (its GPU test prints max |logit diff| batched vs alone), then decode
    # steps of B sequences at once on synth:tiny and on the 30B shape, all on the GPU and with experts on the CPU
    batch) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q -s tests/test_batch.py -p no:cacheprovider \
             --tb=short 2>&1 | grep -E "max \|logit|passed|failed|Error" ;
           timeout 120 python3 -u benchmarks/batch_decode.py -m synth:tiny -ngl 99 --batch 1,4,16,64 2>&1 | tail -7 ;
           timeout 500 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --steps 8 2>&1 | tail -10 ;
           timeout 500 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU --steps 8 \
             --batch 1,2,4,8,16 2>&1 | tail -8 ;;
    # issue 27: `hybridmoe serve -np N` under openai clients (benchmarks/serve_load.py); each line loads the 30B
    # shape once. serveload: all on the GPU (target: 16 clients >= 6x one); serveload_cpu: --n-cpu-moe 24 and
    # -ot exps=CPU (target: 8 clients >= 1.8x one; at 4 no stream below 1/3 of its alone speed). The last
    # line of each is one client on an -np 1 server: the single-stream baseline without slot switches. Each run
    # prints two tables: the rates, then where the CPU went (generation thread, event loop, clients, machine).
    serveload) python3 -c "import openai" || { echo "serve_load.py needs the openai package"; continue; }
           timeout 280 python3 -u benchmarks/serve_load.py --concurrency 1,4,16,64 --rounds 2 -- \
             -m synth:qwen3-30b-a3b -ngl 99 2>&1 | grep -E "^\|" ;
           timeout 200 python3 -u benchmarks/serve_load.py --concurrency 1 -- -m synth:qwen3-30b-a3b -ngl 99 -np 1 \
             2>&1 | grep -E "^\|" ;;
    serveload_cpu) python3 -c "import openai" || { echo "serve_load.py needs the openai package"; continue; }
           timeout 260 python3 -u benchmarks/serve_load.py --concurrency 1,4,8,16 --rounds 2 -- \
             -m synth:qwen3-30b-a3b -ngl 99 --n-cpu-moe 24 2>&1 | grep -E "^\|" ;
           timeout 260 python3 -u benchmarks/serve_load.py --concurrency 1,4,8 --rounds 2 -- \
             -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU 2>&1 | grep -E "^\|" ;;
    # issue 27 point 3: the batched decode kernels and the captured step per bucket against torch and the eager
    # batched path (tests/test_gpu_batch.py), then B sequences a step on the 30B shape all on the GPU: the step
    # column says BatchDecode[bucket graph] where the graph replayed; --no-graphs gives the eager batch for comparison
    gpubatch) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/test_gpu_batch.py -p no:cacheprovider \
                --tb=short 2>&1 | tail -12 ;
              timeout 120 python3 -u benchmarks/batch_decode.py -m synth:tiny -ngl 99 --batch 1,3,4,16,64 2>&1 | tail -7 ;
              timeout 400 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --steps 8 2>&1 | tail -10 ;
              timeout 300 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --no-graphs --steps 4 \
                --repeat 2 --batch 1,4,16 2>&1 | tail -6 ;;
    # issue 27 point 3: the grouped decode MoE (kernels/gpu_moe_grouped.py): its tests and the batch step's on the GPU,
    # one 30B MoE layer at B = 1..64 by the per-pair GEMVs, the grouped GEMVs and the grouped GEMMs
    # (bench_moe_decode.py --grouped). gpumoestep: the 30B batched step on the grouped GEMVs (the step column
    # names the kernels); gpumoebase: the same step as auto chooses (per-pair up to B = 8, grouped GEMMs from 16),
    # for the ratio on the same machine; gpumoetiles: block heights and tiles.
    # One section a call (each fits 10 minutes)
    gpumoe) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/test_gpu_moe_grouped.py \
              tests/test_gpu_batch.py tests/test_experts.py -p no:cacheprovider --tb=short -rfE 2>&1 | tail -12 ;
            timeout 280 python3 -u benchmarks/bench_moe_decode.py --grouped Q4_0,Q8_0 2>&1 | tail -18 ;;
    gpumoestep) HYBRIDMOE_GPU_MOE=grouped timeout 560 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --steps 8 2>&1 | tail -10 ;;
    gpumoebase) HYBRIDMOE_GPU_MOE=pair timeout 280 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
                  --steps 8 --batch 1,2,4,8 2>&1 | tail -6 ;
                HYBRIDMOE_GPU_MOE=gemm timeout 280 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
                  --steps 8 --batch 16,32,64 2>&1 | tail -5 ;;
    gpumoetiles) timeout 500 python3 -u benchmarks/bench_moe_decode.py --grouped-tiles Q4_0,Q8_0 2>&1 | tail -8 ;;
    # issue 27: the int8 tensor-core MoE kernels (kernels/gpu_mmq.py). gpummq: their tests (float64 at the 30B
    # shape, B = 1..64, skewed routings; the batched step on them), then one 30B MoE layer at B = 1..64 by every
    # kernel (the mmq column; gemm / mmq: for experts.MMQ_MIN_PAIRS / MMQ_MAX_TOKENS). gpummqtiles: the tile
    # sweep (for gpu_mmq.TILES). gpummqstep: the 30B batched step on mmq; gpummqbase: on what auto chose before
    # (per-pair at B = 8, the GEMMs above). One section a call
    gpummq) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/test_gpu_mmq.py tests/test_experts.py \
              tests/test_gpu_batch.py -k "mmq or moe_path or moe_kernels" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -12 ;
            timeout 240 python3 -u benchmarks/bench_moe_decode.py --grouped Q4_0,Q8_0 2>&1 | tail -17 ;;
    gpummqtiles) timeout 500 python3 -u benchmarks/bench_moe_decode.py --mmq-tiles Q4_0,Q8_0 2>&1 | tail -14 ;;
    gpummqstep) HYBRIDMOE_GPU_MOE=mmq timeout 500 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
                  --batch 8,16,32,64 --steps 8 --repeat 2 --kprofile 6 2>&1 | tail -40 ;;
    gpummqbase) HYBRIDMOE_GPU_MOE=pair timeout 200 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
                  --batch 8 --steps 8 --repeat 2 --kprofile 6 2>&1 | tail -12 ;
                HYBRIDMOE_GPU_MOE=gemm timeout 380 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
                  --batch 16,32,64 --steps 8 --repeat 2 --kprofile 6 2>&1 | tail -30 ;;
    # the all-GPU server after its warm-up compiles every prompt kernel variant, and one client on a many-slot server
    # with experts in RAM without the HTTP side (issue 27)
    servegpu) timeout 200 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 1 -- -m synth:qwen3-30b-a3b \
                -ngl 99 -np 16 2>&1 | grep -E "^\| [0-9]|warm" | head -6
              timeout 80 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU --concurrency 1 \
                --slots 8 --requests 10 --repeat 1 2>&1 | tail -2 ;;
    # after the capture and batch-share changes: their GPU tests, one client on a 16-slot server, the batched step
    # with experts in RAM on the share's own fraction, the server with experts in RAM at 1, 4 and 8 clients (issue 27)
    servecheck) HYBRIDMOE_CACHE=/tmp/hm-test timeout 170 python3 -m pytest -q tests/test_gpu_batch.py tests/test_static_steps.py \
                  tests/test_gpu_decode.py -k "host or mixed or step or stage or capture" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
                timeout 70 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 --concurrency 1 --slots 16 \
                  --requests 6 --repeat 1 2>&1 | tail -2
                timeout 110 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 -ot exps=CPU --batch 4,8,16 \
                  --steps 6 --repeat 2 2>&1 | grep -E "alone|^ +[0-9]"
                timeout 220 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
                  -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -E "^\| [0-9]|slot warm" | head -4 ;;
    # the server's generation thread with one client on 1 and on 16 slots (all on the GPU), and the batch decode
    # share's count swept at B = 16 with experts in RAM (issue 27)
    slotsweep) for S in 1 16; do echo "### serve_steps --slots $S"
                 timeout 100 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 --concurrency 1 --slots $S \
                   --requests 6 --repeat 1 $([ $S = 16 ] && echo --cprofile) 2>&1 | grep -v "^$" | tail -32; done
               for V in 0 1 2 3; do echo "### HYBRIDMOE_DECODE_SHARE=$V"
                 HYBRIDMOE_DECODE_SHARE=$V timeout 100 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
                   -ot exps=CPU --batch 16 --steps 6 --repeat 2 2>&1 | grep -E "alone|^ +16"; done ;;
    # the batch decode share with experts in RAM (against it off), a slot's first use, the all-GPU server after
    # mixed steps split into the batched decode step and the prompt path (issue 27)
    sharecheck) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpu_batch.py tests/test_gpu_decode.py \
                  -k "mixed or host or stage_experts" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8
                for V in "" 0; do echo "### HYBRIDMOE_DECODE_SHARE=$V"
                  HYBRIDMOE_DECODE_SHARE=$V timeout 150 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
                    -ot exps=CPU --batch 2,8,16 --steps 6 --repeat 2 2>&1 | tail -5; done
                timeout 90 python3 -u benchmarks/slot_first_use.py -m synth:qwen3-30b-a3b -ngl 99 --caches 3 \
                  --cprofile 22 2>&1 | grep -v "^$" | head -48
                timeout 170 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 1 -- -m synth:qwen3-30b-a3b \
                  -ngl 99 -np 16 2>&1 | grep -E "^\| [0-9]" | head -3 ;;
    # the batched all-GPU step on auto's kernels (per-pair GEMVs, then mmq from 129 pairs), and the all-GPU server
    # at 1, 4 and 16 clients (issue 27's 6x at 16)
    batchgpu) timeout 240 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --batch 1,8,16,32,64 \
                --steps 8 --repeat 2 2>&1 | tail -14
              timeout 200 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 1 -- -m synth:qwen3-30b-a3b \
                -ngl 99 -np 16 2>&1 | tail -25 ;;
    # the all-GPU server after the slots' warm-up at 1, 4 and 16 clients with both tables, then its generation thread
    # alone at 4 and 16 jobs on 16 slots with cProfile: where the 16 clients' steps go (issue 27's 6x at 16)
    servelost) timeout 230 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 1 -- -m synth:qwen3-30b-a3b \
                 -ngl 99 -np 16 2>&1 | grep -E "^\||warm" | head -16
               timeout 250 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 --concurrency 4,16 --slots 16 \
                 --requests 32 --repeat 1 --cprofile 2>&1 | grep -v "^$" | head -80 ;;
    # the all-GPU server's generation thread alone at 1, 4 and 16 jobs on 16 slots, its model calls timed by kind
    servetrace) timeout 300 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 --concurrency 1,4,16 \
                  --slots 16 --requests 32 --repeat 1 --trace 2>&1 | grep -v "^$" | tail -45 ;;
    # prompt chunks as rows of the batched step: its GPU tests, the generation thread alone at 4 and 16 jobs, the
    # all-GPU server at 1, 4 and 16 clients, the server with experts in RAM at 1, 4 and 8 (issue 27)
    rows) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpu_batch.py tests/test_static_steps.py \
            tests/test_server_slots.py -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          timeout 150 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 --concurrency 4,16 \
            --slots 16 --requests 32 --repeat 1 --trace 2>&1 | grep -v "^$" | tail -24
          timeout 200 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -np 16 2>&1 | grep -E "^\||warm" | head -14
          timeout 200 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -E "^\||warm" | head -8 ;;
    # the two tests that failed on the GPU machine, in full (the server one also on base_src_tmp/src when present),
    # the per-pair split kernels' tiles at batch sizes, the server with experts in RAM at 1, 4 and 8 clients
    s29b) for t in tests/test_server_slots.py::test_logprobs_penalties_and_grammar_per_sequence_in_a_batch \
               "tests/test_static_steps.py::test_no_capture_fails_on_a_gpu[IQ2_KL]"; do
            HYBRIDMOE_CACHE=/tmp/hm-test timeout 120 python3 -m pytest -q -x "$t" -p no:cacheprovider --tb=short 2>&1 \
              | grep -E "^E |assert|passed|failed" | head -14; done
          if [ -d base_src_tmp/src ]; then echo "### base"; PYTHONPATH=$PWD/base_src_tmp/src:/tmp/hm-site HYBRIDMOE_CACHE=/tmp/hm-test \
            timeout 120 python3 -m pytest -q -x tests/test_server_slots.py::test_logprobs_penalties_and_grammar_per_sequence_in_a_batch \
            -p no:cacheprovider --tb=line 2>&1 | tail -2; fi
          timeout 200 python3 -u benchmarks/bench_moe_decode.py --split-batch Q4_0 2>&1 | tail -12
          timeout 300 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -E "^\||warm" | head -8 ;;
    # the generation thread with experts in RAM at 4 jobs (all threads' stacks if it hangs), the IQ2_KL GPU-vs-CPU
    # test with two activation terms on the CPU, the batched all-GPU step on the batch tiles, the all-GPU server
    s29c) timeout -s ABRT 150 python3 -X faulthandler -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 \
            -ot exps=CPU --concurrency 4 --slots 8 --requests 8 --repeat 1 --trace 2>&1 | grep -v "^$" | tail -50
          HYBRIDMOE_CPU_ACT_TERMS=2 HYBRIDMOE_CACHE=/tmp/hm-test timeout 120 python3 -m pytest -q -x \
            "tests/test_static_steps.py::test_no_capture_fails_on_a_gpu[IQ2_KL]" -p no:cacheprovider --tb=line 2>&1 | tail -2
          timeout 150 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --batch 1,4,16,32 \
            --steps 8 --repeat 2 2>&1 | tail -7
          timeout 200 python3 benchmarks/serve_load.py --concurrency 1,16 --rounds 2 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -np 16 2>&1 | grep -E "^\| [0-9]" | head -3 ;;
    # the server with experts in RAM at 1, 4 and 8 clients with its whole output, then the batched all-GPU step's
    # kernels at B = 16
    s29d) timeout 300 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -v "^$" | tail -40
          timeout 150 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --batch 16 \
            --steps 8 --repeat 2 --kprofile 14 2>&1 | tail -22 ;;
    # the CPU server's batched-vs-alone test (fails on the GPU machine's CPU, passes on the AVX-512 VNNI dev VM)
    # under each switch of a CPU path that differs with AMX
    s29e) for V in "" HYBRIDMOE_CPU_ATTN=fp32 HYBRIDMOE_CPU_GEMM_MIN_T=100000 HYBRIDMOE_CPU_QMM_MIN_T=100000 \
                   HYBRIDMOE_CPU_PROMPT=bf16; do echo "### $V"
            env $V HYBRIDMOE_CACHE=/tmp/hm-test timeout 100 python3 -m pytest -q -x \
              tests/test_server_slots.py::test_logprobs_penalties_and_grammar_per_sequence_in_a_batch -p no:cacheprovider \
              --tb=no 2>&1 | tail -1; done
          python3 -c "from hybridmoe.kernels import cpu; print(cpu.simd())"; grep -o -w -E "amx_bf16|amx_int8|avx512_vnni" /proc/cpuinfo | sort -u ;;
    # the batch decode share's count swept at B = 4 and 8 with experts in RAM (auto first), then the two prompt rows
    # of --suggest's 24 GiB ranking that came out against the bytes, each benched twice in turn
    s29f) for V in "" 0 1 2 3; do echo "### HYBRIDMOE_DECODE_SHARE=$V"
            HYBRIDMOE_DECODE_SHARE=$V timeout 100 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
              -ot exps=CPU --batch 4,8 --steps 6 --repeat 2 2>&1 | grep -E "alone|^ +[48] "; done
          $0 ncmoepp ;;
    ncmoepp) for r in 1 2; do for N in 1 2; do
               timeout 80 python3 -m hybridmoe.cli bench -m synth:qwen3-30b-a3b -ngl 99 -ncmoe $N -nopo 1 -ub 512 \
                 -p 512 -n 0 -r 3 2>&1 | grep pp512; done; done ;;
    # the session's last check: the GPU tests of what changed, the all-GPU server at 1, 4 and 16 clients, and the
    # two prompt rows of s29f
    s29g) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpu_batch.py tests/test_static_steps.py \
            tests/test_server_slots.py -p no:cacheprovider --tb=short -rfE 2>&1 | tail -4
          timeout 220 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -np 16 2>&1 | grep -E "^\| [0-9]+ \| [0-9]+ \| [0-9]" | head -3
          ;;
    # one slot (serve's default -np 1) all on the GPU: its warm-up builds the batched step for prompts as rows
    np1) timeout 200 python3 benchmarks/serve_load.py --concurrency 1 --rounds 8 -- -m synth:qwen3-30b-a3b -ngl 99 -np 1 \
           2>&1 | grep -E "warm|^\| 1 \| [0-9]" | head -6 ;;
    # the grouped GEMVs at B = 16 over block heights 2 and 4 and tiles, against the per-pair kernels (issue 27)
    # issue 27: what bounds the batched step's MoE kernels at B=16 (Nsight Compute on the per-pair, grouped and mmq
    # kernels of one 30B layer; the full report in $OUT/ncu16.txt), then where the B=16 step's host time goes
    ncu16) timeout 420 ncu --clock-control none -k regex:"gate_up8|down8|mmq_kernel" --launch-count 18 \
             --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats --section Occupancy \
             --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis \
             python3 benchmarks/bench_moe_decode.py --ncu Q4_0 > ${OUT:-/tmp}/ncu16.txt 2>&1; echo "ncu rc $?"
           grep -E "^  [_a-zA-Z].*\(|Duration|Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|Executed Ipc A|highest-utilized|stalled|Block Limit|Theoretical Occ" \
             ${OUT:-/tmp}/ncu16.txt | cut -c1-220 | head -170 ;;
    # the dp4a kernels' tiles with a thread holding one block of several rows (bench_moe_decode.tile_grid): the
    # batched step's per-pair kernels at B=16, one token's, and the static step's dense GEMVs
    tiles64) timeout 250 python3 -u benchmarks/bench_moe_decode.py --split-batch-16 Q4_0 2>&1 | tail -4
             timeout 150 python3 -u benchmarks/bench_moe_decode.py --split Q4_0,Q8_0 2>&1 | tail -8
             timeout 150 python3 -u benchmarks/bench_moe_decode.py --dense Q8_0 2>&1 | tail -6 ;;
    # the new tiles: the batch rule at 4 and 32 tokens, the all-GPU step at each batch size, where a B=16 step's host
    # time goes, and the server at 1, 4 and 16 clients
    s30a) timeout 200 python3 -u benchmarks/bench_moe_decode.py --split-batch-4-32 Q4_0 2>&1 | grep -E "rule|layer"
          timeout 300 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --batch 4,8,16,32 --steps 16 \
            --cprofile 40 2>${OUT:-/tmp}/cprofile16.txt | tail -6
          timeout 200 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b -ngl 99 \
            -np 16 2>&1 | tail -8 ;;
    # the per-pair kernels on their new tiles against mmq from 2 to 64 tokens (gpu_moe_path's MMQ_MIN_PAIRS), the
    # step on per-pair kernels alone at 32 and 64, the server at 1, 4 and 16 clients
    s30b) timeout 200 python3 -u benchmarks/bench_moe_decode.py --grouped Q4_0 2>&1 | tail -8
          HYBRIDMOE_GPU_MOE=pair timeout 200 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 \
            --batch 32,64 --steps 16 2>&1 | tail -3
          timeout 220 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b -ngl 99 \
            -np 16 2>&1 | grep -E "^\| [0-9]|warm|^\| clients" | head -12 ;;
    # the GPU tests of the retiled kernels and the device-resident logits, then the server all on the GPU
    s30c) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/test_gpu_decode.py tests/test_gpu_batch.py \
            tests/test_static_steps.py tests/test_experts.py tests/test_gpu_mmq.py -p no:cacheprovider --tb=short -rfE \
            2>&1 | tail -8
          timeout 220 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b -ngl 99 \
            -np 16 2>&1 | grep -E "^\| [0-9]|warm|^\| clients" | head -12 ;;
    s30d) timeout 300 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -E "^\| [0-9]|^\| clients" | head -12 ;;
    # the B=16 step's GPU time on the new tiles, the server's generation thread at 16 jobs (model calls by kind, the
    # garbage collections; then with the objects frozen as serve does), the grouped GEMVs on one- and two-warp tiles
    s30e) timeout 200 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --batch 16 --steps 16 \
            --kprofile 8 2>&1 | tail -11
          for F in "" --freeze; do timeout 150 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 \
            --concurrency 16 --requests 64 --repeat 1 --trace $F 2>&1 | tail -14; done
          timeout 240 python3 -u benchmarks/bench_moe_decode.py --grouped-tiles-16 Q4_0 2>&1 | tail -4 ;;
    # the server after gc.freeze: all on the GPU (16 clients; target 6x one), experts in RAM (8 clients; target 1.8x)
    s30f) timeout 220 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b -ngl 99 \
            -np 16 2>&1 | grep -E "^\| [0-9]|^\| clients" | head -12
          timeout 300 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -E "^\| [0-9]|^\| clients" | head -12 ;;
    # gpu_mmq's tiles at 64 tokens (the prompt bursts' rows and the largest decode bucket), then the GPU tests of the
    # changed files, one process a file
    s30g) timeout 240 python3 -u benchmarks/bench_moe_decode.py --mmq-tiles-64 Q4_0 2>&1 | grep -E "TILES|layer"
          for f in tests/test_gpu_decode.py tests/test_gpu_batch.py tests/test_static_steps.py tests/test_gpu_mmq.py \
                   tests/test_experts.py tests/test_server_slots.py; do
            HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q $f -p no:cacheprovider --tb=short -rfE 2>&1 \
              | tail -2 | sed "s|^|$f: |"; done ;;
    # the queued decode steps: their tests on the GPU, the server all on the GPU (16 clients; target 6x one), then the
    # generation thread alone at 16 jobs (model calls by kind), with experts in RAM (8 clients; target 1.8x)
    s30h) for f in tests/test_gpu_batch.py tests/test_server_slots.py; do
            HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q $f -p no:cacheprovider --tb=short -rfE 2>&1 \
              | tail -2 | sed "s|^|$f: |"; done
          timeout 220 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b -ngl 99 \
            -np 16 2>&1 | grep -E "^\| [0-9]|^\| clients" | head -12 ;;
    s30i) timeout 300 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -E "^\| [0-9]|^\| clients" | head -12
          timeout 150 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 --concurrency 16 --requests 64 \
            --repeat 1 --trace --freeze 2>&1 | tail -9 ;;
    # experts in RAM with the queued steps left to all-GPU placements (8 clients; target 1.8x)
    s30j) timeout 300 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
            -ngl 99 -ot exps=CPU -np 8 2>&1 | grep -E "^\| [0-9]|^\| clients" | head -12 ;;
    # row buckets of 128 and 256 all on the GPU: the MoE kernels at 64-256 rows, the batch tests, the server at 1,
    # 4 and 16 clients and where its generation thread's time goes at 16
    s31a) timeout 150 python3 -u benchmarks/bench_moe_decode.py --grouped-rows Q4_0 2>&1 | tail -5
          HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpu_batch.py -p no:cacheprovider \
            --tb=short -rfE 2>&1 | tail -4
          timeout 220 python3 benchmarks/serve_load.py --concurrency 1,4,16 --rounds 2 -- -m synth:qwen3-30b-a3b -ngl 99 \
            -np 16 2>&1 | grep -E "^\| [0-9]|^\| clients|warm" | head -12
          timeout 150 python3 -u benchmarks/serve_steps.py -m synth:qwen3-30b-a3b -ngl 99 --concurrency 16 --requests 64 \
            --repeat 1 --trace --freeze 2>&1 | tail -9 ;;
    # issue 27's table: the server at 1, 4, 16 and 64 clients (64 slots) all on the GPU, with 24 layers' experts
    # in RAM and with every expert in RAM
    s31b) for fl in "-ngl 99" "-ngl 99 --n-cpu-moe 24" "-ngl 99 -ot exps=CPU"; do
            echo "--- $fl"
            timeout 180 python3 benchmarks/serve_load.py --concurrency 1,4,16,64 --rounds 1 -- -m synth:qwen3-30b-a3b \
              $fl 2>&1 | grep -E "^\| [0-9]|^\| clients|warm" | head -14; done ;;
    # issue 24: the x types' scales decoded 4 rows at a time (x_scales4), the kernel before (.carry/base_src: the
    # parent commit's src) and after, alternated; then the canonical-products tests on this CPU
    s32a) ab 2 "" types --threads 16 --batches 1,8 --types IQ4_XS,Q3_K,IQ4_KS,IQ4_K,IQ5_K,Q2_K,IQ2_K,Q4_0
          HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_cpu_kernel_types.py -p no:cacheprovider \
            -k "any_batch or moe_ffn or qmatmul or activation_terms" 2>&1 | tail -3 ;;
    # issue 24: experts in RAM, tg128 with IQ4_KS and the Q3_K mix's experts, before and after x_scales4
    s32b) for m in iq4_ks q3_k_mix; do python3 -m hybridmoe.cli synth qwen3-30b-a3b-$m 2>&1 | tail -1
            ab 2 "$m " bench_rows -m synth:qwen3-30b-a3b-$m -ngl 99 -ot exps=CPU -p 512 -n 128 -r 2 --roofline; done ;;
    # issue 24: x_scales4 at T=1 on 8 and 16 threads, before / after alternated three times; then tg128 of the Q3_K
    # mix's experts in RAM with the decode share held at 3 experts (the kernel alone decides the difference)
    s32c) for th in 8 16; do ab 3 "$th threads " types --threads $th --batches 1 --types IQ4_XS,Q3_K,IQ4_KS,IQ4_K,Q2_K,Q4_0
          done
          python3 -m hybridmoe.cli synth qwen3-30b-a3b-q3_k_mix 2>&1 | tail -1
          HYBRIDMOE_DECODE_SHARE=3 ab 2 "q3_k_mix, share 3, " bench_rows -m synth:qwen3-30b-a3b-q3_k_mix -ngl 99 \
            -ot exps=CPU -p 0 -n 128 -r 3 ;;
    # the decode share's count on Q4_0 and the Q3_K mix's experts in RAM: the planner's own (and what it chose)
    # against 2, 3 and 4 experts of 8 forced, alternated twice
    s32d) for m in "" -q3_k_mix; do python3 -m hybridmoe.cli synth qwen3-30b-a3b$m 2>&1 | tail -1
            for r in 1 2; do for sh in "" 2 3 4; do
              echo "### qwen3-30b-a3b$m share [${sh:-auto}] round $r"
              HYBRIDMOE_DECODE_SHARE=$sh timeout 100 python3 -m hybridmoe.cli bench -m synth:qwen3-30b-a3b$m -ngl 99 \
                -ot exps=CPU -p 0 -n 128 -r 3 2>&1 | grep -E "^\| .*tg128|decode share:" | cut -c1-150
            done; done; done ;;
    # issue 24: x_scales4 with IQ3_K and IQ2_KS too, T=1 on 16 threads, before (.carry/base_src) / after, 3 rounds
    s32e) ab 3 "" types --threads 16 --batches 1 --types IQ3_K,IQ2_KS,IQ4_XS,Q3_K,IQ4_KS,Q4_0 ;;
    # issue 24: IQ2_KL's and Q6_K's scales 4 rows at a time, T=1 on 16 threads, before / after, 3 rounds
    s32f) ab 3 "" types --threads 16 --batches 1 --types IQ2_KL,Q6_K,IQ4_XS,Q4_0 ;;
    # issue 24: the per-16 types' float chains four to a row in one zmm (cdot_ref's four chains), before
    # (.carry/base_src: the parent commit's src) / after alternated: T=1 on 16 threads three times; the
    # canonical-products tests on this CPU (AMX tiles included)
    s33a) ab 3 "" types --threads 16 --batches 1 --types IQ4_XS,Q3_K,IQ4_KS,IQ4_K,Q6_K,Q2_K,IQ3_K,IQ2_KS,Q4_0
          HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_cpu_kernel_types.py \
            tests/test_prompt_precision.py -p no:cacheprovider -k "any_batch or moe_ffn or qmatmul or activation_terms \
            or dense_products" 2>&1 | tail -3 ;;
    # the same on 1 and 4 threads, two rounds (~6.5 minutes); s33c: T=256 on 16 threads (the AMX int8 tiles' chains)
    s33b) ab 2 "1 thread " types --threads 1 --batches 1 --repeat 1 --types IQ4_XS,Q3_K,Q6_K,Q2_K,Q4_0
          ab 2 "4 threads " types --threads 4 --batches 1 --repeat 1 --types IQ4_XS,Q3_K,IQ4_KS,Q6_K,Q2_K,Q4_0 ;;
    s33c) ab 2 "T=256 " types --threads 16 --batches 256 --repeat 1 --types IQ4_XS,IQ4_KS,Q6_K,Q3_K,Q4_0 ;;
    # issue 24: the two-table types' lookups by one vpermb (x_tab2) and IQ2_KL's indices by gf2p8affine, T=1 on 16
    # threads, before (.carry/base_src: a copy of 513d192's src/) / after, 3 rounds
    s33d) ab 3 "" types --threads 16 --batches 1 --repeat 1 --types IQ4_KS,IQ4_K,IQ5_K,IQ2_K,IQ3_K,IQ2_KS,IQ2_KL,Q4_0 ;;
    # issue 24: the decode share's count with experts in RAM, the planner's own (auto) against forced counts
    # around it, tg128 of the IQ4_KS and IQ2_KT experts (the CPU kernel near the RAM's rate / bound by its decoding)
    s34a) share_sweep qwen3-30b-a3b-iq4_ks auto 2 3 4 auto
          share_sweep qwen3-30b-a3b-iq2_kt auto 4 5 6 auto ;;
    # issue 24 point 2: the K-quants' prompt GEMMs fused (gpu_qdot.k_tile) on a GPU: the tests, one layer against
    # dequantize + grouped_mm, then pp512 all on the GPU and at --n-cpu-moe 24, before (.carry/base_src: the
    # parent's src, which dequantizes them) / after
    s34b) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpu_qdot.py tests/test_gpu_decode.py \
            -k "prefill_moe or tile_rules" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          HYBRIDMOE_CACHE=/tmp/hm-test timeout 150 python3 -m pytest -q tests/test_static_steps.py -k "no_capture" \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          timeout 150 python3 benchmarks/bench_moe_prefill.py Q4_0,Q4_K,Q6_K,Q5_K,Q3_K,IQ4_XS 512,2048 2>&1 | grep -E "^\| [QI]"
          for P in qwen3-30b-a3b-q3_k_mix qwen3-30b-a3b-q4_k; do
            python3 -m hybridmoe.cli synth $P 2>&1 | tail -1
            ab 1 "$P all on GPU, " bench_rows -m synth:$P -ngl 99 -p 512 -n 0 -r 3
            ab 1 "$P --n-cpu-moe 24, " bench_rows -m synth:$P -ngl 99 --n-cpu-moe 24 -p 512 -n 0 -r 2
            find "$HYBRIDMOE_CACHE" -name "synth-$P-v*.gguf" -delete
          done ;;
    # the rest of s34b (its call ended at Q4_K's --n-cpu-moe 24 row): Q3_K's and IQ4_XS's layer, that row
    s34c) timeout 120 python3 benchmarks/bench_moe_prefill.py Q3_K,IQ4_XS,Q4_K 512,2048 2>&1 | grep -E "^\| [QI]"
          python3 -m hybridmoe.cli synth qwen3-30b-a3b-q4_k 2>&1 | tail -1
          ab 1 "qwen3-30b-a3b-q4_k --n-cpu-moe 24, " bench_rows -m synth:qwen3-30b-a3b-q4_k -ngl 99 --n-cpu-moe 24 \
            -p 512 -n 0 -r 2
          find "$HYBRIDMOE_CACHE" -name "synth-qwen3-30b-a3b-q4_k-v*.gguf" -delete ;;
    # Q2_K's GPU kernels (gpu_qdot.qdot_q23_k, k_tile): the tests, the decode tiles, one prompt layer, then the
    # UD-Q2_K_XL-like mix with experts in RAM (the decode share, which Q2_K lacked) and all on the GPU, before
    # (.carry/base_src: the parent's src) / after
    s34d) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpu_qdot.py -k "Q2_K or q2_k" \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          timeout 60 python3 benchmarks/bench_moe_decode.py --tiles Q2_K,Q3_K 2>&1 | tail -6
          timeout 60 python3 benchmarks/bench_moe_prefill.py Q2_K 512,2048 2>&1 | grep -E "^\| [QI]"
          F=$(python3 -m hybridmoe.cli synth qwen3-30b-a3b-q2_k_mix 2>&1 | tail -1); echo "$F"   # a path: base has no preset
          ab 1 "q2_k_mix -ot exps=CPU, " bench_rows -m "$F" -ngl 99 -ot exps=CPU -p 512 -n 128 -r 2 --roofline
          ab 1 "q2_k_mix all on GPU, " bench_rows -m "$F" -ngl 99 -p 512 -n 128 -r 2 ;;
    # the GPU kernels' tests of the users' types and the decode MoE tests after the Q2_K tile rule; its tiles again
    s34e) HYBRIDMOE_CACHE=/tmp/hm-test timeout 400 python3 -m pytest -q tests/test_gpu_qdot.py tests/test_gpu_decode.py \
            -k "qdot or moe or tile" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          timeout 60 python3 benchmarks/bench_moe_decode.py --tiles Q2_K 2>&1 | tail -3 ;;
    # IQ2_KT's prompt GEMMs fused (gpu_qdot.kt_tile) and its decode GEMV's byte sums by a multiply: the tests, the
    # decode tiles and one prompt layer (fused against dequantize + grouped_mm), then the IQ2_KT file all on the GPU
    # and at --n-cpu-moe 24, before (.carry/base_src: the parent's src, which dequantizes them) / after
    s35a) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpu_qdot.py -k "IQ2_KT or iq2_kt" \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          ab 1 "IQ2_KT decode tiles, " timeout 60 python3 benchmarks/bench_moe_decode.py --tiles IQ2_KT 2>&1 | tail -3
          timeout 90 python3 benchmarks/bench_moe_prefill.py IQ2_KT,Q4_0 512,2048 2>&1 | grep -E "^\| [QI]"
          F=$(python3 -m hybridmoe.cli synth qwen3-30b-a3b-iq2_kt 2>&1 | tail -1); echo "$F"
          ab 1 "iq2_kt all on GPU, " bench_rows -m "$F" -ngl 99 -p 512 -n 128 -r 2
          ab 1 "iq2_kt --n-cpu-moe 24, " bench_rows -m "$F" -ngl 99 --n-cpu-moe 24 -p 512 -n 0 -r 2
          timeout 120 python3 benchmarks/bench_moe_prefill.py --tiles IQ2_KT 512,2048 2>&1 | tail -12 ;;
    # gpt-oss on a GPU: MXFP4's one-pass dequantizer and decode GEMV, gpu_decode's experts with the biases and clamped
    # SwiGLU (the tests), then gpt-oss-20b's shape all on the GPU and at --n-cpu-moe 12, before (.carry/base_src:
    # MXFP4 through the torch reference on the GPU, a per-expert loop for decode tokens) / after; IQ2_KT's prompt tiles
    s35b) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpu_qdot.py tests/test_gpu_dequant_types.py \
            tests/test_gpt_oss.py -k "gpt_oss or MXFP4 or extreme or mxfp4" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          oss_ab "$F" "-p 512 -n 32" gpu "--n-cpu-moe 12"
          timeout 100 python3 benchmarks/bench_moe_prefill.py --tiles IQ2_KT 512,2048 2>&1 | tail -6 ;;
    # gpt-oss's captured decode step (runtime/steps/gpu_decode_oai.py): the tests, then gpt-oss-20b's shape in three
    # placements, before (.carry/base_src: the parent's src, the eager decoder) / after
    s35c) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_qdot.py \
            -k "gpt_oss or mxfp4 or static_decode_step" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          oss_ab "$F" "-p 512 -n 128" gpu
          oss_ab "$F" "-p 0 -n 64" "--n-cpu-moe 12"
          oss_ab "$F" "-p 512 -n 64" "-ot exps=CPU" ;;
    # where gpt-oss-20b's captured decode step spends its time: the kernels of 8 replays, all on the GPU and with
    # experts in RAM; the MXFP4 decode GEMV's tiles (30B expert shape)
    s35d) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 150 python3 benchmarks/profile_step.py "$F" 2>&1 | tail -50
          timeout 100 python3 benchmarks/profile_step.py "$F" -ot exps=CPU --rows 12 2>&1 | tail -32
          timeout 100 python3 benchmarks/bench_moe_decode.py --tiles MXFP4,Q4_0 2>&1 | tail -6 ;;
    # MXFP4's decode GEMV on aligned words (gpu_qdot.qdot_mxfp4): the tests, its tiles at gpt-oss-20b's expert shape,
    # the captured step's kernels, then gpt-oss-20b before (.carry/base_src: byte loads) / after
    s35e) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_qdot.py \
            -k "gpt_oss or mxfp4" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          timeout 100 python3 benchmarks/bench_moe_decode.py --tiles MXFP4 2>&1 | tail -4
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 150 python3 benchmarks/profile_step.py "$F" --rows 14 2>&1 | grep -E "ms a decode step|Self CUDA|^ *_moe|nvjet|elementwise" | head -16
          oss_ab "$F" "-p 0 -n 128" gpu
          oss_ab "$F" "-p 0 -n 64" "--n-cpu-moe 12" ;;
    # gpt-oss's step with its shared tables and MXFP4's tile rule: the tests, the step's kernels, before
    # (.carry/base_src: the parent's src) / after in three placements
    s35f) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_qdot.py \
            -k "gpt_oss or mxfp4" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 150 python3 benchmarks/profile_step.py "$F" --rows 10 2>&1 | grep -E "ms a decode step|Self CUDA time|cudaGraphLaunch|^ *_moe" | head -8
          oss_ab "$F" "-p 0 -n 128" gpu
          oss_ab "$F" "-p 0 -n 64" "--n-cpu-moe 12" "-ot exps=CPU" ;;
    # gpt-oss's prompts on the grouped GEMMs from MXFP4's bytes with the biases in their epilogues: the tests, then
    # pp512 in three placements, before (.carry/base_src: dequantize + grouped_mm) / after
    s35g) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_qdot.py \
            -k "gpt_oss or mxfp4 or MXFP4" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          oss_ab "$F" "-p 512 -n 0" gpu "--n-cpu-moe 12" "-ot exps=CPU" ;;
    # gpt-oss's polled hand-off and decode share with host experts: the tests, then gpt-oss-20b's decode before
    # (.carry/base_src: the synchronous hand-off) / after, and the share's count swept with experts in RAM
    s36a) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpt_oss.py tests/test_cpu_kernels.py \
            tests/test_placement_runtime.py -k "gpt_oss or mxfp4 or handoff or share" -p no:cacheprovider --tb=short \
            -rfE 2>&1 | tail -8
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          oss_ab "$F" "-p 0 -n 128" "-ot exps=CPU" "--n-cpu-moe 12"
          for v in auto 0 1 2 3; do
            echo "### gpt-oss-20b -ot exps=CPU, decode share $v"
            ( [ "$v" = auto ] || export HYBRIDMOE_DECODE_SHARE=$v
              bench_rows -m "$F" -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3 --roofline )
          done ;;
    # gpt-oss's attention in gpu_attention's kernels (sinks, window rings, RoPE fused): the tests, then gpt-oss-20b's
    # decode with its torch attention (HYBRIDMOE_OAI_ATTN=torch) / the kernels, alternated, and the step's kernels
    s36b) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_decode.py \
            -k "gpt_oss or mxfp4 or attention" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          for pl in gpu "--n-cpu-moe 12" "-ot exps=CPU"; do for r in 1 2; do for a in torch triton; do
            echo "### gpt-oss-20b ${pl/#gpu/all on GPU}, attention $a, round $r"
            flags=$pl; [ "$pl" = gpu ] && flags=
            # shellcheck disable=SC2086
            HYBRIDMOE_OAI_ATTN=$a bench_rows -m "$F" -ngl 99 $flags -p 0 -n 128 -r 2
          done; done; done
          timeout 150 python3 benchmarks/profile_step.py "$F" --rows 10 2>&1 | grep -E "ms a decode step|Self CUDA time|cudaGraphLaunch|^ *_(moe|attn)" | head -8 ;;
    # the gpt-oss tests after the window fix, then calibrate and plan --check on gpt-oss-20b with experts in RAM and
    # at --n-cpu-moe 12 (the planner's decode prediction for its captured step against bench)
    s36c) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_decode.py \
            -k "gpt_oss or mxfp4 or attention" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 200 python3 -m hybridmoe.cli calibrate 2>&1 | tail -3
          for pl in "-ot exps=CPU" "--n-cpu-moe 12" gpu; do
            flags=$pl; [ "$pl" = gpu ] && flags=
            # shellcheck disable=SC2086
            timeout 150 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 $flags --check -p 512 -n 128 -r 2 2>&1 | tail -22
          done ;;
    # calibrate with gpt-oss's own decode floors (oai_decode_layer_s), then plan --check on gpt-oss-20b as in s36c
    s36d) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 240 python3 -m hybridmoe.cli calibrate 2>&1 | tail -3
          for pl in gpu "--n-cpu-moe 12" "-ot exps=CPU"; do
            flags=$pl; [ "$pl" = gpu ] && flags=
            # shellcheck disable=SC2086
            timeout 150 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 $flags --check -p 512 -n 128 -r 2 2>&1 | tail -22
          done ;;
    # gpt-oss's captured prompt step and batched GPU step (its block in gpu_prefill / gpu_batch): the tests, then
    # gpt-oss-20b's prompts all on the GPU before (.carry/base_src: the eager decoder) / after
    s37a) HYBRIDMOE_CACHE=/tmp/hm-test timeout 300 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_batch.py \
            tests/test_gpu_decode.py -k "gpt_oss or mxfp4 or attention or batch or prefill" -p no:cacheprovider \
            --tb=short -rfE 2>&1 | tail -8
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          oss_ab "$F" "-p 512 -n 0" gpu
          oss_ab "$F" "-p 2048 -ub 2048 -n 0" gpu ;;
    # a server's batches of gpt-oss-20b (benchmarks/batch_decode.py) before (eager batches) / after (the batch step)
    s37b) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          ab 1 "gpt-oss-20b batches, all on GPU, " timeout 200 python3 -u benchmarks/batch_decode.py -m "$F" -ngl 99 \
            --batch 1,4,16 --steps 16 --repeat 2
          ab 1 "gpt-oss-20b batches, -ot exps=CPU, " timeout 200 python3 -u benchmarks/batch_decode.py -m "$F" -ngl 99 \
            -ot exps=CPU --batch 1,4,8 --steps 16 --repeat 2 ;;
    # gpt-oss's batches by each MoE kernel path: the kernels alone at gpt-oss-20b's shape, then batch_decode.py
    # with HYBRIDMOE_GPU_MOE forcing each path (for runtime/experts.oai_moe_path's thresholds)
    s37c) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_gpu_moe_grouped.py \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -4
          timeout 200 python3 -u benchmarks/bench_moe_decode.py --oai MXFP4 2>&1 | tail -9
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          for path in pair grouped gemm; do
            echo "### gpt-oss-20b batches, all on GPU, HYBRIDMOE_GPU_MOE=$path"
            HYBRIDMOE_GPU_MOE=$path timeout 150 python3 -u benchmarks/batch_decode.py -m "$F" -ngl 99 \
              --batch 2,4,8,16,32 --steps 16 --repeat 2 2>&1 | tail -6
          done ;;
    # s37b after oai_moe_path's thresholds (the grouped GEMMs above 32 pairs), with the gpt-oss and batch tests
    s37d) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpt_oss.py tests/test_gpu_batch.py \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          bash benchmarks/gpu_check.sh s37b 2>&1 | grep -E "^###|^ +[0-9]+ |alone" ;;
    # plan --check on gpt-oss-20b all on the GPU, its prompts now the captured prompt step ("graph")
    s37e) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 200 python3 -m hybridmoe.cli calibrate 2>&1 | tail -3
          timeout 150 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 --check -p 512 -n 128 -r 2 2>&1 | tail -22
          timeout 150 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 -ub 2048 --check -p 2048 -n 0 -r 2 2>&1 | tail -22 ;;
    # the decode share for gpt-oss's batches with experts in RAM: the tests, then batch_decode.py with the share
    # off (HYBRIDMOE_DECODE_SHARE=0) and at the planner's count
    s37f) HYBRIDMOE_CACHE=/tmp/hm-test timeout 150 python3 -m pytest -q tests/test_gpt_oss.py -k "gpu_batch_step" \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -6
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          for v in 0 auto; do
            echo "### gpt-oss-20b batches, -ot exps=CPU, decode share $v"
            ( [ "$v" = auto ] || export HYBRIDMOE_DECODE_SHARE=$v
              timeout 150 python3 -u benchmarks/batch_decode.py -m "$F" -ngl 99 -ot exps=CPU --batch 1,4,8 \
                --steps 16 --repeat 2 2>&1 | grep -E "^ +[0-9]+ |alone" )
          done ;;
    # MXFP4's values from their bits and IQ4_NL's table in 32-bit words (kernels/gpu_qdot.py _mx, _nl): the tests,
    # then the decode GEMVs' tiles before (.carry/base_src) / after, gpt-oss's MoE layer by path, gpt-oss-20b end to end
    s38a) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q tests/test_gpu_qdot.py tests/test_gpu_moe_grouped.py \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -4
          ab 1 "decode GEMV tiles, " timeout 120 python3 benchmarks/bench_moe_decode.py --tiles MXFP4,IQ4_XS,IQ4_KS
          ab 1 "gpt-oss layer by path, " timeout 150 python3 -u benchmarks/bench_moe_decode.py --oai MXFP4
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          oss_ab "$F" "-p 512 -n 128" gpu "--n-cpu-moe 12" ;;
    # s37e with gpt-oss's own prompt costs calibrated (oai_prompt_layer_s, oai_moe_flops, ...: calibrate's gpt-oss
    # models now hold gpt-oss-20b's 32 experts)
    s38b) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          ( time timeout 330 python3 -m hybridmoe.cli calibrate ) 2>&1 | tail -6
          python3 - <<'PY'
import json, glob
def walk(d, path=""):
    for k, v in d.items():
        if isinstance(v, dict):
            walk(v, f"{path}/{k}")
        elif path.endswith("CUDA0") and ("prompt" in k or "flops" in k):
            print(f"{path}/{k} = {v:.4g}")
for f in glob.glob("/tmp/hybridmoe-cache/calibration-*.json"):
    walk(json.load(open(f)))
PY
          timeout 150 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 --check -p 512 -n 128 -r 2 2>&1 | tail -22
          timeout 150 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 -ub 2048 --check -p 2048 -n 16 -r 2 2>&1 | tail -8 ;;
    # calibrate's GPU prompt fits before (.carry/base_src) and after, with what they measured
    s38c) for v in base src; do
            echo "### calibrate, $v"
            rm -f /tmp/hybridmoe-cache/calibration-*.json
            ( [ $v = base ] && export PYTHONPATH=$PWD/.carry/base_src:/tmp/hm-site
              timeout 200 python3 -m hybridmoe.cli calibrate 2>&1 | grep -E "CUDA0 costs" )
            python3 - <<'PY'
import json, glob
for f in glob.glob("/tmp/hybridmoe-cache/calibration-*.json"):
    c = json.load(open(f))["by_threads"]["16"]["costs"]
    for k, v in c["_calibration"]["measured"].items():
        if "prompt" in k and "offload" not in k:
            print(k, ["%.4g" % x for x in v])
PY
          done ;;
    # gpt-oss-20b all on the CPU's 16 cores beside ik_llama.cpp (-rtr 0 / 1), then with experts in RAM against
    # its roofline
    s38d) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          PP=512 TG=64 ROUNDS=1 bash benchmarks/ik_peer.sh run "$F"
          timeout 200 python3 -m hybridmoe.cli bench -m "$F" -ngl 99 -ot exps=CPU -p 512 -n 128 -r 2 --roofline 2>&1 \
            | grep -E "^\| |roofline" ;;
    # scaled RoPE (YaRN, linear) on a real GPU against all-CPU; gpt-oss-20b's batches all on the GPU before / after
    # MXFP4's values from their bits
    s38e) HYBRIDMOE_CACHE=/tmp/hm-test timeout 200 python3 -m pytest -q tests/test_model.py -k "scaled_rope" \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -4
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          ab 1 "gpt-oss-20b batches, all on GPU, " timeout 200 python3 -u benchmarks/batch_decode.py -m "$F" -ngl 99 \
            --batch 1,4,8,16,32 --steps 16 --repeat 2 ;;
    # plan --check on gpt-oss-20b's hybrid placements with its own calibrated costs
    s38f) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 200 python3 -m hybridmoe.cli calibrate 2>&1 | grep -E "oai_prompt|cached"
          for PL in "-ot exps=CPU" "--n-cpu-moe 12"; do
            echo "### plan --check -ngl 99 $PL"
            # shellcheck disable=SC2086
            timeout 150 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 $PL --check -p 512 -n 64 -r 2 2>&1 \
              | grep -E "^\| (pp|tg)|predicted .* ms, measured" 
          done ;;
    # s38f's -ot exps=CPU row after gpt-oss's eager prompt costs (oai_eager_*) are calibrated too
    s38g) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 150 python3 -m hybridmoe.cli calibrate 2>&1 | grep -oE "oai_eager[a-z_]* [0-9.]+ [a-zA-Z/]+" | tr '\n' ' '
          echo; timeout 90 python3 -m hybridmoe.cli plan -m "$F" -ngl 99 -ot exps=CPU --check -p 512 -n 16 -r 1 2>&1 \
            | grep -E "^\| (pp|tg)|predicted .* ms, measured" ;;
    # gpt-oss's host experts uploaded a layer ahead (Scheduler._moe_uploaded): -ot exps=CPU and --n-cpu-moe 12 before
    # (.carry/base_src: 457fd70, no prefetch) / after, the roofline of the first, then s38f's plan --check
    s39a) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          oss_ab "$F" "-p 512 -n 128" "-ot exps=CPU" "--n-cpu-moe 12"
          timeout 120 python3 -m hybridmoe.cli bench -m "$F" -ngl 99 -ot exps=CPU -p 512 -n 0 -r 2 --roofline 2>&1 \
            | grep -E "^\| |roofline"
          bash "$0" s38f ;;
    # where gpt-oss's -ot exps=CPU prompt goes: benchmarks/upload_timeline.py before (.carry/base_src) / after
    s39b) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          ab 1 "gpt-oss-20b -ot exps=CPU pp512 timeline, " timeout 200 python3 benchmarks/upload_timeline.py "$F" \
            -ot exps=CPU -p 512 --trace "${OUT:-/tmp}/trace-s39b.json" ;;
    # s39b's bench rows rep by rep, the timeline after the embeddings go to the GPU before the first upload
    s39c) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 150 python3 -m hybridmoe.cli bench -m "$F" -ngl 99 -ot exps=CPU -p 512 -n 0 -r 5 -o jsonl 2>&1 \
            | python3 -c "import json,sys; [print(r['test'], ' '.join('%.0f' % t for t in r['samples_ts'])) for r in map(json.loads, (l for l in sys.stdin if l.startswith('{')))]"
          timeout 200 python3 benchmarks/upload_timeline.py "$F" -ot exps=CPU -p 512 -r 6 ;;
    # the timeline loaded as the script does and as bench does (bench measured 10% slower in s39c)
    s39d) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          for LB in "" --like-bench "" --like-bench; do
            echo "### upload_timeline $LB"
            timeout 150 python3 benchmarks/upload_timeline.py "$F" -ot exps=CPU -p 512 -r 6 $LB 2>&1 \
              | grep -E "median|wall|HtoD|overlap|cudaMemcpyAsync"
          done ;;
    # which of s39d's repetitions run ~30 ms slower, and what the host did while the GPU waited
    s39e) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          timeout 200 python3 benchmarks/upload_timeline.py "$F" -ot exps=CPU -p 512 -r 4 --profiled 8 --like-bench 2>&1 \
            | grep -v -E "Warn|warn_once" ;;
    # prompt embeddings dequantized on the first layer's GPU, all_finite on one thread: the placement tests on the
    # GPU, then gpt-oss-20b's pp512 / tg128 before (.carry/base_src: fb08433) / after, all on the GPU and -ot exps=CPU
    s39f) HYBRIDMOE_CACHE=/tmp/hm-test timeout 240 python3 -m pytest -q -m gpu tests/test_placement_runtime.py \
            -p no:cacheprovider --tb=short -rfE 2>&1 | tail -4
          F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          REPS=5 oss_ab "$F" "-p 512 -n 128" gpu "-ot exps=CPU" ;;
    # s39f's all-GPU rows again after the one-thread all_finite was taken out: before (.carry/base_src: fb08433) / after,
    # two rounds
    s39g) F=$(python3 -m hybridmoe.cli synth gpt-oss-20b 2>&1 | tail -1); echo "$F"
          ab 2 "gpt-oss-20b all on GPU, " bench_rows -m "$F" -ngl 99 -p 512 -n 128 -r 3 ;;
    hoststep) timeout 400 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --batch 16 --steps 32 \
                --cprofile 30 2>&1 | tail -45
              timeout 200 python3 -u benchmarks/batch_decode.py -m synth:qwen3-30b-a3b -ngl 99 --batch 16 --steps 16 \
                --kprofile 6 2>&1 | tail -12 ;;
    grouped16) timeout 400 python3 -u benchmarks/bench_moe_decode.py --grouped-tiles-16 Q4_0 2>&1 | tail -6 ;;
    # IQ2_KT experts in RAM with the decode share counting its CPU kernel's own rate, then the per-type CPU kernels
    iq2kt) python3 -m hybridmoe.cli synth qwen3-30b-a3b-iq2_kt 2>&1 | tail -1
           timeout 200 python3 -m hybridmoe.cli bench -m synth:qwen3-30b-a3b-iq2_kt -ngl 99 -ot exps=CPU -p 512 -n 128 -r 2 \
             --roofline 2>&1 | tail -8
           timeout 240 python3 benchmarks/bench_types.py --types issue24 --threads 16 --repeat 2 --batches 1,8 2>&1 | tail -30 ;;
    # issue 24 point 2: the fused kernels on IQ4_XS, IQ4_KS and Q3_K experts (kernels/gpu_qdot.py: decode GEMVs for
    # all three, prompt GEMMs for the IQ4s) against the reference, then the decode tiles at the 30B expert shape
    # next to Q4_0 / Q4_K (for gpu_decode._MOE_TILE_RULE)
    gputypes) HYBRIDMOE_CACHE=/tmp/hm-test timeout 400 python3 -m pytest -q tests/test_gpu_qdot.py tests/test_gpu_decode.py \
                -p no:cacheprovider --tb=short -rfE 2>&1 | tail -15
              timeout 150 python3 benchmarks/bench_moe_decode.py --tiles Q4_0,Q4_K,IQ4_XS,IQ4_KS,Q3_K \
                2>&1 | tail -12 ;;
    # the batched GPU decode step (its tests: decode_batch, the polled hand-off with host experts), the IQ2_KT
    # decode kernel's tests and tiles, then the server with experts in RAM at 1, 4 and 8 clients (issue 27)
    batchcheck) HYBRIDMOE_CACHE=/tmp/hm-test timeout 150 python3 -m pytest -q tests/test_gpu_batch.py tests/test_gpu_qdot.py \
                  -k "batch or host or IQ2_KT or iq2_kt" -p no:cacheprovider --tb=short -rfE 2>&1 | tail -8
                timeout 60 python3 benchmarks/bench_moe_decode.py --tiles Q4_0,IQ2_KT 2>&1 | tail -5
                timeout 200 python3 benchmarks/serve_load.py --concurrency 1,4,8 --rounds 1 -- -m synth:qwen3-30b-a3b \
                  -ngl 99 -ot exps=CPU -np 8 2>&1 | tail -25 ;;
    # then the 30B shape end to end, all on the GPU and with experts in RAM (the decode share reads them too);
    # MIXES picks the presets (each ~16 GB, deleted after its rows; ~4 min each)
    typesbench) for P in ${MIXES:-qwen3-30b-a3b-iq4_ks qwen3-30b-a3b}; do
                  ( time hm synth $P ) 2>&1 | grep -E "real|wrote|exists" | tr '\n' ' '; echo
                  for PL in "" "-ot exps=CPU"; do for V in 0 1; do       # dequantized first / the fused kernels
                    echo "### synth:$P -ngl 99 $PL, HYBRIDMOE_GPU_QDOT=$V"
                    HYBRIDMOE_GPU_QDOT=$V timeout 240 python3 -m hybridmoe.cli bench -m synth:$P -ngl 99 $PL -p 512 \
                      -n 128 -r 2 --roofline 2>&1 | grep -E "pp512|tg128|Error|error"
                  done; done
                  [ $P = qwen3-30b-a3b ] || find "$HYBRIDMOE_CACHE" -name "synth-$P-v*.gguf" -delete
                done ;;
  esac
done
