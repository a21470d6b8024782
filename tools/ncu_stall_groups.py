"""Group an ncu source-level profile by execution count (CPU; no GPU needed).

    ncu --section SourceCounters --section WarpStateStats --export R ... python3 tools/device_profile.py URI CTX BS
    ncu --import R.ncu-rep --page source --print-source sass --csv > R.csv
    python3 tools/ncu_stall_groups.py R.csv [--top 10] [--group EXECUTIONS]

In a warp-specialized kernel every role runs its own loop, so the instructions of one role's loop share one
execution count (warps x CTAs x iterations): grouping the per-instruction warp-state samples by that count splits
the kernel's time by role without reading the SASS. Prints a markdown table (execution count, instructions, samples,
share, the top stall reasons) and the samples of each mbarrier wait (SYNCS.PHASECHK.TRYWAIT and the spin branch
after it) by its shared-memory offset. Used for bench/results/h200-ncu-stalls-dimsplit-t-64k-v15.txt.
With --group, one role's loop (the instructions of that execution count) by SASS opcode (samples and top stall
reasons per opcode, then its most-sampled instructions with their offsets): bench/results/h200-ncu-*-v20*.txt.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import sys


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    """(header, instruction rows) of ncu's ``--page source --print-source sass --csv`` output (plain or .gz)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise SystemExit(f"{path}: no 'Address' header row (expected ncu --page source --print-source sass --csv)")
    return rows[start], rows[start + 1:]


def _num(r: list[str], i: int) -> int:
    """Column ``i`` of row ``r`` as an int (empty cells count 0)."""
    return int(float(r[i] or 0))


def main() -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=10, help="groups to print (largest share first); with --group also "
                    "the number of its most-sampled instructions listed")
    ap.add_argument("--group", type=int, metavar="EXECUTIONS",
                    help="also break down the instructions of this execution count by SASS opcode")
    a = ap.parse_args()
    try:
        hdr, data = read_rows(a.csv)
    except OSError as e:
        ap.error(f"cannot read {a.csv}: {e.strerror}")
    col = {h: i for i, h in enumerate(hdr)}
    for need in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"):
        if need not in col:
            sys.exit(f"{a.csv}: column {need!r} missing (profile with --section SourceCounters)")
    src, smp, exe = col["Source"], col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    stalls = [(i, h[len("stall_"):]) for i, h in enumerate(hdr) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(_num(r, smp) for r in data)
    groups = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for r in data:
        g = groups[_num(r, exe)]
        g[0] += _num(r, smp)
        g[1] += 1
        for i, name in stalls:
            g[2][name] += _num(r, i)
    print(f"{total} warp-state samples, {len(data)} instructions\n")
    print("| executions | instructions | samples | share | top stall reasons |")
    print("|---|---|---|---|---|")
    for ex, (s, n, c) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:a.top]:
        reasons = ", ".join(f"{k} {v}" for k, v in c.most_common(4) if v)
        print(f"| {ex} | {n} | {s} | {100 * s / max(total, 1):.1f}% | {reasons} |")
    print("\nmbarrier waits (samples of the try-wait and its spin branch, by barrier operand):")
    waits = collections.Counter()
    for k, r in enumerate(data):
        if "TRYWAIT" not in r[src]:
            continue
        operand = r[src].split("[", 1)[1].split("]", 1)[0] if "[" in r[src] else "?"
        s = _num(r, smp)
        for nxt in data[k + 1:k + 8]:  # the spin branch follows within a few instructions
            if "BRA" in nxt[src]:
                s += _num(nxt, smp)
                break
        waits[(_num(r, exe), operand)] += s
    for (ex, operand), s in waits.most_common():
        if s:
            print(f"  executions {ex:>8d}  [{operand}]  {s} samples ({100 * s / max(total, 1):.1f}%)")
    if a.group is not None:
        print_group(a.group, data, col, stalls, a.top, groups[a.group][2] if a.group in groups else None)
    return 0


def print_group(ex: int, data: list[list[str]], col: dict[str, int], stalls: list[tuple[int, str]], top: int,
                reasons: collections.Counter | None) -> None:
    """The instructions executed ``ex`` times (one role's loop): their samples per stall reason (``reasons``, the
    group's totals main() already summed), then by SASS opcode (the mnemonic before its first '.', predicate
    stripped) count, samples and top stall reasons, then the ``top`` most-sampled instructions, each with its offset
    from the group's first instruction."""
    src, smp, exe = col["Source"], col["Warp Stall Sampling (All Samples)"], col["Instructions Executed"]
    rows = [r for r in data if _num(r, exe) == ex]
    if not rows or reasons is None:
        print(f"\nno instructions executed {ex} times")
        return
    base = int(rows[0][col["Address"]], 16)
    by_op = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for r in rows:
        words = r[src].split()
        op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else words[0] if words else "?")
        o = by_op[op.split(".")[0]]
        o[0] += 1
        o[1] += _num(r, smp)
        for i, name in stalls:
            o[2][name] += _num(r, i)
    group_total = sum(_num(r, smp) for r in rows)
    print(f"\nexecution count {ex}: {len(rows)} instructions, {group_total} samples; stall reasons: "
          + ", ".join(f"{k} {v}" for k, v in reasons.most_common() if v))
    print("by opcode:")
    print("| opcode | instructions | samples | share | top stall reasons |")
    print("|---|---|---|---|---|")
    for op, (n, s, c) in sorted(by_op.items(), key=lambda kv: -kv[1][1]):
        top4 = ", ".join(f"{k} {v}" for k, v in c.most_common(4) if v)
        print(f"| {op} | {n} | {s} | {100 * s / max(group_total, 1):.1f}% | {top4} |")
    print("\nmost-sampled instructions (offset from the group's first instruction):")
    for r in sorted(rows, key=lambda r: -_num(r, smp))[:top]:
        why = ", ".join(f"{name} {_num(r, i)}" for i, name in stalls if _num(r, i))
        print(f"  +0x{int(r[col['Address']], 16) - base:05x}  {_num(r, smp):5d}  {r[src].strip()[:60]:60s}  {why}")


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head: the reader has what it asked for
        sys.stderr.close()
        sys.exit(0)
