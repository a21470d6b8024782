"""Test helper: the mlagen variant that serves each case of tests/test_sglang_backend_gpu.py, as a one-module spec
(so a case selection builds only the modules its cases need), and the case key of a built variant.

Run as a script, it compiles every case's module in one parallel build first (the test then finds them built):

    python3 tests/sglang_gpu_variants.py [--arch sm_90] [-j 16] [--only fp8_e4m3 --only 16 ...]
"""

from mlagen.feasibility import dimsplit_row_tiles, dimsplit_t_num_warps, dimsplit_t_row_tiles

H_LIST = (8, 16)
PAGE_SIZES = (1, 64)
Q_TREE, Q_CHAIN = 8, 4  # draft tokens of a tree (the variants' q_len) and of a chain (runtime q_len, causal mask)


def case_key(role: str, H: int, ps: int, mask: str, kv_fp8: bool = False, schedule: str | None = None) -> tuple:
    """(role, H, page_size, mask[, "fp8_e4m3"][, "dimsplit_t"]): role "verify" | "decode"; the suffixes mark an
    e4m3 pool's variant and a dimsplit_t one (none: bf16 rowblock, or dimsplit for an e4m3 pool)."""
    return (role, H, ps, mask) + (("fp8_e4m3",) if kv_fp8 else ()) + ((schedule,) if schedule == "dimsplit_t" else ())


def variant_key(v) -> tuple:
    """The :func:`case_key` a built ``mlagen.spec.Variant`` serves."""
    return case_key("decode" if v.q_len == 1 else "verify", v.heads, v.page_size, v.mask, v.dtype == "fp8_e4m3",
                    v.schedule)


def spec_for(key: tuple, arch: str) -> dict:
    """The spec (one variant, nsplit auto) that serves case ``key`` on ``arch`` ("sm_90" / "sm_120"): bf16 rowblock
    (block_n 16, 2 row tiles for verify, 1 for decode), e4m3 pools on dimsplit (a producer and two converter warps,
    3 stages), dimsplit_t (4 stages; e4m3: 2). Raises KeyError for a key no case uses."""
    role, H, ps, mask, *suffix = key
    if role not in ("verify", "decode") or any(s not in ("fp8_e4m3", "dimsplit_t") for s in suffix):
        raise KeyError(key)
    fp8, dst = "fp8_e4m3" in suffix, "dimsplit_t" in suffix
    q = Q_TREE if role == "verify" else 1
    base = dict(kernel="mla_verify", heads_per_rank=H, q_len=q, mask=mask, page_size=ps, nsplit="auto",
                load_width=128, dtype="fp8_e4m3" if fp8 else "bf16", arch=[arch])
    if dst:
        rt = dimsplit_t_row_tiles(H * q)
        return dict(base, name=f"sglang-gpu-dst{'-fp8' if fp8 else ''}-h{H}", block_n=32, stages=2 if fp8 else 4,
                    schedule="dimsplit_t", row_tiles=rt, num_warps=dimsplit_t_num_warps(rt))
    if fp8:
        rt = dimsplit_row_tiles(H * q)
        return dict(base, name=f"sglang-gpu-fp8-h{H}-q{q}", block_n=32, stages=3, schedule="dimsplit", row_tiles=rt,
                    num_warps=rt + 3)
    return dict(base, name=f"sglang-gpu-{role}", block_n=16, num_warps=8, stages=3, row_tiles=2 if role == "verify" else 1)


def gpu_case_keys() -> set:
    """The keys of every GPU case: bf16 verify (tree, chain = causal) and decode on rowblock; dimsplit_t verify (tree,
    chain) and decode (one score warp); e4m3 pools: dimsplit verify (tree) and decode, dimsplit_t verify (tree); the fp8-checkpoint and DP-padded
    cases use the H8 tree verify key."""
    keys = set()
    for H in H_LIST:
        for ps in PAGE_SIZES:
            keys |= {case_key("verify", H, ps, "tree"), case_key("verify", H, ps, "causal"),
                     case_key("decode", H, ps, "causal")}
            keys |= {case_key("verify", H, ps, m, schedule="dimsplit_t") for m in ("tree", "causal")}
            keys.add(case_key("decode", H, ps, "causal", schedule="dimsplit_t"))
            keys |= {case_key("verify", H, ps, "tree", kv_fp8=True), case_key("decode", H, ps, "causal", kv_fp8=True)}
            keys.add(case_key("verify", H, ps, "tree", kv_fp8=True, schedule="dimsplit_t"))
    return keys


class _UnionSpec:
    """The variants of several one-module specs as one spec for :func:`mlagen.build.build` (its name and variants)."""

    name = "sglang-gpu-cases"

    def __init__(self, specs):
        from mlagen.spec import parse_spec

        self._variants = [v for s in specs for v in parse_spec(s).variants()]

    def variants(self):
        return list(self._variants)


def prebuild_keys(only: tuple = ()) -> list:
    """The case keys :func:`prebuild` compiles: every one, or those holding every item of ``only``; sorted."""
    return sorted(k for k in gpu_case_keys() if all(x in k for x in only))


def prebuild(arch: str, jobs: int | None, only: tuple = ()) -> int:
    """Compile the GPU cases' modules for ``arch`` in one build of ``jobs`` parallel compiles: every case key's, or
    those of the keys holding every item of ``only`` (e.g. ("fp8_e4m3",), (16, 64)). Returns how many variants are
    built (cached ones included). Raises mlagen.build.BuildError when one fails."""
    from mlagen.build import BuildError, build

    rep = build(_UnionSpec([spec_for(k, arch) for k in prebuild_keys(only)]), jobs=jobs)
    if rep.failed:
        raise BuildError("; ".join(f"{v.uri}: {msg}" for v, msg in rep.failed))
    return len(rep.built)


ARCH_OF_MAJOR = {9: "sm_90", 12: "sm_120"}  # as tests/conftest.py's gpu_arch fixture maps a GPU to mlagen's arch


def main(argv=None) -> int:
    """``python3 tests/sglang_gpu_variants.py``: compile the GPU cases' modules (see the module docstring)."""
    import argparse

    ap = argparse.ArgumentParser(description="compile the modules of tests/test_sglang_backend_gpu.py's cases")
    ap.add_argument("--arch", choices=sorted(ARCH_OF_MAJOR.values()), help="default: the current GPU's")
    ap.add_argument("-j", "--jobs", type=int, default=None)
    ap.add_argument("--only", action="append", default=[],
                    help="build only the case keys holding this item (repeatable): verify / decode, a head count "
                         "(8, 16), a page size (1, 64), tree / causal, fp8_e4m3, dimsplit_t; e.g. --only fp8_e4m3 --only 16")
    a = ap.parse_args(argv)
    only = tuple(int(x) if x.isdigit() else x for x in a.only)
    if not prebuild_keys(only):
        items = sorted({str(x) for k in gpu_case_keys() for x in k})
        ap.error(f"no case key holds all of {list(a.only)}; items: {', '.join(items)}")
    arch = a.arch
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA GPU here: pass --arch")
        major, _ = torch.cuda.get_device_capability()
        if major not in ARCH_OF_MAJOR:
            ap.error(f"no mlagen arch for compute capability {major}.x")
        arch = ARCH_OF_MAJOR[major]
    print(f"built {prebuild(arch, a.jobs, only)} variants for {arch}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
