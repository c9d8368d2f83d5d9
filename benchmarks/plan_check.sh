#!/usr/bin/env bash
# Issues 30 and 29 on the GPU machine: calibrate (rates and the runtime's costs), then the planner's predictions
# against bench for issue 30's table, issue 29's two-GPU placements (where two GPUs are visible) and
# --suggest's top three (benchmarks/plan_check.py). Arguments go to plan_check.py (sections: one two suggest).
# On one H100: setup and calibrate ~2 min; section one (six placements, pp512 / pp4096 / tg128) ~4 min, the
# two -ngl 0 rows ~50 s each of it; each suggestion benched ~20 s. Issue 30's table and the prompt ranking that
# failed (12 GiB, objective pp) in one call of ~8-9 minutes:
#   CALIBRATE=1 bash benchmarks/plan_check.sh one suggest --vram-gib 12 --objective pp -r 2
# or in two calls, the second on the first's calibration (~6 and ~5 minutes):
#   CALIBRATE=1 bash benchmarks/plan_check.sh one -r 2
#   CALIBRATE=0 bash benchmarks/plan_check.sh suggest --vram-gib 12,24 --objective tg,pp -r 3
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
