"""CPU tests of tools/sass_issue.py: the control-bit decoding, the loop finder and the single-warp issue model, on
cuobjdump-format text built here with known control bits (random per run), and, when nvcc and cuobjdump are
present, on a real variant's SASS."""

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import sass_issue  # noqa: E402


def _line(addr: int, text: str, stall: int = 1, wbar: int = 7, rbar: int = 7, wait: int = 0, yld: int = 1) -> str:
    hi = (stall << 41) | (yld << 45) | (wbar << 46) | (rbar << 49) | (wait << 52) | 0xFFF
    return (f"        /*{addr:04x}*/                   {text} ;   /* 0x000000000000720c */\n"
            f"                                          /* {hi:#018x} */\n")


def _function(name: str, body: list[tuple]) -> str:
    return f"\t\tFunction : {name}\n" + "".join(_line(16 * k, *row) for k, row in enumerate(body))


def test_control_bits_decode_as_written():
    rng = random.Random()
    rows = [("HMMA.16816.F32.BF16 R4, R8, R12, R4", rng.randint(0, 15), rng.randint(0, 7), rng.randint(0, 7),
             rng.randint(0, 63), rng.randint(0, 1)) for _ in range(12)]
    text = _function("other_kernel", [("NOP", 1)]) + _function("my_partial_kernel", rows)
    ins = sass_issue.parse_sass(text, "partial_kernel")
    assert len(ins) == len(rows)
    for x, (t, stall, wbar, rbar, wait, yld) in zip(ins, rows):
        assert (x["op"], x["stall"], x["wbar"], x["rbar"], x["wait"], x["yield_"]) == \
            ("HMMA.16816.F32.BF16", stall, wbar, rbar, wait, yld)


def test_loops_skip_retry_branches_past_exit_and_keep_the_innermost():
    n = random.randint(20, 30)  # HMMA in the loop
    body = [("LDSM.16.M88.4 R8, [R2]", 2, 0)] + [("HMMA.16816.F32.BF16 R4, R8, R12, R4", 6, 7, 7, 1)] * n
    loop_end = len(body)
    body += [("@P0 BRA 0x0", 5), ("EXIT", 5), ("@!P1 BRA 0x10", 5)]  # the loop; then a retry stub past EXIT
    ins = sass_issue.parse_sass(_function("k_partial_kernel", body), "partial_kernel")
    found = sass_issue.loops(ins, min_hmma=n)
    assert found == [(0, loop_end)]
    assert sass_issue.loops(ins, min_hmma=n + 1) == []
    s = sass_issue.summary(ins[0:loop_end + 1])
    assert (s["hmma"], s["ldsm"], s["ldsm_bytes"]) == (n, 1, 512)


def test_outside_loops_counts_what_no_loop_holds():
    """Neither the hot loop, nor the loop around it, nor a loop without HMMA (a producer's copies) is code run once."""
    rng = random.Random()
    n, calls, stores = rng.randint(20, 30), rng.randint(1, 4), rng.randint(2, 9)
    pro = [("LDG.E R2, desc[UR4][R6.64]", 1)] * 3
    loop = [("HMMA.16816.F32.BF16 R4, R8, R12, R4", 6)] * n
    outer0 = len(pro)  # the outer loop: one LDG, the hot loop, its back branch
    body = pro + [("LDG.E R3, desc[UR4][R8.64]", 1)] + loop + [(f"@P0 BRA {16 * (outer0 + 1):#x}", 5)]
    body += [(f"@P1 BRA {16 * outer0:#x}", 5)]
    copy0 = len(body)  # a loop of global copies, no HMMA
    body += [("LDG.E R9, desc[UR4][R10.64]", 1), ("STG.E desc[UR4][R12.64], R9", 1), (f"@P2 BRA {16 * copy0:#x}", 5)]
    body += [("BSSY B0, 0x1000", 1), ("CALL.REL.NOINC 0x2000", 1)] * calls + [("STG.E desc[UR4][R2.64], R5", 1)] * stores
    body += [("EXIT", 5)]
    ins = sass_issue.parse_sass(_function("k_partial_kernel", body), "partial_kernel")
    assert sass_issue.loops(ins, min_hmma=n) == [(outer0 + 1, outer0 + 1 + n)]
    once = len(pro) + 2 * calls + stores + 1
    assert sass_issue.outside_loops(ins) == dict(instructions=once, call=calls, bssy=calls, stg=stores, ldg=3)


def test_issue_model_adds_stalls_and_scoreboard_waits():
    lat = sass_issue.LATENCY["LDSM"]
    # LDSM sets scoreboard 0 (stall 2); the first HMMA waits on it; then n HMMA at stall 6 each
    n = random.randint(3, 9)
    body = [("LDSM.16.M88.4 R8, [R2]", 2, 0)] + [("HMMA.16816.F32.BF16 R4, R8, R12, R4", 6, 7, 7, 1)] + \
        [("HMMA.16816.F32.BF16 R4, R8, R12, R4", 6)] * (n - 1)
    ins = sass_issue.parse_sass(_function("k_partial_kernel", body), "partial_kernel")
    assert sass_issue.issue_model(ins) == lat + 6 * n
    # without the wait the HMMA issue right after the LDSM's stall
    ins[1]["wait"] = 0
    assert sass_issue.issue_model(ins) == 2 + 6 * n


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"), reason="no nvcc")
def test_real_variant_has_the_score_and_output_loops():
    """The shipped q_len 9 dimsplit_t tile's sm_90 SASS: an output-warp loop of 72 HMMA and a score-warp loop of 108."""
    try:
        cuobjdump = sass_issue.cuobjdump_path()
    except SystemExit:
        pytest.skip("no cuobjdump next to nvcc or on PATH")
    uri = "mla_verify_h8_q9_kv512_rope64_ps1_nsauto_lw128_bn32_w8_rt3_st4_dimsplit_t_tree_bf16_sm120_sm90"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "sass_issue.py"), uri, "--cuobjdump", cuobjdump],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [ln.split("|")[1:-1] for ln in r.stdout.splitlines() if ln.startswith("| 0x")]
    hmma = sorted(int(c[2]) for c in rows)
    assert 72 in hmma and 108 in hmma, r.stdout


def test_skipped_blocks_are_forward_predicated_branches_over_enough_instructions():
    """A predicated forward branch over a block of m instructions is listed when m >= min_len; an unpredicated one,
    a backward one, a short one and one whose target lies outside the iteration are not; the path past the block
    counts the iteration without it."""
    rng = random.Random()
    m, short = rng.randint(20, 40), rng.randint(2, 5)
    head = [("LDS.128 R4, [R2]", 1), ("LOP3.LUT P0, RZ, R4, R5, R6, 0xfe, !PT", 13)]
    k_branch = len(head)
    target = k_branch + 1 + m
    body = head + [(f"@!P0 BRA {16 * target:#x}", 5)] + [("FMUL R8, R8, R9", 1)] * m
    k_short = len(body)
    body += [(f"@P1 BRA {16 * (k_short + 1 + short):#x}", 5)] + [("FADD R1, R1, R2", 1)] * short
    body += [(f"BRA {16 * (len(body) + 1 + m):#x}", 5)] + [("FMUL R8, R8, R9", 1)] * m  # unpredicated
    body += [("@P2 BRA 0x99990", 5)]  # target outside the function body
    body += [("HMMA.16816.F32.BF16 R4, R8, R12, R4", 6)] * 3 + [("@P3 BRA 0x0", 5)]  # the loop's back branch
    ins = sass_issue.parse_sass(_function("k_partial_kernel", body), "partial_kernel")
    assert sass_issue.skipped_blocks(ins, m) == [(k_branch, target)]
    assert sass_issue.skipped_blocks(ins, short) == [(k_branch, target), (k_short, k_short + 1 + short)]
    assert sass_issue.skipped_blocks(ins, m + 1) == []
    past = ins[:k_branch + 1] + ins[target:]
    assert len(past) == len(ins) - m and not any(x["op"] == "FMUL" for x in past[:k_branch + 1])
