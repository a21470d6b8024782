#!/usr/bin/env bash
# One device call: SGLang backend parity test, ncu stall breakdown of a variant, and with SWEEP_SPEC (a JSON spec,
# SWEEP_SHAPES CTXxBS,...) a tile sweep, with SANITIZE=1 memcheck and racecheck of URI.
#   run: bash tools/device_probe.sh [URI]      carry: [".whl"]
set -u
. "$(dirname "$0")/device_env.sh"  # $OUT, wheels, mlagen, step()
URI=${1:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt2_st2_tree_bf16_sm120_sm90}
step pytest_sglang ${SGL_LIMIT:-200} env MLAGEN_SGLANG_REPLAYS=${REPLAYS:-1000} python3 -m pytest -m gpu -q -rs -x tests/test_sglang_backend_gpu.py
tail -15 "$OUT/pytest_sglang.log"
R="barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction membar branch_resolving misc"
M=$(for r in $R; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done)
M="${M}sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
step prof_build 300 python3 tools/device_profile.py "$URI" 65536 1
step ncu 120 ncu --clock-control none --kernel-name regex:partial --launch-skip 2 --launch-count 1 \
  --section SourceCounters --metrics "$M" python3 tools/device_profile.py "$URI" 65536 1
grep -E "stalled|active|throughput|sectors|wavefronts|duration|pct" "$OUT/ncu.log" | sed 's/  */ /g' | head -40
if [ -n "${SWEEP_SPEC:-}" ]; then  # a tuning sweep (tools/device_sweep.py SPEC_JSON SHAPES), when given
  step sweep ${SWEEP_LIMIT:-240} python3 tools/device_sweep.py "$SWEEP_SPEC" ${SWEEP_SHAPES:-65536x1,4096x1}
  grep -E "^mla|ctx=|build|copy|FAIL" "$OUT/sweep.log" | head -80
fi
if [ -n "${SANITIZE:-}" ]; then
  step memcheck 150 compute-sanitizer --tool memcheck python3 tools/device_profile.py "$URI" 0 0 quick
  step racecheck 200 compute-sanitizer --tool racecheck python3 tools/device_profile.py "$URI" 0 0 quick
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$OUT/memcheck.log" "$OUT/racecheck.log" | head
fi
