#!/usr/bin/env bash
# Download the wheels for the GPU machine (no registry there): CPython 3.12, manylinux x86_64, --no-deps
# (each needed dependency is listed explicitly; one version each).
#   bench/requirements.txt             -> .whl/     SGLang's Triton kernels and their import chain
#   bench/requirements-flashinfer.txt  -> .whl_fi/  FlashInfer's MLA kernels (run_bench's FI columns)
# Both gitignored; carry them in separate device calls if together they exceed 64 MiB.
#
# sglang itself (39 MB, 46 MB of it Rust .so files nobody here imports) is repacked into
# .whl/sglang-<ver>-1slim-py3-none-any.whl without *.so, sglang/multimodal_gen/. flashinfer-python
# (101 MB) is repacked into .whl_fi/flashinfer_python-<ver>-1mla-py3-none-any.whl (~36 MB) keeping
# only what its MLA paged kernels need besides the python (bench/wheels.py says what, and checks that
# the include closure of the MLA JIT sources survived). RECORD is rewritten in both.
# Because the repacked wheels are pure python they also install on the local Python for import checks.
#
# Run from anywhere:   bash bench/fetch_wheels.sh [sglang|flashinfer|all]     (default all)
# Then on the device:  python3 -m pip install -q --no-index --no-deps --no-compile \
#     --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#   (and the same for .whl_fi/*.whl, as a second pip command; tools/device_env.sh does both)
#
# Env overrides: WHL_DIR (default .whl), WHL_FI_DIR (default .whl_fi), PYVER (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=${WHL_DIR:-.whl}
DEST_FI=${WHL_FI_DIR:-.whl_fi}
PYVER=${PYVER:-3.12}

PLATS=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  PLATS+=(--platform "$p")
done
PIP_DL=(python3 -m pip download -q --no-deps --only-binary=:all:
        --python-version "$PYVER" --implementation cp "${PLATS[@]}")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
W() { python3 bench/wheels.py "$@"; }

# fetch REQFILE DEST: every NAME==VER of REQFILE into DEST (sglang and flashinfer-python repacked)
fetch() {
  local req=$1 dest=$2 spec name ver lname src
  mkdir -p "$dest"
  mapfile -t SPECS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$req" | grep -v '^$')
  for spec in "${SPECS[@]}"; do
    name=${spec%%==*}
    ver=${spec#*==}
    if W have "$dest" "$name" "$ver"; then
      echo "have $spec"
      continue
    fi
    echo "fetch $spec"
    W clean "$dest" "$name"
    lname=$(echo "$name" | tr 'A-Z_' 'a-z-')
    case "$lname" in
      sglang|flashinfer-python)
        "${PIP_DL[@]}" -d "$tmp/$lname" "$spec" 2>&1 | grep -v '^WARNING: Location' || true
        src=$(ls "$tmp/$lname"/"$(echo "$name" | tr '-' '_')"-"$ver"-*.whl)
        if [ "$lname" = sglang ]; then W slim "$src" "$dest"; else W slim-fi "$src" "$dest"; fi ;;
      *)
        "${PIP_DL[@]}" -d "$dest" "$spec" 2>&1 | grep -v '^WARNING: Location' || true ;;
    esac
    W have "$dest" "$name" "$ver" || { echo "ERROR: no wheel for $spec" >&2; exit 1; }
  done
  echo
  ls -1 "$dest"/*.whl
  du -sh "$dest"
}

WHAT=${1:-all}
case "$WHAT" in
  sglang) fetch bench/requirements.txt "$DEST" ;;
  flashinfer) fetch bench/requirements-flashinfer.txt "$DEST_FI" ;;
  all) fetch bench/requirements.txt "$DEST"; fetch bench/requirements-flashinfer.txt "$DEST_FI" ;;
  *) echo "usage: bash bench/fetch_wheels.sh [sglang|flashinfer|all]" >&2; exit 2 ;;
esac
