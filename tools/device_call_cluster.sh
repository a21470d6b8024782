. tools/device_env.sh
step pytest_cl 170 python3 -m pytest -m gpu -q -rs -x tests/test_kernel_gpu.py -k k2_cl
tail -4 $OUT/pytest_cl.log | cut -c1-300
if grep -q " passed" $OUT/pytest_cl.log && ! grep -q "failed" $OUT/pytest_cl.log; then
  bench() { python3 bench/run_bench.py --heads 8 --page-sizes 1 --batches 1,4 --contexts 4096,16384,65536,131072 --kernels '*_bn32_w8_rt?_st2_[ct]*' "$@"; }
  step bench_cl 220 bench --out $OUT/bench_cl
  grep -E "^H=|tiles:|built" $OUT/bench_cl.log | cut -c1-330
  step bench_cl_sm120 150 bench --skip-sglang --smem-per-sm sm120 --out $OUT/bench_cl_sm120
  grep -E "^H=|tiles:" $OUT/bench_cl_sm120.log | cut -c1-330
  step ablate_cl5 45 python3 tools/device_ablate.py mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_cl5_tree_bf16_sm120_sm90 --contexts 65536
  grep "^|" $OUT/ablate_cl5.log
fi
