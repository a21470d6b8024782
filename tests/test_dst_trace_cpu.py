"""CPU tests of tools/dst_trace.py: the MLAGEN_DST_TRACE lines (the format printed by
include/mlagen/mla_verify_dimsplit_t.cuh) parsed and averaged per role, on random lines made here."""

import math
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

dst_trace = pytest.importorskip("dst_trace")


def _line(cta, warp, role, sub, cycles, ns, before, after, wait):
    return (f"dst_trace cta {cta} warp {warp} role {role} sub {sub} cycles {cycles} ns {ns} before {before} "
            f"after {after} wait {wait[0]} {wait[1]} {wait[2]} {wait[3]}")


def _role(warp):  # a dimsplit_t CTA of 3 score warps: warps 3-6 output, 7 the producer (bf16 trace builds)
    return "score" if warp < 3 else "output" if warp < 7 else "producer"


def _launch(rng, sub):
    rows, lines = [], ["some other output line"]
    for cta in (0, 1):
        for warp in range(8):
            role = _role(warp)
            before, after = rng.randrange(100, 5000), rng.randrange(100, 5000)
            wait = [rng.randrange(0, 200 * sub) for _ in range(4)]
            cycles = before + after + sum(wait) + rng.randrange(500 * sub, 3000 * sub)
            ns = cycles * 1000 // rng.randrange(1500, 2000)
            rows.append(dict(role=role, sub=sub, cycles=cycles, ns=ns, before=before, after=after, wait=wait))
            lines.append(_line(cta, warp, role, sub, cycles, ns, before, after, wait))
    rng.shuffle(lines)
    return rows, "\n".join(lines) + "\n"


def test_parse_and_role_means_match_a_direct_computation():
    rng = random.Random()
    sub = rng.randrange(2, 200)
    made = [_launch(rng, sub) for _ in range(rng.randrange(2, 5))]
    launches = [dst_trace.parse(text) for _, text in made]
    assert [len(x) for x in launches] == [16] * len(made)
    out = {r["role"]: r for r in dst_trace.summarize(launches)}
    assert set(out) == {"score", "output", "producer"} and set(out) <= set(dst_trace.WAITS)
    for role, warps in (("score", 6), ("output", 8), ("producer", 2)):
        rows = [r for rows, _ in made[1:] for r in rows if r["role"] == role]  # the first launch is not averaged
        loop = sum((r["cycles"] - r["before"] - r["after"]) / sub for r in rows) / len(rows)
        waits = [sum(r["wait"][i] / sub for r in rows) / len(rows) for i in range(4)]
        ghz = sum(r["cycles"] / r["ns"] for r in rows) / len(rows)
        got = out[role]
        assert got["warps"] == warps and got["sub"] == pytest.approx(sub)
        assert got["loop"] == pytest.approx(loop)
        assert got["wait"] == pytest.approx(waits)
        assert got["busy"] == pytest.approx(loop - sum(waits))
        assert got["ghz"] == pytest.approx(ghz)
        assert got["before"] == pytest.approx(sum(r["before"] for r in rows) / len(rows))
    by_warp = {r["role"]: r for r in dst_trace.summarize(launches, per_warp=True)}
    assert set(by_warp) == {f"{_role(w)} warp {w}" for w in range(8)}
    assert all(r["warps"] == 2 for r in by_warp.values())  # both CTAs
    w5 = [r for rows, _ in made[1:] for r in rows[5::8]]  # warp 5 of each CTA (rows are made warp-major per CTA)
    assert by_warp["output warp 5"]["busy"] == pytest.approx(
        sum((r["cycles"] - r["before"] - r["after"] - sum(r["wait"])) / sub for r in w5) / len(w5))


def test_a_launch_without_trace_lines_is_an_error():
    rng = random.Random()
    good = dst_trace.parse(_launch(rng, 8)[1])
    with pytest.raises(ValueError, match="MLAGEN_DST_TRACE"):
        dst_trace.summarize([good, dst_trace.parse("no trace here\n")])
    with pytest.raises(ValueError):
        dst_trace.summarize([])


def test_timeline_from_stamped_lines_matches_a_direct_computation():
    """The launch timeline (perf-notes v35): per CTA, the earliest start and cluster-barrier stamps of its warps' lines
    (each warp reads the clocks itself; the lines come shuffled) and the last end of its warps; the score warps'
    Q-landed cycles; over the launches after the first. Lines without stamps anywhere give None, a launch without score
    lines a NaN Q-landed time."""
    rng = random.Random()
    assert dst_trace.timeline([dst_trace.parse(_launch(rng, 4)[1])] * 2) is None  # lines without stamps
    made, expect = [], []
    for _ in range(rng.randrange(2, 5)):
        lines, ctas, qs, s0s = [], {}, [], []
        t_launch = rng.randrange(10**9, 2 * 10**9)
        for split in range(rng.randrange(2, 9)):
            for cta in (0, 1):
                entry = t_launch + rng.randrange(0, 3000)
                t0 = entry + rng.randrange(200, 2000)
                ends = []
                for warp in range(7):  # each warp's own reads of the CTA's start and barrier: up to 40 ns later
                    end = t0 + rng.randrange(3000, 20000)
                    ends.append(end)
                    q = rng.randrange(500, 5000) if warp < 3 else 0
                    s0 = q + rng.randrange(0, 3000) if warp < 3 else 0
                    if warp < 3:
                        qs.append(q)
                        s0s.append(s0)
                    w_entry = entry + (0 if warp == 6 else rng.randrange(0, 40))
                    w_t0 = t0 + (0 if warp == 2 else rng.randrange(0, 40))
                    lines.append(_line(cta, warp, "score" if warp < 3 else "output", 3, 1000, 600, 10, 10, [1, 2, 3, 4])
                                 + f" split {split} entry {w_entry} t0 {w_t0} end {end} q {q} s0 {s0}")
                ctas[(split, cta)] = (entry, t0, max(ends))
        rng.shuffle(lines)
        made.append("\n".join(lines) + "\n")
        entries = [c[0] for c in ctas.values()]
        expect.append(dict(start_spread=max(entries) - min(entries),
                           to_barrier=sum(c[1] - c[0] for c in ctas.values()) / len(ctas),
                           cta_span=sum(c[2] - c[0] for c in ctas.values()) / len(ctas),
                           span=max(c[2] for c in ctas.values()) - min(entries), q_ready=sum(qs) / len(qs),
                           s0_ready=sum(s0s) / len(s0s)))
    got = dst_trace.timeline([dst_trace.parse(t) for t in made])
    for key in ("start_spread", "to_barrier", "cta_span", "span", "q_ready", "s0_ready"):
        assert got[key] == pytest.approx(sum(e[key] for e in expect[1:]) / len(expect[1:]))
    # one line without stamps among stamped ones: None (not a KeyError), whichever comes first
    stamped = dst_trace.parse(made[0])
    plain = dst_trace.parse(_launch(rng, 3)[1])
    assert dst_trace.timeline([stamped, stamped + plain[:1]]) is None
    assert dst_trace.timeline([stamped, plain[:1] + stamped]) is None
    outputs_only = [r for r in stamped if r["role"] == "output"]
    tl = dst_trace.timeline([outputs_only])
    assert tl is not None and math.isnan(tl["q_ready"]) and tl["span"] > 0
