#!/usr/bin/env bash
# Issues 30 and 29 on the GPU machine: calibrate (rates and the runtime's costs), then the planner's predictions
# against bench for issue 30's table, issue 29's two-GPU placements (where two GPUs are visible) and
# --suggest's top three (benchmarks/plan_check.py). About 6-8 minutes on one H100 in all; arguments go to
# plan_check.py (sections: one two suggest), e.g. `plan_check.sh one`, then `CALIBRATE=0 plan_check.sh suggest`.
source benchmarks/device_setup.sh
set +e
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$SECONDS
hm synth qwen3-30b-a3b >/dev/null
[ "${CALIBRATE:-1}" = 1 ] && hm calibrate          # CALIBRATE=0 on a warm machine calibrated before
echo "setup and calibrate: $((SECONDS - t0)) s"
python3 benchmarks/plan_check.py "$@"
echo "total: $((SECONDS - t0)) s"
