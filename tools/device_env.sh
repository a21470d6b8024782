# Sourced by tools/device_session.sh and tools/device_probe.sh on the GPU machine: $OUT, the build
# cache, the carried wheels (.whl/ and .whl_fi/ -> /tmp/site on PYTHONPATH), mlagen itself, and step(), which runs
# one command under a time limit with its log in $OUT and prints a one-line summary.
# (python3 -m pip: on the H200 image `pip` belongs to another interpreter.)
OUT=${OUT:-/tmp/mlagen-out}; mkdir -p "$OUT"
export MLAGEN_CACHE_DIR=${MLAGEN_CACHE_DIR:-/tmp/mlc} PYTHONUNBUFFERED=1 COLUMNS=250
: > "$OUT/whl.log"
for d in .whl .whl_fi; do  # SGLang's wheels, FlashInfer's (bench/fetch_wheels.sh); whichever the call carried
  ls "$d"/*.whl > /dev/null 2>&1 || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
    >> "$OUT/whl.log" 2>&1 || echo "wheels ($d): see whl.log"
done
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/pip.log" 2>&1 || echo "pip -e: see pip.log"
step() { local name=$1 limit=$2; shift 2; local t0=$SECONDS; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; local rc=$?;
         echo "$name: rc=$rc $((SECONDS - t0))s | $(grep -E 'passed|failed|skipped|error|ERROR SUMMARY|built [0-9]+ variants|wrote' "$OUT/$name.log" | tail -1)"; }
