#!/usr/bin/env bash
# dimsplit_t on the GPU: a smoke verification first (a hang or failure stops there), then its GPU tests,
# memcheck, and the H=8 ps1 bench beside the dimsplit / rowblock tiles it competes with (logs under $OUT).
#   run: bash tools/device_dst.sh        [KERNELS=globs BENCH_LIMIT=s TESTS=0 SMEM=sm120]
set -u
. "$(dirname "$0")/device_env.sh"
URI=${URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st3_dimsplit_t_tree_bf16_sm120_sm90}
step smoke 200 python3 tools/device_profile.py "$URI" 0 0 quick
cat "$OUT/smoke.log" | tail -14
if grep -q FAIL "$OUT/smoke.log" || ! grep -q "^ok" "$OUT/smoke.log"; then echo "smoke failed: stop"; exit 1; fi
if [ "${TESTS:-1}" = 1 ]; then
  step pytest_dst "${TEST_LIMIT:-330}" python3 -m pytest -m gpu -q -rs tests/test_kernel_gpu.py tests/test_new_kv_gpu.py \
    -k "dimsplit_t or dst or new_kv"
  grep -E "passed|failed|Error|assert" "$OUT/pytest_dst.log" | tail -15
  step memcheck_dst 150 compute-sanitizer --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$URI" 0 0 quick
fi
step bench_dst "${BENCH_LIMIT:-300}" python3 bench/run_bench.py --grid small --heads 8 --page-sizes 1 --skip-sglang \
  --no-flashinfer ${SMEM:+--smem-per-sm "$SMEM"} \
  --kernels "${KERNELS:-*_dimsplit_t_*,*_lw128_bn32_w8_rt5_st3_dimsplit_tree*,*_lwbulk_bn32_w16_rt1_st2_c*,*_lwbulk_bn32_w8_rt1_st2_tree*}" \
  --out "$OUT/bench"
grep -E "^H=|tiles:|built|failed|Error|^\|" "$OUT/bench_dst.log" | tail -40
