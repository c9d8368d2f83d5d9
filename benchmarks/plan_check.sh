#!/usr/bin/env bash
# Issues 30 and 29 on the GPU machine: calibrate (rates and the runtime's costs), then the planner's predictions
# against bench for issue 30's table, issue 29's two-GPU placements (where two GPUs are visible) and
# --suggest's top three (benchmarks/plan_check.py). About 6-8 minutes on one H100 in all; arguments go to
# plan_check.py (sections: one two suggest), e.g. `plan_check.sh one`, then `CALIBRATE=0 plan_check.sh suggest`.
# The ranking check alone, one call of about 5 minutes on one H100 (calibrate ~90 s, 8 placements ~20 s each):
#   bash benchmarks/plan_check.sh suggest --vram-gib 12,24 --objective tg,pp -r 3
source benchmarks/device_setup.sh
set +e
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
t0=$SECONDS
hm synth qwen3-30b-a3b >/dev/null
# CALIBRATE=0: the calibration of an earlier call (its $OUT/calibration.json, carried as .carry/calibration.json,
# same GPU model) instead of a new one
if [ "${CALIBRATE:-1}" = 0 ] && [ -f .carry/calibration.json ]; then
  cp .carry/calibration.json "$HYBRIDMOE_CACHE/calibration-$(hostname).json"
fi
[ "${CALIBRATE:-1}" = 1 ] && hm calibrate
[ -n "${OUT:-}" ] && cp "$HYBRIDMOE_CACHE/calibration-$(hostname).json" "$OUT/calibration.json" 2>/dev/null
echo "setup and calibrate: $((SECONDS - t0)) s"
python3 benchmarks/plan_check.py "$@"
echo "total: $((SECONDS - t0)) s"
