# Sourced by tools/device_session.sh and tools/device_probe.sh on the GPU machine: the checkout's root as the
# working directory, $OUT (absolute), the build cache, the carried wheels (.whl/ and .whl_fi/ -> /tmp/site on
# PYTHONPATH), mlagen itself, and step(), which runs one command under a time limit with its log in $OUT and prints a
# one-line summary. Ctrl-C, SIGTERM or SIGHUP stops the script and every running step's whole process tree.
# (python3 -m pip: on the H200 image `pip` belongs to another interpreter.)
# The callers' SGL* settings (SGL, SGL_K, SGL_ONLY, SGL_LIMIT) stay in the calling shell: SGLang reads SGL_* variables
# itself (and warns that they are deprecated), so they are not left in the environment of the processes started.
for _v in SGL SGL_K SGL_ONLY SGL_LIMIT; do
  if [ -n "${!_v+x}" ]; then _val=${!_v}; unset "$_v"; printf -v "$_v" '%s' "$_val"; fi
done
OUT=${OUT:-/tmp/mlagen-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export MLAGEN_CACHE_DIR=${MLAGEN_CACHE_DIR:-/tmp/mlc} PYTHONUNBUFFERED=1 COLUMNS=250
STEP_T0="$OUT/.session-start.$$"; touch "$STEP_T0"; sleep 0.05  # what this run writes under $OUT is newer
_STEPS="$OUT/.steps.$$"; mkdir -p "$_STEPS"  # one file per running step: its timeout's pid (a process group leader)
_stop() {  # stop the background parts (they would start their next step), then every running step's process group
  trap '' INT TERM HUP
  local j p; j=$(jobs -p)
  [ -n "$j" ] && kill -TERM $j 2>/dev/null
  for p in "$_STEPS"/*; do [ -e "$p" ] && kill -TERM -- "-${p##*/}" 2>/dev/null; done
  rm -rf "$_STEPS" "$STEP_T0"
  echo "stopped by a signal: the running steps were killed" >&2
  exit 130
}
trap _stop INT TERM HUP
trap 'rm -rf "$_STEPS" "$STEP_T0"' EXIT
: > "$OUT/whl.log"
for d in .whl .whl_fi; do  # SGLang's wheels, FlashInfer's (bench/fetch_wheels.sh); whichever the call carried
  ls "$d"/*.whl > /dev/null 2>&1 || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$d"/*.whl \
    >> "$OUT/whl.log" 2>&1 || echo "wheels ($d): see whl.log"
done
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-build-isolation --no-deps -e . > "$OUT/pip.log" 2>&1 || echo "pip -e: see pip.log"
# step NAME LIMIT_S CMD...: CMD's output in $OUT/NAME.log; SIGTERM at the limit, SIGKILL 20 s later (timeout -k),
# to CMD's whole process group (nvcc, ninja and pytest's children included); prints "NAME: rc=.. Ns | summary".
step() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  [ -e "$_STEPS" ] || return 130  # the script is stopping
  timeout -k 20 "$limit" "$@" > "$OUT/$name.log" 2>&1 &
  local pid=$!
  : > "$_STEPS/$pid"
  wait "$pid"
  local rc=$? summary
  rm -f "$_STEPS/$pid"
  if [ "$rc" = 124 ]; then
    summary="TIMED OUT at ${limit}s"
  elif [ "$rc" = 137 ]; then
    summary="KILLED (SIGKILL: ${limit}s + 20 s past its limit, or out of memory)"
  else
    summary=$(grep -E 'passed|failed|skipped|error|ERROR SUMMARY|built [0-9]+ variants?|wrote' "$OUT/$name.log" | tail -1)
  fi
  echo "$name: rc=$rc $((SECONDS - t0))s | $summary"
  return "$rc"
}
