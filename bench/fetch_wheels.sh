#!/usr/bin/env bash
# Download the wheels listed in bench/requirements.txt into .whl/ (gitignored)
# for the GPU machine: CPython 3.12, manylinux x86_64, --no-deps (each needed
# dependency is listed explicitly in requirements.txt; one version each).
#
# sglang itself (39 MB, 46 MB of it Rust .so files nobody here imports) is
# repacked into .whl/sglang-<ver>-1slim-py3-none-any.whl without *.so,
# sglang/multimodal_gen/; RECORD is rewritten to match.
# Because the repacked wheel is pure python it also installs on the local
# Python (3.11) for the import check.
#
# Run from anywhere:   bash bench/fetch_wheels.sh
# Then on the device:  python3 -m pip install -q --no-index --no-deps --no-compile \
#     --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Env overrides: WHL_DIR (default .whl), PYVER (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."

REQ=bench/requirements.txt
DEST=${WHL_DIR:-.whl}
PYVER=${PYVER:-3.12}
mkdir -p "$DEST"

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

# --- helpers (python: wheel-name normalisation, slim repack) ---------------
cat >"$tmp/whl.py" <<'PY'
import base64, csv, hashlib, io, os, re, sys, zipfile

def norm(name):
    return re.sub(r"[-_.]+", "_", name).lower()

def wheels_of(dest, name):
    """Wheel files in dest whose distribution name matches `name`."""
    out = []
    for f in sorted(os.listdir(dest)):
        if f.endswith(".whl") and norm(f.split("-")[0]) == norm(name):
            out.append(f)
    return out

def cmd_have(dest, name, ver):
    # exit 0 if exactly one wheel of that name/version is present
    fs = wheels_of(dest, name)
    sys.exit(0 if len(fs) == 1 and fs[0].split("-")[1] == ver else 1)

def cmd_clean(dest, name):
    for f in wheels_of(dest, name):
        print(f"  removing stale {f}")
        os.remove(os.path.join(dest, f))

DROP_PREFIXES = ("sglang/multimodal_gen/",)  # sglang/test/ stays: the GPU backend test uses its helpers

def keep(n):
    return not (n.endswith(".so") or n.startswith(DROP_PREFIXES))

def rec_hash(data):
    d = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(d).rstrip(b"=").decode()

def cmd_slim(src, dest):
    base = os.path.basename(src)
    dist, ver = base.split("-")[:2]
    build = "1slim"
    out = os.path.join(dest, f"{dist}-{ver}-{build}-py3-none-any.whl")
    di = f"{dist}-{ver}.dist-info/"
    zin = zipfile.ZipFile(src)
    kept, record = {}, None
    tmp_out = out + ".part"
    with zipfile.ZipFile(tmp_out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            n = info.filename
            if n == di + "RECORD":
                record = zin.read(n).decode()
                continue
            if info.is_dir() or not keep(n):
                continue
            data = zin.read(n)
            if n == di + "WHEEL":
                lines = [l for l in data.decode().splitlines()
                         if not l.startswith(("Root-Is-Purelib:", "Tag:", "Build:"))]
                lines += ["Root-Is-Purelib: true", "Tag: py3-none-any", f"Build: {build}"]
                data = ("\n".join(lines) + "\n").encode()
            zi = zipfile.ZipInfo(n, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, data)
            kept[n] = data
        assert record is not None, "no RECORD in " + src
        rows = []
        for row in csv.reader(io.StringIO(record)):
            if not row:
                continue
            p = row[0]
            if p in kept:
                rows.append([p, rec_hash(kept[p]), str(len(kept[p]))])
        rows.append([di + "RECORD", "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zi = zipfile.ZipInfo(di + "RECORD", date_time=(2020, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, buf.getvalue())
    os.replace(tmp_out, out)
    print(f"  {base} ({os.path.getsize(src)/1e6:.1f} MB) -> "
          f"{os.path.basename(out)} ({os.path.getsize(out)/1e6:.1f} MB, {len(kept)} files)")

if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"have": cmd_have, "clean": cmd_clean, "slim": cmd_slim}[cmd](*args)
PY
W() { python3 "$tmp/whl.py" "$@"; }

# --- main ----------------------------------------------------------------
mapfile -t SPECS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$REQ" | grep -v '^$')
for spec in "${SPECS[@]}"; do
  name=${spec%%==*}
  ver=${spec#*==}
  if W have "$DEST" "$name" "$ver"; then
    echo "have $spec"
    continue
  fi
  echo "fetch $spec"
  W clean "$DEST" "$name"
  if [ "$(echo "$name" | tr 'A-Z' 'a-z')" = sglang ]; then
    "${PIP_DL[@]}" -d "$tmp/sgl" "$spec" 2>&1 | grep -v '^WARNING: Location' || true
    src=$(ls "$tmp"/sgl/sglang-"$ver"-*.whl)
    W slim "$src" "$DEST"
  else
    "${PIP_DL[@]}" -d "$DEST" "$spec" 2>&1 | grep -v '^WARNING: Location' || true
    W have "$DEST" "$name" "$ver" || { echo "ERROR: no wheel for $spec" >&2; exit 1; }
  fi
done

echo
ls -1 "$DEST"/*.whl
du -sh "$DEST"
