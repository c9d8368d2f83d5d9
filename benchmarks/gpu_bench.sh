#!/usr/bin/env bash
# GPU machine benchmark batch for docs/benchmarks.md. Usage: bash benchmarks/gpu_bench.sh SECTION...
source benchmarks/device_setup.sh
set +e
M=synth:qwen3-30b-a3b
B() { echo "### hybridmoe bench $*"; hm bench -m $M "$@" 2>&1 | grep -v "^\s*$"; }
for s in "$@"; do
  echo "=============== $s"
  case $s in
    tests) HYBRIDMOE_CACHE=/tmp/hm-test python3 -m pytest -q -m gpu tests/ -p no:cacheprovider --tb=line 2>&1 | tail -8
           HYBRIDMOE_CACHE=/tmp/hm-test python3 -m pytest -q tests/test_gpu_decode.py tests/test_placement_runtime.py \
               -p no:cacheprovider --tb=short 2>&1 | tail -30 ;;
    moetests) python3 -m pytest -q tests/test_gpu_decode.py tests/test_gpu_kernels.py -k "prefill_moe or expert_paths" \
                  -p no:cacheprovider --tb=short 2>&1 | tail -15 ;;
    prefill) python3 benchmarks/bench_moe_prefill.py Q4_0 128,512,2048,4096 2>&1 | tail -16
             python3 benchmarks/bench_moe_prefill.py Q8_0 512 2>&1 | tail -8 ;;
    jitter) python3 benchmarks/pp_jitter.py 12 2>&1 | tail -14
            hm bench -m $M -ngl 99 -p 512 -n 0 -r 8 -o jsonl 2>/dev/null | python3 -c "import json,sys; [print(r['test'], [round(x) for x in r['samples_ts']]) for r in map(json.loads, sys.stdin)]" ;;
    alloc) python3 -m pytest -q tests/test_placement_runtime.py -k arena -p no:cacheprovider --tb=short 2>&1 | tail -3
           python3 benchmarks/bench_kernels.py --types Q4_0 --batches 1,8d --layers 8 --alloc torch,file,pinned,4k,huge,huge-pinned 2>&1 | tail -22
           for A in 0 1; do echo "### HYBRIDMOE_HOST_ARENA=$A"; HYBRIDMOE_HOST_ARENA=$A B -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3 --roofline; done ;;
    tgvar) B -ngl 99 -ot exps=CPU -p 0 -n 64 -r 3 -t 8,12,16
           for V in OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=infinite OMP_PROC_BIND=close; do echo "### $V"
             env $V python3 -m hybridmoe.cli bench -m $M -ngl 99 -ot exps=CPU -p 0 -n 64 -r 3 2>&1 | grep tg64; done ;;
    ramshare) python3 benchmarks/ram_share.py 2>&1 | grep -v -i warn ;;
    sharetests) python3 -m pytest -q tests/test_gpu_decode.py tests/test_placement_runtime.py tests/test_cpu_kernels.py \
                  -k "stage_experts or handoff or decode_share" -p no:cacheprovider --tb=short 2>&1 | tail -30 ;;
    shareab) for V in ${SHARES:-0 2 3 0 2 3}; do echo "### HYBRIDMOE_DECODE_SHARE=$V"
               for P in "-ot exps=CPU" "--n-cpu-moe 24"; do
                 HYBRIDMOE_DECODE_SHARE=$V python3 -m hybridmoe.cli bench -m $M -ngl 99 $P -p 0 -n 128 -r 3 --roofline 2>&1 | grep -E "tg128"
               done; done ;;
    share24) for V in 0 2 0 2; do echo "### HYBRIDMOE_DECODE_SHARE=$V"
               HYBRIDMOE_DECODE_SHARE=$V python3 benchmarks/profile_decode.py handoff24 2>&1 | grep -v "^\s*$"; done ;;
    shareq4k) hm synth qwen3-30b-a3b-q4_k 2>&1 | tail -1
              for V in 0 auto 0 auto; do echo "### synth:qwen3-30b-a3b-q4_k, HYBRIDMOE_DECODE_SHARE=$V"
                if [ $V = auto ]; then U="-u HYBRIDMOE_DECODE_SHARE"; else U="HYBRIDMOE_DECODE_SHARE=$V"; fi
                env $U python3 -m hybridmoe.cli bench -m synth:qwen3-30b-a3b-q4_k -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3 \
                  --roofline 2>&1 | grep -E "tg128"; done ;;
    kalone) python3 benchmarks/profile_decode.py kalone 2>&1 ;;
    handoff) python3 benchmarks/profile_decode.py handoff 2>&1 ;;
    handoff24) python3 benchmarks/profile_decode.py handoff24 2>&1 ;;
    chunks) for F in "" "-DS2_CHUNK=64" "-DS2_CHUNK=128" "-DS1_CHUNK=64 -DS2_CHUNK=64" "" "-DS2_CHUNK=64" "-DS2_CHUNK=128" "-DS1_CHUNK=64 -DS2_CHUNK=64"; do
              echo "### HYBRIDMOE_KERNEL_CFLAGS='$F'"
              HYBRIDMOE_KERNEL_CFLAGS="$F" python3 benchmarks/bench_kernels.py --types Q4_0 --batches 1,8d --layers 8 2>&1 | tail -3; done ;;
    segkernels) python3 benchmarks/profile_decode.py segkernels 2>&1 | cut -c1-180 ;;
    flaky) for i in 1 2 3; do python3 -m pytest -q tests/test_placement_runtime.py -k "polled_handoff" -p no:cacheprovider --tb=line 2>&1 | tail -3; done
           CUDA_LAUNCH_BLOCKING=1 python3 -m pytest -q -x tests/test_placement_runtime.py -p no:cacheprovider --tb=short 2>&1 | tail -40 ;;
    htests) timeout 400 python3 -m pytest -q tests/test_gpu_decode.py tests/test_placement_runtime.py tests/test_cpu_kernels.py \
                -k "handoff or real_gpu or cuda_graph or gemv8 or split_row or router or static" -p no:cacheprovider --tb=short 2>&1 | tail -15 ;;
    dense) python3 benchmarks/bench_moe_decode.py --dense Q8_0 2>&1 | tail -8 ;;
    gemvab) for V in 0 1 0 1; do echo "### HYBRIDMOE_GEMV8=$V"
              HYBRIDMOE_GEMV8=$V python3 -m hybridmoe.cli bench -m $M -ngl 99 -p 0 -n 128 -r 3 2>&1 | grep -E "tg128"
              HYBRIDMOE_GEMV8=$V python3 -m hybridmoe.cli bench -m $M -ngl 99 --n-cpu-moe 24 -p 0 -n 128 -r 3 --roofline 2>&1 | grep -E "tg128"; done ;;
    handoffab) for V in sync poll sync poll; do echo "### HYBRIDMOE_HANDOFF=$V"
                 HYBRIDMOE_HANDOFF=$V python3 -m hybridmoe.cli bench -m $M -ngl 99 -ot exps=CPU -p 0 -n 128 -r 3 --roofline 2>&1 | grep -E "tg128"
                 HYBRIDMOE_HANDOFF=$V python3 -m hybridmoe.cli bench -m $M -ngl 99 --n-cpu-moe 24 -p 0 -n 128 -r 3 --roofline 2>&1 | grep -E "tg128"; done ;;
    firstcall) for V in cold warm HYBRIDMOE_MOE_TUNE=1; do echo "### hybridmoe run -ngl 99 -ot exps=CPU, 1200-token prompt, -n 16 ($V)"
                 env ${V/#[cw]*/X=1} python3 -m hybridmoe.cli run -m $M -ngl 99 -ot exps=CPU -n 16 -p "$(printf 'word %.0s' {1..1200})" --temp 0 2>&1 | grep -E "loaded|time ="; done ;;
    tiles) python3 benchmarks/bench_moe_prefill.py --tiles Q4_0,Q8_0 64,128,512,2048,4096 2>&1 | tail -24 ;;
    stiles) python3 benchmarks/bench_moe_prefill.py --tiles-split Q4_0,Q8_0 128,512,4096 2>&1 | tail -14 ;;
    dtiles) python3 benchmarks/bench_moe_decode.py --tiles Q4_0,Q8_0,Q4_K,Q5_K,Q6_K 2>&1 | tail -14 ;;
    dsplit) python3 -m pytest -q tests/test_gpu_decode.py -k "split_rows or moe_from_bytes" -p no:cacheprovider --tb=short 2>&1 | tail -5
            python3 benchmarks/bench_moe_decode.py --split Q4_0,Q8_0 2>&1 | tail -14 ;;
    splitab) for V in 0 1 0 1; do echo "### HYBRIDMOE_SPLIT_ROWS=$V"
               HYBRIDMOE_SPLIT_ROWS=$V python3 -m hybridmoe.cli bench -m $M -ngl 99 -p 512 -n 128 -r 3 2>&1 | grep -E "pp512|tg128"; done ;;
    pyprof) python3 benchmarks/profile_decode.py pyprof 2>&1 | grep -v "^\s*$" | cut -c1-160 ;;
    gputune) for V in X=1 HYBRIDMOE_MOE_TUNE=1 X=2; do echo "### $V"
               env $V python3 -m hybridmoe.cli bench -m $M -ngl 99 -p 0 -n 128 -r 5 2>&1 | grep tg128; done ;;
    prof512) python3 benchmarks/profile_decode.py pp512 2>&1 ;;
    kbench) python3 benchmarks/bench_kernels.py --types Q4_0,Q8_0,Q4_K --batches 1,8d,512 --layers 8 2>&1 | tail -14 ;;
    kernels) python3 -m pytest -q tests/test_cpu_kernels.py -p no:cacheprovider --tb=short 2>&1 | tail -5
             python3 benchmarks/bench_kernels.py --types Q4_0,Q8_0,Q4_K --batches 1,32,128,512 --layers 8 --crossover 2>&1 | tail -18 ;;
    prep) hm calibrate 2>&1 | tail -8; ( time hm synth qwen3-30b-a3b ) 2>&1 | tail -4 ;;
    hybrid) B -ngl 99 -ot exps=CPU -p 512 -n 128 -r 3 --roofline ;;
    pcache) python3 benchmarks/prompt_cache.py --turns 4 --first 4000 --msg 200 -n 32 -- "-ngl 99 -ot exps=CPU" "-ngl 99" 2>&1 | grep -v -i warn ;;
    shapes) python3 benchmarks/shape_costs.py -- "-ngl 99 -ot exps=CPU" "-ngl 99" 2>&1 | grep -v -i warn ;;
    ptests) python3 -m pytest -q tests/test_placement_runtime.py -k "captured or prompt_cache or prompt_graphs or real_gpu" \
                -p no:cacheprovider --tb=short 2>&1 | tail -4 ;;
    cnv) for P in "-ngl 99 -ot exps=CPU" "-ngl 99"; do echo "### hybridmoe run $P -cnv: a 2000-word message, then two short ones"
           { printf 'word %.0s' {1..2000}; printf '\nTell me more.\nAnd then?\n'; } | hm run -m $M $P -cnv --temp 0 -n 32 -c 4096 2>&1 \
             | grep -E "warmed|^\[prompt"; done ;;
    q6k) python3 -m pytest -q tests/test_cpu_kernels.py -p no:cacheprovider --tb=short 2>&1 | tail -2
         for A in "" "--int8 Q4_0,Q4_K,Q5_K,Q6_K" "" "--int8 Q4_0,Q4_K,Q5_K,Q6_K"; do echo "### $A"
           python3 benchmarks/bench_kernels.py --types Q6_K --batches 1,8d --layers 8 $A 2>&1 | grep -E "\| Q6_K"; done ;;
    stests) python3 -m pytest -q tests/test_constrain.py tests/test_server.py tests/test_bench.py -p no:cacheprovider \
              --tb=short 2>&1 | tail -5 ;;
    ctests) python3 -m pytest -q tests/test_cpu_kernels.py tests/test_model.py tests/test_server.py -p no:cacheprovider --tb=short 2>&1 | tail -5 ;;
    gpu) B -ngl 99 -p 512 -n 128 -r 3 --roofline ;;
    ncmoe) B -ngl 99 --n-cpu-moe 24 -p 512 -n 128 -r 3 --roofline ;;
    pp4096) B -ngl 99 -ot exps=CPU -p 4096 -n 0 -ub 4096 -b 4096 -r 2 -ooae auto,0 --roofline ;;
    policy) B -ngl 99 -ot exps=CPU -p 512 -n 0 -ub 32,128,512 -b 512 -r 3 -op 'auto;all,0;all,1' --interleave;
            B -ngl 99 -ot exps=CPU -p 2048 -n 0 -ub 2048 -b 2048 -r 3 -op 'auto;all,0;all,1' --interleave ;;
    policy_rev) B -ngl 99 -ot exps=CPU -p 512 -n 0 -ub 32,128,512 -b 512 -r 3 -op 'all,1;all,0;auto' --interleave ;;
    decode) python3 benchmarks/profile_decode.py gpu hybrid 2>&1 ;;
    prof4096) hm run -m $M -ngl 99 -ot exps=CPU -n 2 -c 4200 -ub 4096 -b 4096 -p "$(printf 'word %.0s' {1..2040})" --temp 0 --profile 2>&1 | tail -14 ;;
    x2) nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
        hm plan -m $M -ngl 99 -ts 1,1 --n-cpu-moe 24 2>&1 | tail -4
        B -ngl 99 -ts 1/1 -p 512 -n 128 -r 3 --roofline
        B -ngl 99 -ts 1/1 --n-cpu-moe 24 -p 512 -n 128 -r 3 --roofline
        B -ngl 99 -ts 1/1 -ot exps=CPU -p 512 -n 128 -r 3 --roofline ;;
    profpol) for OP in auto all,0 all,1; do echo "### hybridmoe run -ngl 99 -ot exps=CPU -op $OP --profile (pp ~1100 tokens at -ub 512, tg 16)"
               hm run -m $M -ngl 99 -ot exps=CPU -op $OP -ub 512 -n 16 -p "$(seq -s ' ' 1 400)" --temp 0 --profile 2>&1 | tail -13; done ;;
    q4k) hm synth qwen3-30b-a3b-q4_k 2>&1 | tail -1
         hm bench -m synth:qwen3-30b-a3b-q4_k -ngl 99 -p 512 -n 128 -r 3 --roofline 2>&1 | grep -v "^\s*$"
         hm bench -m synth:qwen3-30b-a3b-q4_k -ngl 99 -ot exps=CPU -p 512 -n 128 -r 3 --roofline 2>&1 | grep -v "^\s*$" ;;
    split) B -ngl 99 -p 0 -n 64 -r 3 -ot 'ffn_(up|down)_exps=CPU;exps=CPU' ;;
    # issue 24: the expert types of users' files on the 30B shape (models/mixes.py) next to Q4_0 experts, experts
    # in RAM, 24 layers' in RAM, all on the GPU; each mix model is deleted after its rows (~16 GB each, 64 GB disk).
    # MIXES= picks the presets (default: all six), PLACEMENTS= the placements ('|'-separated, default all three).
    mixes) for P in ${MIXES:-qwen3-30b-a3b qwen3-30b-a3b-iq4_ks qwen3-30b-a3b-q3_k_mix qwen3-30b-a3b-iq2_kt qwen3-30b-a3b-iq4_xs \
                      qwen3-30b-a3b-q2_k_mix}; do
             ( time hm synth $P ) 2>&1 | grep -E "real|wrote|exists" | tr '\n' ' '; echo
             IFS='|' read -ra PLS <<< "${PLACEMENTS:--ot exps=CPU|--n-cpu-moe 24|gpu}"   # '|'-separated; gpu: all on it
             for PL in "${PLS[@]}"; do
               [ "$PL" = gpu ] && PL=""
               echo "### synth:$P -ngl 99 $PL"
               hm bench -m synth:$P -ngl 99 $PL -p 512 -n 128 -r 2 --roofline 2>&1 | grep -E "pp512|tg128"
             done
             [ $P = qwen3-30b-a3b ] || find "$HYBRIDMOE_CACHE" -name "synth-$P-v*.gguf" -delete
           done ;;
    cpu) B -ngl 0 -p 512 -n 64 -r 2 --roofline ;;
    cpuprof) for P in "word" "$(printf 'word %.0s' {1..600})"; do echo "### hybridmoe run -ngl 0 --profile, ${#P}-character prompt, -n 32"
               hm run -m $M -ngl 0 -n 32 -p "$P" --temp 0 --profile 2>&1 | tail -16; done ;;
    cputests) python3 -m pytest -q tests/test_cpu_decode.py tests/test_model.py -p no:cacheprovider --tb=short 2>&1 | tail -5 ;;
    cpustep) for G in --no-graphs "" --no-graphs ""; do echo "### hybridmoe run -ngl 0 $G, tg 48"
               hm run -m $M -ngl 0 -n 48 -p "word word" --temp 0 $G 2>&1 | grep "eval time" | tail -1; done
             B -ngl 0 -p 0 -n 64 -r 3 --roofline
             hm run -m $M -ngl 0 -n 32 -p "word" --temp 0 --profile 2>&1 | tail -10 ;;
    cpuonly) echo "### CUDA_VISIBLE_DEVICES= (no GPU)"
             CUDA_VISIBLE_DEVICES= python3 -m hybridmoe.cli bench -m $M -ngl 0 -p 512 -n 64 -r 2 --roofline 2>&1 | grep -E "pp512|tg64"
             CUDA_VISIBLE_DEVICES= python3 -m hybridmoe.cli run -m $M -n 8 -p "$(printf 'word %.0s' {1..600})" --temp 0 --profile 2>&1 | tail -12 ;;
    cpuattn) python3 benchmarks/bench_attention_cpu.py 2>&1 | tail -6
             for A in fp32 bf16 fp32 bf16; do echo "### CUDA_VISIBLE_DEVICES= HYBRIDMOE_CPU_ATTN=$A"
               CUDA_VISIBLE_DEVICES= HYBRIDMOE_CPU_ATTN=$A python3 -m hybridmoe.cli bench -m $M -ngl 0 -p 512 -n 0 -r 2 -d 0,1536 --roofline 2>&1 | grep -E "pp512"; done ;;
    cpudepth) for V in old new old new; do
                P="$PWD/src"; [ $V = old ] && P="$PWD/bench_old/src"
                echo "### $V: CUDA_VISIBLE_DEVICES= -ngl 0 -p 0 -n 64 -d 0,1536"
                CUDA_VISIBLE_DEVICES= PYTHONPATH="$P:/tmp/hm-site" python3 -m hybridmoe.cli bench -m $M -ngl 0 -p 0 -n 64 -r 2 -d 0,1536 --roofline 2>&1 | grep tg64; done ;;
    ppgraph) for V in old new old new; do   # against bench_old/src (see oldnew)
               P="$PWD/src"; [ $V = old ] && P="$PWD/bench_old/src"; echo "### $V: -ngl 99 pp512"
               PYTHONPATH="$P:/tmp/hm-site" python3 -m hybridmoe.cli bench -m $M -ngl 99 -p 512 -n 0 -r 5 --roofline 2>&1 | grep pp512; done
             B -ngl 99 -p 4096 -n 0 -ub 4096 -b 4096 -r 2 --roofline | grep pp4096
             hm run -m $M -ngl 99 -n 4 -p "$(printf 'word %.0s' {1..1200})" --temp 0 --profile 2>&1 | tail -12 ;;
    requests) for V in old new; do   # three generations in one process, against bench_old/src (see oldnew)
                P="$PWD/src"; [ $V = old ] && P="$PWD/bench_old/src"; echo "### $V"
                PYTHONPATH="$P:/tmp/hm-site" python3 benchmarks/two_requests.py "-ngl 99" "-ngl 99 -ot exps=CPU" 2>&1 | grep request; done ;;
    handoffold) for V in old new old new; do   # the polled hand-off's per-layer profile against bench_old/src
                  P="$PWD/src"; [ $V = old ] && P="$PWD/bench_old/src"; echo "### $V"
                  PYTHONPATH="$P:/tmp/hm-site" python3 benchmarks/profile_decode.py handoff 2>&1 | tail -6; done ;;
    core) python3 benchmarks/bench_core.py --threads 1,4,16 2>&1 | tail -20 ;;
    int8tg) for V in 2 1 2 1; do                # Q4_0's activations in two int8 terms (its rule) against one
              for PL in "-ngl 99 -ot exps=CPU" "-ngl 99 --n-cpu-moe 24"; do
                echo "### HYBRIDMOE_CPU_ACT_TERMS=$V $PL"
                HYBRIDMOE_CPU_ACT_TERMS=$V hm bench -m $M $PL -p 0 -n 128 -r 3 --roofline 2>&1 | grep tg128; done; done ;;
    acterms) # the CPU integer path's activations: two int8 terms for every type against the per-type rule, 16 threads
             python3 benchmarks/bench_types.py --types ${TYPES:-Q4_0,Q2_K,Q3_K,IQ4_XS,IQ2_K,IQ3_K,IQ4_K,IQ4_KS,IQ2_KS,IQ2_KL} \
                 --threads 16 --repeat 2 --batches 1 --layers 4 --act-terms 2,0 2>&1 | grep -E "^kernel|^\| " ;;
    tileab) for V in old new old new; do   # the T=512 tile kernel against bench_old/src (see oldnew)
              P="$PWD/src"; [ $V = old ] && P="$PWD/bench_old/src"; echo "### $V"
              PYTHONPATH="$P:/tmp/hm-site" python3 benchmarks/bench_kernels.py --types Q4_0,Q8_0,Q4_K --batches 512 --layers 8 2>&1 | grep -E "^read|\| 512 \|"; done ;;
    cpupp) for V in old new old new; do    # prompt processing with no GPU, against bench_old/src
             P="$PWD/src"; [ $V = old ] && P="$PWD/bench_old/src"; echo "### $V: CUDA_VISIBLE_DEVICES= -ngl 0 pp512"
             CUDA_VISIBLE_DEVICES= PYTHONPATH="$P:/tmp/hm-site" python3 -m hybridmoe.cli bench -m $M -ngl 0 -p 512 -n 0 -r 2 --roofline 2>&1 | grep pp512; done ;;
    ngl0pp) B -ngl 0 -p 512 -n 0 -r 2 --roofline
            hm run -m $M -ngl 0 -n 4 -p "$(printf 'word %.0s' {1..600})" --temp 0 --profile 2>&1 | tail -14 ;;
    oldnew) # A/B against an older tree: bench_old/src (untracked: git archive OLD src | tar -x -C bench_old)
            for V in old new old new; do
              P="$PWD/src"; [ $V = old ] && P="$PWD/bench_old/src"
              for PL in "-ngl 99" "-ngl 99 --n-cpu-moe 24" "-ngl 99 -ot exps=CPU"; do
                [ -n "$OLDNEW" ] && ! [[ "$PL" =~ $OLDNEW ]] && continue   # OLDNEW: a regex of placements
                echo "### $V: $PL"
                PYTHONPATH="$P:/tmp/hm-site" python3 -m hybridmoe.cli bench -m $M $PL -p 0 -n 128 -r 3 --roofline 2>&1 | grep tg128
              done; done ;;
    profile) hm run -m $M -ngl 99 -ot exps=CPU -n 16 -p "$(printf 'word %.0s' {1..600})" --temp 0 --profile 2>&1 | tail -22 ;;
    sweep) for P in "-ngl 99" "-ngl 99 -ot exps=CPU" "-ngl 99 --n-cpu-moe 24"; do
             echo "### hybridmoe sweep-bench -m $M $P -c 4096 -ub 1024 -n 128"
             hm sweep-bench -m $M $P -c 4096 -ub 1024 -n 128 2>&1 | tail -7; done ;;
  esac
done
