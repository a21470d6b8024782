#!/usr/bin/env bash
# Everything a GPU session checks, in one device call (logs under $OUT, a short summary at the end).
#   run: bash tools/device_session.sh tests|tests2|bench|grid      carry: [".whl"]   (bash bench/fetch_wheels.sh first)
#   tests ≈ 4-6 min; tests2 (2 GPUs): kernel tests on GPU 0 while GPU 1 runs the SGLang backend test, the backend
#         step, compute-sanitizer memcheck of MEMCHECK_URIS (space-separated) and, with ABLATE_URI, the phase
#         ablation at CONTEXTS ≈ 6-9 min; bench (small grid + SGLang backend test) ≈ 5-8 min;
#   grid: HEADS=8 (or 16,64) [BATCHES=.. PAGE_SIZES=.. CONTEXTS=..] bench/run_bench.py --grid full for those
#         shapes, after the SGLang backend test if SGL=1;  sglang: the SGLang backend test (+ backend_step): its 36
#         cases take ~9 min on an H200 after a ~1.5 min parallel prebuild, so split them over two calls with
#         SGL_K (pytest -k) and SGL_ONLY (the prebuild's --only items), e.g. SGL_K="not fp8" then SGL_K=fp8 SGL_ONLY=fp8_e4m3;
#   ablate: [URI=.. MASKS=1,14,.. BATCH=1 CONTEXTS=..] tools/device_ablate.py, time per phase of the partial kernel by dropping phases.
#   release2 (2 GPUs): KERNELS=globs MEMCHECK_URIS=.. SGLang backend test + backend_step + memcheck on GPU 0, the
#         bench with FlashInfer columns natively and at sm_120 occupancy + racecheck on GPU 1; logs in logs.tgz.
#   fp8: [KERNELS=globs FP8_URI=.. SGL=1] the fp8_e4m3 (dimsplit, dimsplit_t) / two-producer dimsplit GPU tests, memcheck, bench --fp8 (H=8;
#         SGL=1 with .whl carried: also SGLang's Triton verify kernel, bf16 and on the e4m3 pool) ≈ 6-8 min.
#   consumers: [URI=..] ncu of the dimsplit kernel at 64k bs1: instruction mix per pipe, warp states and
#         per-SASS-instruction counters (sass_counters.csv), the report in $OUT ≈ 3-5 min.
#   dst: [DST_URI=.. DST_FP8_URI=.. DST_DEFINES="NAME=VAL .." KTESTS=..] dimsplit_t GPU tests (bf16, e4m3, fused merge,
#         direct, draft rows) + memcheck + racecheck in parallel ≈ 6.5 min; DST_DEFINES: every one of those builds with
#         the candidate defaults (NVCC_APPEND_FLAGS); KTESTS: those GPU tests too (without them); then, a second call,
#   dst_bench: [KERNELS=globs K64=glob] the small-grid bench with FlashInfer's and the L2 -> SM columns, the same at
#         sm_120 occupancy, the page-size-64 rows H8 bs1 64k and H64 bs4 16k, backend_step if .whl is carried
#         (.whl_fi) ≈ 8.5 min (the tiles build in ~4 of them).
#   fixed: [DST_URI=..] ncu durations of the partial and combine kernels at 4k-128k bs1 (warm caches) and the warp
#         states of the 4k partial kernel: where the per-call cost that does not scale with context goes
#         (docs/perf-notes.md v13) ≈ 3 min.
#   diag: DEF=NAME [VAL=1 BASE=0 URI=..] a dimsplit_t build with #define NAME VAL: its quick verification (a
#         failure or hang stops the call), its A/B against the NAME BASE build (give BASE = the define's shipped
#         value; outputs bit for bit first), its cycle trace (tools/dst_trace.py), memcheck and racecheck ≈ 4 min;
#         with KTESTS=.. only those GPU tests (pytest -k on tests/test_kernel_gpu.py), in a call of their own. E.g.
#         the dim-order partial layout against the shipped paired one: DEF=MLAGEN_DST_PARTIAL_BF16 VAL=1 BASE=2.
#   trace: [URI=.. KTESTS=.. SAN_URIS=.. TRACE_ARGS=--cold TRACE_DEFINES=..] per warp role of a dimsplit_t tile, the
#         cycles of a step and of its waits (tools/dst_trace.py); KTESTS' GPU tests and SAN_URIS' sanitizers first.
#   ab: AB_DEFINES="NAME=V0,V1,.. [NAME2=..]" [URI=.. ROUNDS=3 KTESTS=.. TRACE=1 TRACE_ARGS=.. TRACE_DEFINES=..
#         CONTEXTS=.. BATCHES=1,4 AB_ARGS="--atol 0.03125"] tools/device_ab_define.py
#         with those defines zipped (build i gets the i-th value of each); KTESTS' GPU tests first, while the builds
#         compile; with TRACE=1, then the per-role trace of URI's shipped build (tools/dst_trace.py) at 4k and 64k
#         bs 1 ≈ 4-6 min (+ the tests).
#   schedule: KERNELS=globs [SMOKE_URI=.. TESTS=0 KTESTS=.. MEMCHECK_URIS=.. GRID/HEADS/BATCHES/CONTEXTS/SMEM] one schedule's GPU tests,
#         sanitizers and its bench rows (no baselines).
# Steps: install (python3 -m pip: on the H200 image `pip` is another interpreter's), GPU tests, sanitizer,
# the shipped spec through the CLI (build + verify + bench), the SGLang side-by-side bench, the SGLang backend test.
set -u
case "${1:-tests}" in  # before the set-up: a misspelled mode stops here
  tests|tests2|bench|grid|sglang|release2|ablate|fp8|consumers|dst|dst_bench|fixed|schedule|diag|trace|ab) ;;
  *) echo "device_session.sh: unknown mode '$1' (tests, tests2, bench, grid, sglang, release2, ablate, fp8, consumers, dst, dst_bench, fixed, schedule, diag, trace, ab)" >&2
     exit 2 ;;
esac
case "${1:-tests}" in  # what a mode needs, also before the set-up
  grid) [ -n "${HEADS:-}" ] || { echo "device_session.sh grid: give HEADS=8 (or 16,64)" >&2; exit 2; } ;;
  schedule) [ -n "${KERNELS:-}" ] || { echo "device_session.sh schedule: give KERNELS=globs" >&2; exit 2; } ;;
  ab) n=0  # every word NAME=V0,V1[,..] (the builds zipped), at least one; before the set-up, as a wrong mode
      for d in ${AB_DEFINES:-}; do
        [[ "$d" =~ ^[A-Za-z_][A-Za-z0-9_]*=[^,]+(,[^,]+)+$ ]] || {
          echo "device_session.sh ab: '$d' is not NAME=V0,V1[,..] (AB_DEFINES)" >&2; exit 2; }
        n=$((n + 1))
      done
      [ "$n" -gt 0 ] || { echo "device_session.sh ab: give AB_DEFINES=\"NAME=V0,V1 ..\"" >&2; exit 2; } ;;
esac
set -f  # (the words of TRACE_DEFINES are not globbed while checked)
for d in ${TRACE_DEFINES:-}; do  # (trace; ab with TRACE=1) one trace build per word NAME=VALUE, VALUE of [A-Za-z0-9_.+-]
  [[ "$d" =~ ^[A-Za-z_][A-Za-z0-9_]*=[A-Za-z0-9_.+-]+$ ]] || {
    echo "device_session.sh ${1:-tests}: '$d' is not NAME=VALUE (TRACE_DEFINES)" >&2; exit 2; }
done
set +f
. "$(dirname "$0")/device_env.sh"  # $OUT, wheels, mlagen, step()
# compute-sanitizer waits this long for the target to attach (its default timed out beside a parallel build)
SAN="compute-sanitizer --launch-timeout 120"
# The tiles that win somewhere on the small grid (H 8 / 16 / 64, q_len 9 and 1): dimsplit_t, dimsplit, rowblock
RELEASE_KERNELS="*_lw128_bn32_w8_rt3_st[34]_dimsplit_t_*,*_lw128_bn32_w6_rt1_st[34]_dimsplit_t_*,*_lw128_bn32_w8_rt[56]_st3_dimsplit_tree*,*_lwbulk_bn32_w8_rt[12]_st2_tree*,*_lwbulk_bn32_w16_rt1_st2_causal*,*_lw128_bn32_w8_rt1_st2_causal*"
sglang_test() {
  step sglang_import 120 python3 tools/sglang_test_import.py; tail -25 "$OUT/sglang_import.log"
  # every case's module in one parallel build first (built one at a time on first use, the 32 modules alone take
  # longer than a device call); SGL_ONLY="fp8_e4m3" (prebuild --only items) with SGL_K="fp8" (pytest -k) runs a part
  step sglang_prebuild 300 python3 tests/sglang_gpu_variants.py -j "$(nproc)" $(for x in ${SGL_ONLY:-}; do echo --only "$x"; done)
  step pytest_metadata 150 python3 -m pytest -m gpu -q -rs tests/test_metadata_gpu.py  # the fused per-step metadata
  step pytest_sglang "${SGL_LIMIT:-480}" env MLAGEN_SGLANG_REPLAYS="${REPLAYS:-1000}" \
    python3 -m pytest -m gpu -q -rs -s tests/test_sglang_backend_gpu.py ${SGL_K:+-k "$SGL_K"}
  grep -E "mlagen vs triton|Error|error|FAILED|SKIPPED" "$OUT/pytest_sglang.log" | head -30
  if grep -q "passed" "$OUT/pytest_sglang.log"; then
    step backend_step "${STEP_LIMIT:-150}" python3 bench/backend_step.py --contexts 16384,65536 --batches 1,4 ${STEP_ARGS:-}
    grep -E "^\||variant|not measured|Error" "$OUT/backend_step.log" | tail -8
  else
    step sglang_probe 120 python3 tools/sglang_import_probe.py; tail -6 "$OUT/sglang_probe.log"
  fi
}
define_traces() {  # LIMIT CONTEXTS BATCHES: after the shipped build's trace, the same trace of URI built with each
  # word NAME=VALUE of TRACE_DEFINES (TRACE_ARGS passed on), one log each
  for d in ${TRACE_DEFINES:-}; do
    step "trace_${d/=/-}" "$1" python3 tools/dst_trace.py "$URI" --contexts "$2" --batches "$3" --define "$d" \
      ${TRACE_ARGS:-}
    grep -E "^\||^bs|^timeline|Error" "$OUT/trace_${d/=/-}.log" | grep -v "^|---"
  done
}
memcheck() {  # compute-sanitizer memcheck, quick verification set, of each URI given
  for u in "$@"; do
    step "memcheck_$u" 240 $SAN --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$u" 0 0 quick
  done
}
MODE=${1:-tests}
if [ "$MODE" = tests2 ]; then
  # two GPUs: kernel tests on GPU 0; SGLang backend test, backend step and memcheck on GPU 1 (in parallel)
  ( export CUDA_VISIBLE_DEVICES=0
    step pytest_kernel 520 python3 -m pytest -m gpu -q -rs tests/test_kernel_gpu.py ) > "$OUT/gpu0.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=1
    sglang_test
    memcheck ${MEMCHECK_URIS:-}
    if [ -n "${ABLATE_URI:-}" ]; then
      step ablate "${ABLATE_LIMIT:-240}" python3 tools/device_ablate.py "$ABLATE_URI" --contexts "${CONTEXTS:-65536}"
      grep -E "^\||^mla_|^ablate" "$OUT/ablate.log" | tail -14
    fi ) > "$OUT/gpu1.txt" 2>&1 &
  wait
  cat "$OUT/gpu0.txt" "$OUT/gpu1.txt"
elif [ "$MODE" = tests ]; then
  [ "${SGL:-0}" = 1 ] && sglang_test
  step pytest_kernel 240 python3 -m pytest -m gpu -q tests/test_kernel_gpu.py
  step sanitizer 120 $SAN --tool memcheck python3 tools/device_profile.py \
    mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lwbulk_bn32_w8_rt1_st2_tree_bf16_sm120_sm90 0 0 quick
  step cli_build 180 python3 -m mlagen.cli build specs/kimi-k2-tp8-verify.yaml
elif [ "$MODE" = release2 ]; then
  KERNELS=${KERNELS:-$RELEASE_KERNELS}
  # two GPUs, one call, everything a release needs measured side by side: GPU 0 the SGLang backend test,
  # backend_step and memcheck of MEMCHECK_URIS; GPU 1 the bench (FlashInfer columns, KERNELS tiles) natively
  # and at sm_120 occupancy, then racecheck of MEMCHECK_URIS; every log packed into $OUT/logs.tgz
  ( export CUDA_VISIBLE_DEVICES=0
    sglang_test
    for u in ${MEMCHECK_URIS:-}; do
      step "memcheck_$u" "${SAN_LIMIT:-100}" $SAN --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$u" 0 0 quick
    done ) > "$OUT/gpu0.txt" 2>&1 &
  ( export CUDA_VISIBLE_DEVICES=1
    step bench_native "${BENCH_LIMIT:-230}" python3 bench/run_bench.py --grid small --page-sizes 1 --skip-sglang \
      --kernels "$KERNELS" --out "$OUT/native"
    step bench_sm120 "${BENCH_LIMIT:-230}" python3 bench/run_bench.py --grid small --page-sizes 1 --skip-sglang \
      --smem-per-sm sm120 --kernels "$KERNELS" --out "$OUT/sm120"
    for u in ${MEMCHECK_URIS:-}; do
      step "racecheck_$u" "${SAN_LIMIT:-100}" $SAN --tool racecheck --error-exitcode 9 python3 tools/device_profile.py "$u" 0 0 quick
    done ) > "$OUT/gpu1.txt" 2>&1 &
  wait
  cat "$OUT/gpu0.txt" "$OUT/gpu1.txt"
  grep -hE "^\|" "$OUT/bench_native.log" "$OUT/bench_sm120.log"
  # pack what this run wrote under $OUT (nothing older) into $OUT/logs.tgz, then remove those files
  (cd "$OUT" && find . -type f -newer "$STEP_T0" ! -name logs.tgz ! -name '.session-start.*' ! -path './.steps.*' \
     ! -name .logs.list ! -name .logs.tgz.part \
     -print0 > .logs.list && tar czf .logs.tgz.part --null -T .logs.list && xargs -0 rm -f < .logs.list \
     && rm -f .logs.list && mv -f .logs.tgz.part logs.tgz && find . -mindepth 1 -type d -empty -newer "$STEP_T0" -delete)
elif [ "$MODE" = dst ]; then
  # the dimsplit_t release checks on one GPU, first of two calls (each fits the 10-minute call limit), all in
  # parallel (~6.5 min on an H200): its GPU tests (bf16: full case set, equality with rowblock, other row counts;
  # e4m3: full case set, equality with bf16 on the dequantized cache, other row counts; the fused-merge diagnostic
  # builds and the shipped builds' combine path; direct batches and draft rows), memcheck and racecheck of
  # DST_URI, racecheck of DST_FP8_URI when set (an e4m3 dimsplit_t uri); the bench is `dst_bench`
  DST_URI=${DST_URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90}
  T="python3 -m pytest -m gpu -q -rs --durations=12"  # the slowest tests and fixtures (builds) in each log
  if [ -n "${KTESTS:-}" ]; then  # GPU tests of diagnostic builds (they set their own defines), beside the rest
    step pytest_ktests 500 $T tests/test_kernel_gpu.py -k "$KTESTS" &
  fi
  if [ -n "${DST_DEFINES:-}" ]; then  # a candidate default (NAME=VAL ...) in every build of the steps below, through
    # nvcc's own NVCC_APPEND_FLAGS (part of the build cache key: mlagen.ninja_gen.toolchain_key)
    export NVCC_APPEND_FLAGS="$(for d in $DST_DEFINES; do printf -- '-D%s ' "$d"; done)"
    echo "dst: every build with NVCC_APPEND_FLAGS=$NVCC_APPEND_FLAGS"
  fi
  # the bf16 set in two processes (one ran past 500 s): the full case set; the equality with rowblock and the other
  # row counts (a module both need is built once: the second process waits on its build lock)
  step pytest_dst 500 $T tests/test_kernel_gpu.py -k "dimsplit_t_full" &
  step pytest_dst_rows 500 $T tests/test_kernel_gpu.py -k "(equals_rowblock and k2_dst) or (other_shapes and dst_rows)" &
  step pytest_dst_fp8 500 $T tests/test_kernel_gpu.py \
    -k "dimsplit_t_fp8_full or (equals_bf16 and k2_dst_fp8) or (other_shapes and dst_fp8_rows)" &
  step pytest_merge 500 $T tests/test_kernel_gpu.py -k "fused_merge or shipped_dimsplit_t" &
  step pytest_direct_newkv 500 $T tests/test_direct_gpu.py tests/test_new_kv_gpu.py &
  step memcheck_dst 400 $SAN --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$DST_URI" 0 0 quick &
  step racecheck_dst 500 $SAN --tool racecheck --error-exitcode 9 python3 tools/device_profile.py "$DST_URI" 0 0 quick &
  if [ -n "${DST_FP8_URI:-}" ]; then  # the e4m3 build's racecheck too (its conversion writes the bf16 stages)
    step racecheck_dst_fp8 500 $SAN --tool racecheck --error-exitcode 9 python3 tools/device_profile.py "$DST_FP8_URI" 0 0 quick &
  fi
  wait
  for f in pytest_dst pytest_dst_rows pytest_dst_fp8 pytest_merge pytest_direct_newkv ${KTESTS:+pytest_ktests}; do
    echo "$f: $(grep -hE "passed|failed|Error|assert" "$OUT/$f.log" | tail -1)"
  done
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/memcheck_dst.log" "$OUT/racecheck_dst.log" \
    ${DST_FP8_URI:+"$OUT/racecheck_dst_fp8.log"}
elif [ "$MODE" = dst_bench ]; then
  # the second call (carry .whl_fi; with .whl too, backend_step runs): the small-grid bench at page size 1 with
  # FlashInfer's columns and the L2 -> SM column (KERNELS), the same tiles at sm_120 occupancy (mlagen only), the
  # issue's two page-size-64 rows (H8 bs1 64k, H64 bs4 16k) with FlashInfer's columns, then bench/backend_step.py
  # when SGLang imports (~8.5 min without it on an H200, ~4 of them building)
  KERNELS=${KERNELS:-$RELEASE_KERNELS}
  K64=${K64:-*_lw128_bn32_w8_rt3_st4_dimsplit_t_*}
  P8="--grid small --heads 8 --batches 1 --contexts 65536 --page-sizes 64"
  P64="--grid full --heads 64 --batches 4 --contexts 16384 --page-sizes 64"
  step bench_build_ps64 230 sh -c "python3 bench/run_bench.py $P8 --build-only --kernels '$K64' &&
    python3 bench/run_bench.py $P64 --build-only --kernels '$K64'" &
  # (300 s stopped it a few tiles short on a 16-core H200 host; bench_native then built the rest in 42 s)
  step bench_build "${BUILD_LIMIT:-420}" python3 bench/run_bench.py --grid small --page-sizes 1 --build-only \
    --kernels "$KERNELS" &
  wait
  step bench_native "${BENCH_LIMIT:-260}" python3 bench/run_bench.py --grid small --page-sizes 1 --skip-sglang \
    --kernels "$KERNELS" --out "$OUT/native"
  step bench_sm120 "${BENCH_LIMIT:-200}" python3 bench/run_bench.py --grid small --page-sizes 1 --skip-sglang \
    --no-flashinfer --smem-per-sm sm120 --kernels "$KERNELS" --out "$OUT/sm120"
  step bench_ps64_h8 120 python3 bench/run_bench.py $P8 --skip-sglang --l2-bytes off --kernels "$K64" --out "$OUT/ps64_h8"
  step bench_ps64_h64 120 python3 bench/run_bench.py $P64 --skip-sglang --l2-bytes off --kernels "$K64" --out "$OUT/ps64_h64"
  if python3 -c "import sglang" > /dev/null 2>&1; then
    step backend_step "${STEP_LIMIT:-100}" python3 bench/backend_step.py --contexts 16384,65536 --batches 1,4 --layers 61
  fi
  rm -f "$OUT"/*/*.png
  grep -hE "^\|" "$OUT/bench_native.log" "$OUT/bench_sm120.log" | tail -30
  grep -hE "^\| [0-9]" "$OUT/bench_ps64_h8.log" "$OUT/bench_ps64_h64.log"
  grep -hE "^L2 -> SM" "$OUT/bench_native.log"
elif [ "$MODE" = diag ]; then
  # with KTESTS: only those GPU tests (they build their own modules; a call of their own). Else a dimsplit_t build
  # with DEF=VAL (default 1): its quick verification (a failure or hang stops the call), the A/B against the
  # DEF=BASE build (default 0; give the define's shipped value), outputs bit for bit first, its per-role cycle trace
  # (tools/dst_trace.py), then memcheck and racecheck of it
  if [ -n "${KTESTS:-}" ]; then
    step d_pytest "${TEST_LIMIT:-540}" python3 -m pytest -m gpu -q -rs --durations=12 tests/test_kernel_gpu.py -k "$KTESTS"
    grep -E "passed|failed|Error|assert" "$OUT/d_pytest.log" | tail -8
    exit 0
  fi
  URI=${URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90}
  [ -n "${DEF:-}" ] || { echo "diag: give DEF=NAME (a diagnostic define), or KTESTS=.."; exit 2; }
  VAL=${VAL:-1}; BASE=${BASE:-0}
  step d_verify 240 python3 tools/device_profile.py "$URI" 0 0 quick "$DEF=$VAL"
  tail -14 "$OUT/d_verify.log"
  if grep -q FAIL "$OUT/d_verify.log" || ! grep -q "^ok" "$OUT/d_verify.log"; then
    echo "diag: the quick verification failed or did not finish: stop"; exit 1
  fi
  step d_ab 240 python3 tools/device_ab_define.py "$URI" --define "$DEF=$BASE,$VAL" \
    --contexts 4096,16384,65536,131072 --batches 1,4 --rounds 3
  grep -E "^\||equal|differ|DIFFER" "$OUT/d_ab.log" | tail -16
  step d_trace 200 python3 tools/dst_trace.py "$URI" --contexts 65536 --batches 1,4 --define "$DEF=$VAL"
  grep -E "^\| (score|output|producer)|^bs" "$OUT/d_trace.log"
  step d_memcheck 240 $SAN --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$URI" 0 0 quick "$DEF=$VAL" &
  step d_racecheck 300 $SAN --tool racecheck --error-exitcode 9 python3 tools/device_profile.py "$URI" 0 0 quick "$DEF=$VAL" &
  wait
  grep -hE "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/d_memcheck.log" "$OUT/d_racecheck.log"
elif [ "$MODE" = trace ]; then
  # where a dimsplit_t step's cycles go, per warp role (tools/dst_trace.py: the MLAGEN_DST_TRACE build's waits timed
  # with %clock64), for URI at CONTEXTS x BATCHES; first the GPU tests of KTESTS (pytest -k on
  # tests/test_kernel_gpu.py) and memcheck + racecheck of SAN_URIS, when given (~6 min with the other-row-count tests)
  URI=${URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90}
  if [ -n "${KTESTS:-}" ]; then
    step pytest_k "${TEST_LIMIT:-420}" python3 -m pytest -m gpu -q -rs --durations=12 tests/test_kernel_gpu.py -k "$KTESTS"
    grep -E "passed|failed|Error|assert" "$OUT/pytest_k.log" | tail -8
  fi
  for u in ${SAN_URIS:-}; do
    step "memcheck_$u" 240 $SAN --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$u" 0 0 quick &
    step "racecheck_$u" 300 $SAN --tool racecheck --error-exitcode 9 python3 tools/device_profile.py "$u" 0 0 quick &
    wait
  done
  # TRACE_ARGS: more dst_trace.py options, e.g. --cold (the L2 evicted before each launch, as in the bench);
  # TRACE_DEFINES="NAME=VALUE ..": after the shipped build's trace, the same trace of a build with each define (e.g.
  # MLAGEN_ABLATE=256: no page-table loads), those builds compiled while the first trace runs
  for d in ${TRACE_DEFINES:-}; do
    step "trace_build_${d/=/-}" 240 python3 tools/dst_trace.py "$URI" --build-only --define "$d" &
  done
  step trace 240 python3 tools/dst_trace.py "$URI" --contexts "${CONTEXTS:-16384,65536}" --batches "${BATCHES:-1,4}" \
    ${TRACE_ARGS:-}
  grep -E "^\||^bs|^timeline|Error" "$OUT/trace.log" | grep -v "^|---"
  wait
  define_traces 120 "${CONTEXTS:-16384,65536}" "${BATCHES:-1,4}"
elif [ "$MODE" = ab ]; then
  # several diagnostic builds of one tile against each other in one process (alternating rounds, outputs bit for
  # bit first), then where the shipped build's step goes per warp role
  URI=${URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90}
  ABD=$(for d in $AB_DEFINES; do echo --define "$d"; done)
  if [ -n "${KTESTS:-}" ]; then  # those GPU tests first, while the A/B builds compile; the timing after both
    step ab_ktests "${TEST_LIMIT:-400}" python3 -m pytest -m gpu -q -rs --durations=8 tests/test_kernel_gpu.py -k "$KTESTS" &
    step ab_build 300 python3 tools/device_ab_define.py "$URI" $ABD --build-only &
    wait
    grep -hE "passed|failed|Error|assert" "$OUT/ab_ktests.log" | tail -4
  fi
  read -r -a ab_args <<< "${AB_ARGS:-}"  # (split on blanks, never globbed)
  step ab "${AB_LIMIT:-300}" python3 tools/device_ab_define.py "$URI" $ABD \
    --contexts "${CONTEXTS:-4096,16384,65536,131072}" --batches "${BATCHES:-1,4}" --rounds "${ROUNDS:-3}" "${ab_args[@]}"
  grep -E "^\||equal|differ|DIFFER|Error" "$OUT/ab.log" | tail -16
  if [ "${TRACE:-0}" = 1 ]; then  # TRACE_ARGS: e.g. --cold; TRACE_DEFINES="NAME=VALUE ..": also those builds' traces
    step trace 200 python3 tools/dst_trace.py "$URI" --contexts 4096,65536 --batches 1 ${TRACE_ARGS:-}
    grep -E "^\||^bs|^timeline|Error" "$OUT/trace.log" | grep -v "^|---"
    define_traces 200 4096,65536 1
  fi
elif [ "$MODE" = schedule ]; then
  # a kernel schedule on its own: with SMOKE_URI, that variant's quick verification first (a failure or hang
  # stops the call there); its GPU tests (KTESTS: pytest -k expression, TESTS=0 skips them), memcheck +
  # racecheck of MEMCHECK_URIS, then the H=8 bench shapes with only the tiles of KERNELS (globs), no baselines
  if [ -n "${SMOKE_URI:-}" ]; then
    step smoke 200 python3 tools/device_profile.py "$SMOKE_URI" 0 0 quick
    tail -14 "$OUT/smoke.log"
    if grep -q FAIL "$OUT/smoke.log" || ! grep -q "^ok" "$OUT/smoke.log"; then echo "smoke failed: stop"; exit 1; fi
  fi
  if [ "${TESTS:-1}" = 1 ]; then
    step pytest_sched "${TEST_LIMIT:-300}" python3 -m pytest -m gpu -q -rs -x tests/test_kernel_gpu.py -k "${KTESTS:-dimsplit or ds_rows or dsp_rows}"
    grep -E "passed|failed|Error|assert" "$OUT/pytest_sched.log" | tail -12
  fi
  for u in ${MEMCHECK_URIS:-}; do
    step "memcheck_$u" 200 $SAN --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$u" 0 0 quick
    step "racecheck_$u" 240 $SAN --tool racecheck --error-exitcode 9 python3 tools/device_profile.py "$u" 0 0 quick
  done
  step bench_sched "${BENCH_LIMIT:-300}" python3 bench/run_bench.py --grid "${GRID:-small}" --heads "${HEADS:-8}" \
    ${BATCHES:+--batches "$BATCHES"} ${CONTEXTS:+--contexts "$CONTEXTS"} ${PAGE_SIZES:+--page-sizes "$PAGE_SIZES"} \
    ${SMEM:+--smem-per-sm "$SMEM"} --skip-sglang --no-flashinfer --kernels "$KERNELS" --out "$OUT"
  grep -E "^\||tiles:|ceilings|built|failed|Error" "$OUT/bench_sched.log" | tail -40
elif [ "$MODE" = fp8 ]; then
  # the e4m3-KV (dimsplit, dimsplit_t) and two-producer dimsplit builds: their GPU tests, memcheck of the fp8 K2
  # variant, the H=8 bench with fp8 columns (KERNELS: the bf16 tiles to compare with, default dimsplit_t st4 and dimsplit)
  step pytest_fp8 "${TEST_LIMIT:-300}" python3 -m pytest -m gpu -q -rs tests/test_kernel_gpu.py tests/test_new_kv_gpu.py \
    -k "fp8 or ds2p or new_kv"
  grep -E "passed|failed|Error|assert" "$OUT/pytest_fp8.log" | tail -12
  FP8_URI=${FP8_URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st2_dimsplit_t_tree_fp8e4m3_sm120_sm90}
  step memcheck_fp8 200 $SAN --tool memcheck --error-exitcode 9 python3 tools/device_profile.py "$FP8_URI" 0 0 quick
  step bench_fp8 "${BENCH_LIMIT:-300}" python3 bench/run_bench.py --grid small --heads 8 --page-sizes 1 \
    $([ "${SGL:-0}" = 1 ] || echo --skip-sglang) \
    --no-flashinfer --fp8 --kernels "${KERNELS:-*_lw128_bn32_w8_rt3_st4_dimsplit_t_*,*_lw128_bn32_w[78]_rt5_st3_dimsplit_tree*,*_lwbulk_bn32_w16_rt1_st2_c*}" --out "$OUT"
  grep -E "^H=|tiles:|built|failed|Error" "$OUT/bench_fp8.log" | tail -30
elif [ "$MODE" = consumers ]; then
  # where the dimsplit kernel's issue slots go at 64k bs1 (ncu: instruction mix per pipe, warp states, and
  # per-SASS-instruction counters of the hot loop; the report itself stays in $OUT for the ncu GUI)
  URI=${URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt5_st3_dimsplit_tree_bf16_sm120_sm90}
  step prof_build 300 python3 tools/device_profile.py "$URI" 65536 1
  # sections only (their metric names are ncu's own on every arch) plus the two metrics device_probe.sh uses
  P="smsp__issue_active.avg.per_cycle_active,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active"
  step ncu_mix "${NCU_LIMIT:-240}" ncu --clock-control none --kernel-name regex:dimsplit --launch-skip 2 --launch-count 1 \
    --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats --section SourceCounters \
    --metrics "$P" \
    --export "$OUT/consumers" python3 tools/device_profile.py "$URI" 65536 1
  grep -E "issue_active|tensor|Pipe|Warp Cycles|Stall|Executed Ipc|Instructions" "$OUT/ncu_mix.log" | sed 's/  */ /g' | head -40
  step ncu_sass 120 ncu --import "$OUT/consumers.ncu-rep" --page source --print-source sass --csv
  mv "$OUT/ncu_sass.log" "$OUT/sass_counters.csv" 2>/dev/null
elif [ "$MODE" = fixed ]; then
  # the per-call cost of DST_URI that does not scale with context (H8 q9 bs1): ncu durations of the partial and combine kernels at 4k / 16k /
  # 64k / 128k with caches left as the previous launch leaves them (--cache-control none; the third launch of
  # each is read), then the warp states of the 4k partial kernel (prologue / epilogue heavy) ≈ 3 min
  DST_URI=${DST_URI:-mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90}
  step prof_build 300 python3 tools/device_profile.py "$DST_URI" 4096 1
  for c in 4096 16384 65536 131072; do
    step "ncu_fixed_$c" 90 ncu --cache-control none --clock-control none --kernel-name regex:"dimsplit_t|combine" \
      --launch-skip 4 --launch-count 2 --metrics gpu__time_duration.sum python3 tools/device_profile.py "$DST_URI" $c 1
    grep -E "mla_verify|duration" "$OUT/ncu_fixed_$c.log" | sed 's/  */ /g'
  done
  step ncu_fixed_states 150 ncu --cache-control none --clock-control none --kernel-name regex:dimsplit_t --launch-skip 2 \
    --launch-count 1 --section WarpStateStats --section SourceCounters python3 tools/device_profile.py "$DST_URI" 4096 1
  grep -E "Warp Cycles|Stall" "$OUT/ncu_fixed_states.log" | sed 's/  */ /g' | head -20
elif [ "$MODE" = ablate ]; then
  step ablate "${ABLATE_LIMIT:-300}" python3 tools/device_ablate.py ${URI:-} --contexts "${CONTEXTS:-4096,65536}" \
    ${MASKS:+--masks "$MASKS"} ${BATCH:+--batch "$BATCH"}
  grep -E "^\||^mla_|^ablate" "$OUT/ablate.log" | tail -30
elif [ "$MODE" = sglang ]; then
  sglang_test
elif [ "$MODE" = grid ]; then
  [ "${SGL:-0}" = 1 ] && sglang_test
  step "bench_h${HEADS//,/_}" "${BENCH_LIMIT:-330}" python3 bench/run_bench.py --grid full --heads "$HEADS" \
    --out "$OUT/h${HEADS//,/_}" \
    ${BATCHES:+--batches "$BATCHES"} ${PAGE_SIZES:+--page-sizes "$PAGE_SIZES"} ${CONTEXTS:+--contexts "$CONTEXTS"} ${SMEM:+--smem-per-sm "$SMEM"}
  grep -E "^\||^H=|ns[0-9a-z]+=|ceilings|built|failed" "$OUT/bench_h${HEADS//,/_}.log" | tail -70
elif [ "$MODE" = bench ]; then
  step bench_small 330 python3 bench/run_bench.py --grid small --out "$OUT"
  sglang_test
  grep -E "^\|" "$OUT/bench_small.log" | tail -25
fi
