"""Wheel helpers for bench/fetch_wheels.sh (pure python, no third-party imports).

    python3 bench/wheels.py have DEST NAME VER     exit 0 if exactly that one wheel of NAME is in DEST
    python3 bench/wheels.py clean DEST NAME        remove every wheel of NAME from DEST
    python3 bench/wheels.py slim SRC DEST          sglang: drop *.so and sglang/multimodal_gen/ (pure-python wheel)
    python3 bench/wheels.py slim-fi SRC DEST       flashinfer-python: keep only what the MLA paged kernels need
    python3 bench/wheels.py check-fi WHEEL         every file the MLA fa2/fa3 JIT sources include is in WHEEL

flashinfer-python 0.7.x is ~101 MB, 45 MB of it other operators' CUDA sources in flashinfer/data/csrc/
and ~8 MB more of .cu/.cuh/.h next to other operators' python. The MLA wrapper
(BatchMLAPagedAttentionWrapper, backends fa2 and fa3) JIT-compiles only
    data/csrc/batch_mla_{plan,run,binding}.cu          (fa2)
    data/csrc/batch_mla_sm90_{plan,run,binding}.cu     (fa3)
    data/csrc/batch_mla_config.jinja                   (both; rendered into the generated dir)
and whatever those include from the JIT include path (data/csrc, data/include, data/cutlass/..,
data/spdlog/include, data/cccl/.., plus tvm_ffi's own headers from the apache-tvm-ffi wheel).
``slim-fi`` keeps: every python file and every non-source file of the package (so ``import flashinfer``
and every lazily imported python module behave as in the full wheel), data/include, data/cutlass,
data/cccl and data/spdlog whole, and from data/csrc only the include closure of the files above.
It drops other operators' kernel sources (.cu .cuh .h .hpp .cpp .cc .c .inl .ptx) outside data/ and
the rest of data/csrc. RECORD is rewritten; the build tag ``1mla`` marks the repack.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import posixpath
import re
import sys
import zipfile

# --------------------------------------------------------------------------- names


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def wheels_of(dest: str, name: str) -> list[str]:
    """Wheel files in dest whose distribution name matches ``name``."""
    if not os.path.isdir(dest):
        return []
    return [f for f in sorted(os.listdir(dest)) if f.endswith(".whl") and norm(f.split("-")[0]) == norm(name)]


def cmd_have(dest: str, name: str, ver: str) -> None:
    fs = wheels_of(dest, name)
    sys.exit(0 if len(fs) == 1 and fs[0].split("-")[1] == ver else 1)


def cmd_clean(dest: str, name: str) -> None:
    for f in wheels_of(dest, name):
        print(f"  removing stale {f}")
        os.remove(os.path.join(dest, f))


# --------------------------------------------------------------------------- repack


def rec_hash(data: bytes) -> str:
    d = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(d).rstrip(b"=").decode()


def repack(src: str, dest: str, keep, build: str, pure: bool = False) -> str:
    """Write ``dest/<dist>-<ver>-<build>-<tag>.whl`` holding the members of ``src`` for which
    ``keep(name)`` is true (plus the dist-info), with RECORD rewritten. ``pure``: retag py3-none-any
    (the dropped members were the only platform-specific ones). Returns the output path."""
    base = os.path.basename(src)
    parts = base[:-4].split("-")
    dist, ver, tag = parts[0], parts[1], "-".join(parts[-3:])
    if pure:
        tag = "py3-none-any"
    out = os.path.join(dest, f"{dist}-{ver}-{build}-{tag}.whl")
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
            if info.is_dir() or not (n.startswith(di) or keep(n)):
                continue
            data = zin.read(n)
            if n == di + "WHEEL":
                lines = [ln for ln in data.decode().splitlines()
                         if not ln.startswith(("Root-Is-Purelib:", "Tag:", "Build:") if pure else ("Build:",))]
                if pure:
                    lines += ["Root-Is-Purelib: true", "Tag: py3-none-any"]
                lines += [f"Build: {build}"]
                data = ("\n".join(lines) + "\n").encode()
            zi = zipfile.ZipInfo(n, date_time=info.date_time)
            zi.external_attr = info.external_attr
            zi.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(zi, data)
            kept[n] = data
        assert record is not None, "no RECORD in " + src
        rows = []
        for row in csv.reader(io.StringIO(record)):
            if row and row[0] in kept:
                rows.append([row[0], rec_hash(kept[row[0]]), str(len(kept[row[0]]))])
        rows.append([di + "RECORD", "", ""])
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows(rows)
        zi = zipfile.ZipInfo(di + "RECORD", date_time=(2020, 1, 1, 0, 0, 0))
        zi.external_attr = 0o644 << 16
        zi.compress_type = zipfile.ZIP_DEFLATED
        zout.writestr(zi, buf.getvalue())
    os.replace(tmp_out, out)
    print(f"  {base} ({os.path.getsize(src) / 1e6:.1f} MB) -> "
          f"{os.path.basename(out)} ({os.path.getsize(out) / 1e6:.1f} MB, {len(kept)} files)")
    return out


SGL_DROP_PREFIXES = ("sglang/multimodal_gen/",)  # sglang/test/ stays: the GPU backend test uses its helpers


def cmd_slim(src: str, dest: str) -> None:
    """sglang: without its Rust/C extensions (*.so) and sglang/multimodal_gen/ -> py3-none-any."""
    repack(src, dest, lambda n: not (n.endswith(".so") or n.startswith(SGL_DROP_PREFIXES)), "1slim", pure=True)


# --------------------------------------------------------------------------- flashinfer (MLA only)

FI = "flashinfer/"
FI_DATA = FI + "data/"
FI_CSRC = FI_DATA + "csrc/"
#: JIT sources of BatchMLAPagedAttentionWrapper's fa2 and fa3 backends (flashinfer.jit.attention.modules.gen_batch_mla_module)
MLA_ROOTS = tuple(FI_CSRC + f for f in (
    "batch_mla_plan.cu", "batch_mla_run.cu", "batch_mla_binding.cu",
    "batch_mla_sm90_plan.cu", "batch_mla_sm90_run.cu", "batch_mla_sm90_binding.cu",
    "batch_mla_config.jinja"))
#: the JIT's include path inside the package (flashinfer.jit.cpp_ext.get_system_includes / get_cccl_includes)
FI_INCLUDE_DIRS = tuple(FI_DATA + d for d in (
    "csrc/", "include/", "cutlass/include/", "cutlass/tools/util/include/", "spdlog/include/",
    "cccl/cub/", "cccl/libcudacxx/include/", "cccl/thrust/"))
#: kept whole (header trees; the vendored CCCL takes precedence over the toolkit's, so never half of it)
FI_KEEP_TREES = tuple(FI_DATA + d for d in ("include/", "cutlass/", "cccl/", "spdlog/"))
KERNEL_SRC_EXT = (".cu", ".cuh", ".h", ".hpp", ".cpp", ".cc", ".c", ".inl", ".ptx")
#: generated per module next to the copied .cu files, not in the wheel
GENERATED = ("batch_mla_config.inc", "batch_mla_sm90_config.inc")

_INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', re.M)


def includes(text: str) -> list[str]:
    return _INCLUDE.findall(text)


def include_closure(names: set[str], read, roots=MLA_ROOTS, include_dirs=FI_INCLUDE_DIRS) -> tuple[set[str], set[str]]:
    """(members reached, includes not found in the wheel) from ``roots`` over ``#include``s, resolved as
    the JIT's compiler would: next to the including file (the generated dir holds copies of the csrc
    roots, so csrc/ for them), then each include dir. ``names``: the wheel's members; ``read(name)``: text."""
    seen, missing, todo = set(), set(), [r for r in roots if r in names]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for inc in includes(read(n)):
            if inc in GENERATED:
                continue
            cands = [posixpath.normpath(posixpath.join(posixpath.dirname(n), inc))] + [d + inc for d in include_dirs]
            hit = next((c for c in cands if c in names), None)
            if hit is None:
                missing.add(inc)
            elif hit not in seen:
                todo.append(hit)
    return seen, missing


def fi_keep_fn(closure: set[str]):
    """keep(name) for slim-fi: see the module docstring."""
    def keep(n: str) -> bool:
        if n.startswith(FI_CSRC):
            return n in closure
        if n.startswith(FI_DATA):
            return n.startswith(FI_KEEP_TREES) or not n.endswith(KERNEL_SRC_EXT)
        return not n.endswith(KERNEL_SRC_EXT)
    return keep


def _zip_reader(z: zipfile.ZipFile):
    return lambda n: z.read(n).decode("utf-8", "replace")


def cmd_slim_fi(src: str, dest: str) -> None:
    z = zipfile.ZipFile(src)
    names = set(z.namelist())
    missing_roots = [r for r in MLA_ROOTS if r not in names]
    if missing_roots:
        sys.exit(f"ERROR: {os.path.basename(src)} lacks the MLA JIT sources {missing_roots}: "
                 "gen_batch_mla_module changed; update MLA_ROOTS in bench/wheels.py")
    closure, _ = include_closure(names, _zip_reader(z))
    out = repack(src, dest, fi_keep_fn(closure), "1mla")
    csrc = sorted(n[len(FI_CSRC):] for n in closure if n.startswith(FI_CSRC))
    print(f"  kept from data/csrc: {' '.join(csrc)}")
    cmd_check_fi(out, src)


def cmd_check_fi(wheel: str, full: str | None = None) -> None:
    """The include closure of the MLA JIT sources in ``wheel``: every include that the full wheel
    (``full``, when given) resolves must resolve in ``wheel`` too. Prints what stays unresolved (toolkit,
    tvm_ffi and standard headers) and exits 1 on a file the trimmed wheel lost."""
    z = zipfile.ZipFile(wheel)
    names = set(z.namelist())
    lost = [r for r in MLA_ROOTS if r not in names]
    closure, missing = include_closure(names, _zip_reader(z))
    if full is not None:
        zf = zipfile.ZipFile(full)
        full_closure, _ = include_closure(set(zf.namelist()), _zip_reader(zf))
        lost += sorted(full_closure - closure)
    print(f"  MLA fa2/fa3 include closure: {len(closure)} files in the wheel; outside it (toolkit, tvm_ffi, "
          f"std): {len(missing)}: {' '.join(sorted(m for m in missing if '/' not in m)[:12])} ...")
    if lost:
        print(f"ERROR: the trimmed wheel lost {lost[:10]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    _CMDS = {"have": (cmd_have, (3,)), "clean": (cmd_clean, (2,)), "slim": (cmd_slim, (2,)),
             "slim-fi": (cmd_slim_fi, (2,)), "check-fi": (cmd_check_fi, (1, 2))}
    if len(sys.argv) < 2 or sys.argv[1] not in _CMDS or len(sys.argv) - 2 not in _CMDS[sys.argv[1]][1]:
        sys.exit("usage: python3 bench/wheels.py have DEST NAME VER | clean DEST NAME | slim SRC DEST | slim-fi SRC DEST"
                 " | check-fi WHEEL [FULL_WHEEL] (see the module docstring)")
    _CMDS[sys.argv[1]][0](*sys.argv[2:])
