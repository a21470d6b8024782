#!/usr/bin/env bash
# One device call: SGLang backend parity test, ncu stall breakdown of a variant, a tile sweep.
#   run: bash tools/device_probe.sh [URI]      carry: [".whl"]
set -u
OUT=${OUT:-/tmp/mlagen-out}; mkdir -p "$OUT"
export MLAGEN_CACHE_DIR=${MLAGEN_CACHE_DIR:-/tmp/mlc} PYTHONUNBUFFERED=1 COLUMNS=250
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/whl.log" 2>&1 || echo "wheels: see whl.log"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/pip.log" 2>&1 || echo "pip -e: see pip.log"
URI=${1:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt2_st2_tree_bf16_sm120_sm90}
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?;
         echo "$name: rc=$rc $((SECONDS - t0))s | $(grep -E 'passed|failed|skipped|error' "$OUT/$name.log" | tail -1)"; }
step pytest_sglang ${SGL_LIMIT:-200} env MLAGEN_SGLANG_REPLAYS=${REPLAYS:-1000} python3 -m pytest -m gpu -q -rs -x tests/test_sglang_backend_gpu.py
tail -15 "$OUT/pytest_sglang.log"
R="barrier long_scoreboard short_scoreboard mio_throttle math_pipe_throttle wait not_selected selected dispatch_stall lg_throttle no_instruction membar branch_resolving misc"
M=$(for r in $R; do printf "smsp__average_warps_issue_stalled_%s_per_issue_active.ratio," "$r"; done)
M="${M}sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.per_cycle_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors_srcunit_tex_op_read.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum"
python3 tools/device_profile.py "$URI" 65536 1 > "$OUT/prof_build.log" 2>&1
step ncu 120 ncu --clock-control none --kernel-name regex:partial --launch-skip 2 --launch-count 1 \
  --section SourceCounters --metrics "$M" python3 tools/device_profile.py "$URI" 65536 1
grep -E "stalled|active|throughput|sectors|wavefronts|duration|pct" "$OUT/ncu.log" | sed 's/  */ /g' | head -40
step sweep ${SWEEP_LIMIT:-240} python3 tools/device_sweep.py "${SWEEP_SPEC}" ${SWEEP_SHAPES:-65536x1,4096x1}
grep -E "^mla|ctx=|build|copy|FAIL" "$OUT/sweep.log" | head -80
if [ -n "${SANITIZE:-}" ]; then
  step memcheck 150 compute-sanitizer --tool memcheck python3 tools/device_profile.py "$URI" 0 0 quick
  step racecheck 200 compute-sanitizer --tool racecheck python3 tools/device_profile.py "$URI" 0 0 quick
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|FAIL" "$OUT/memcheck.log" "$OUT/racecheck.log" | head
fi
