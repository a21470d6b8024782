"""Parse ``nvcc -Xptxas -v`` reports and scan PTX for instructions sm_120 lacks."""

from __future__ import annotations

import re
from pathlib import Path

FORBIDDEN_PTX = ("wgmma", "tcgen05", "setmaxnreg")

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, dict[str, dict[str, int]]]:
    """Per arch, per kernel entry: registers, static smem bytes, stack frame, spill stores/loads.

    Returns ``{"sm_120": {"<mangled kernel>": {"registers": 158, "smem_static": 0, "stack": 0,
    "spill_stores": 0, "spill_loads": 0}}}``.
    """
    out: dict[str, dict[str, dict[str, int]]] = {}
    cur = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            cur = out.setdefault(m.group(2), {}).setdefault(
                m.group(1), dict(registers=0, smem_static=0, stack=0, spill_stores=0, spill_loads=0)
            )
            continue
        if cur is None:
            continue
        m = _PROPS.search(line)
        if m:
            cur["stack"], cur["spill_stores"], cur["spill_loads"] = map(int, m.groups())
            continue
        m = _USED.search(line)
        if m:
            cur["registers"] = int(m.group(1))
            if m.group(2):
                cur["smem_static"] = int(m.group(2))
    return out


# Kernels launched with the variant's dynamic shared memory (include/mlagen/mla_verify_launch.cuh: partial_kernel):
# the partial kernel of each schedule. The combine and metadata kernels use static shared memory only.
DYNAMIC_SMEM_KERNELS = ("mla_verify_partial_kernel", "mla_verify_dimsplit_kernel", "mla_verify_dimsplit_t_kernel")


def summarize(report: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """Per arch: the maximum over kernels of registers, static smem, stack and spill bytes, and
    ``smem_static_partial``: the largest static smem of a kernel that also takes the dynamic bytes
    (DYNAMIC_SMEM_KERNELS), so a block's total is that plus the dynamic size, not the other kernels' static smem."""
    out = {}
    for arch, kernels in report.items():
        s = dict(registers=0, smem_static=0, stack=0, spill_stores=0, spill_loads=0)
        partial = 0
        for name, r in kernels.items():
            for k in s:
                s[k] = max(s[k], r[k])
            if any(tag in name for tag in DYNAMIC_SMEM_KERNELS):
                partial = max(partial, r["smem_static"])
        out[arch] = dict(s, smem_static_partial=partial)
    return out


def block_smem(summary: dict[str, int], dynamic: int) -> int:
    """Shared memory per block of the largest launch of one arch's module: the partial kernel's static + dynamic bytes,
    or another kernel's static bytes when larger (``summary``: one arch of :func:`summarize`)."""
    return max(summary["smem_static_partial"] + dynamic, summary["smem_static"])


def forbidden_in_ptx(ptx_text: str) -> list[str]:
    """Forbidden opcodes (wgmma, tcgen05, setmaxnreg) that appear as instructions in ``ptx_text``, and
    ".multicast" on any instruction (sm_120 has clusters but no hardware multicast: ptxas emulates
    cp.async.bulk .multicast::cluster with a software call there)."""
    found = []
    for op in FORBIDDEN_PTX:
        if re.search(rf"^\s*(?:@!?%\w+\s+)?{op}\b", ptx_text, flags=re.MULTILINE):
            found.append(op)
    if re.search(r"^\s*(?:@!?%\w+\s+)?[a-z][\w.:]*\.multicast\b", ptx_text, flags=re.MULTILINE):
        found.append(".multicast")
    return found


def scan_ptx_files(files: list[Path]) -> dict[str, list[str]]:
    """Map each PTX file name to the forbidden opcodes it contains (empty lists when clean)."""
    return {Path(f).name: forbidden_in_ptx(Path(f).read_text()) for f in files}
