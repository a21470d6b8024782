# One GPU call for the cluster variants: quick verification of two cluster variants (built and checked
# concurrently, each under its own time limit, one line per case), then the H=8 bench of cluster 1/3/5
# natively and at sm_120 occupancy, and the phase ablation of the cluster-5 variant. carry: [".whl"]
. tools/device_env.sh
U=mla_verify_h8_q9_kv512_rope64
if [ "${VERIFY:-1}" = 1 ]; then
(timeout 100 python3 tools/device_profile.py ${U}_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_cl5_tree_bf16_sm120_sm90 0 0 quick > $OUT/verify_cl5.log 2>&1; echo "rc=$?" >> $OUT/verify_cl5.log) &
(timeout 100 python3 tools/device_profile.py ${U}_ps64_nsauto_lwbulk_bn32_w8_rt1_st2_cl3_tree_bf16_sm120_sm90 0 0 quick > $OUT/verify_cl3.log 2>&1; echo "rc=$?" >> $OUT/verify_cl3.log) &
wait
tail -n 14 $OUT/verify_cl5.log $OUT/verify_cl3.log | cut -c1-200
fi
if [ "${VERIFY:-1}" = 0 ] || { grep -q "rc=0" $OUT/verify_cl5.log && grep -q "rc=0" $OUT/verify_cl3.log && ! grep -q FAIL $OUT/verify_cl*.log; }; then
  BENCH=(python3 bench/run_bench.py --heads 8 --page-sizes 1 --batches "${BATCHES:-1,4}" --contexts "${CONTEXTS:-4096,65536,131072}"
         --kernels '*_bn32_w8_rt?_st2_[ct]*')
  step bench_cl 170 "${BENCH[@]}" --out $OUT/bench_cl
  grep -E "^H=|tiles:|built" $OUT/bench_cl.log | cut -c1-330
  [ "${SM120:-1}" = 1 ] && step bench_cl_sm120 80 "${BENCH[@]}" --skip-sglang --smem-per-sm sm120 --out $OUT/bench_cl_sm120
  grep -E "^H=|tiles:" $OUT/bench_cl_sm120.log | cut -c1-330
  [ "${ABLATE:-1}" = 1 ] && step ablate_cl5 40 python3 tools/device_ablate.py ${U}_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_cl5_tree_bf16_sm120_sm90 --contexts 65536
  grep "^|" $OUT/ablate_cl5.log
fi
