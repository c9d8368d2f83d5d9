#!/usr/bin/env bash
# Issues 30 and 29 on the GPU machine: calibrate (rates and the runtime's costs), then the planner's predictions
# against bench for issue 30's table, issue 29's two-GPU placements (where two GPUs are visible) and
# --suggest's top three (benchmarks/plan_check.py). About 6-8 minutes on one H100; arguments go to plan_check.py
# (sections: one two suggest).
source benchmarks/device_setup.sh
set +e
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$SECONDS
hm synth qwen3-30b-a3b >/dev/null
hm calibrate
echo "setup and calibrate: $((SECONDS - t0)) s"
python3 benchmarks/plan_check.py "$@"
echo "total: $((SECONDS - t0)) s"
