"""Choose the fastest verified variant per shape bucket and record it as SGLang's installed state."""

from __future__ import annotations

import math
from pathlib import Path

from mlagen import __version__
from mlagen.registry import Registry
from mlagen.spec import Spec, Variant


class InstallError(ValueError):
    """Nothing suitable to install; the message says what to build or verify."""


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def entry_for(reg: Registry, uri: str, arch: str) -> dict:
    """Installed-state entry for ``uri`` (the fields of mlagen.sglang_plugin.installed's schema).

    Raises:
        InstallError: ``uri`` is not in the registry, was not compiled for ``arch``, has no passing verification
            of its registered source hash on ``arch`` (the latest one on ``arch`` counts), or its module file is
            missing.
    """
    row = reg.get_variant(uri)
    if row is None:
        raise InstallError(f"{uri}: unknown or unbuilt variant (see `mlagen list`); run `mlagen build SPEC` first")
    if arch not in row["archs"]:
        raise InstallError(f"{uri} was not compiled for {arch} (archs: {', '.join(row['archs'])})")
    ver = reg.last_verification(uri, row["source_hash"], arch)
    if ver is None:
        other = reg.last_verification(uri, row["source_hash"])
        if other is not None and other["passed"]:
            raise InstallError(f"{uri} was verified on {other['arch']}, but the server GPU is {arch}: "
                               f"run `mlagen verify` on an {arch} machine")
        raise InstallError(f"{uri} has no passing verification on {arch}; run `mlagen verify` on an {arch} GPU")
    if not ver["passed"]:
        raise InstallError(f"{uri} failed its latest verification on {arch} ({ver['device']}): see `mlagen show {uri}`")
    if not Path(row["so_path"]).is_file():
        raise InstallError(f"{uri}: its module {row['so_path']} is missing; run `mlagen build SPEC` again")
    v = Variant.from_dict(row["variant"])
    return dict(uri=uri, so_path=row["so_path"], role="decode" if v.q_len == 1 else "verify", heads=v.heads,
                q_len=v.q_len, page_size=v.page_size, kv_lora_rank=v.kv_lora_rank,
                qk_rope_head_dim=v.qk_rope_head_dim, mask=v.mask, nsplit=v.nsplit, bucket=v.bucket, kv_dtype=v.dtype)


def pick_fastest(reg: Registry, spec: Spec, arch: str) -> list[dict]:
    """Per bucket of ``spec``: the verified variant (on ``arch``) with the lowest geometric-mean
    benchmark time over the shapes every timed candidate of the bucket was timed at. Only benchmarks on
    ``arch`` of the registered source hash count; candidates without one are left out of the comparison. With
    no shape common to the timed candidates, the first timed one (spec order) is taken; with none timed, the
    first verified one.

    Only the spec's feasible variants count (those ``mlagen build`` builds: :func:`mlagen.feasibility.split_feasible`),
    so a bucket whose every variant is infeasible (e.g. an e4m3 KV cache with a schedule that has no e4m3 path) is
    left out, as ``mlagen build`` left it out.

    Raises:
        InstallError: a bucket with feasible variants has no verified variant on ``arch``, or the spec has no
            feasible variant at all.
    """
    from mlagen.feasibility import split_feasible

    feasible, _ = split_feasible(spec.variants())
    if not feasible:
        raise InstallError(f"no feasible variant in {spec.source} (see `mlagen generate {spec.source}`)")
    buckets: dict[str, list[Variant]] = {}
    for v in feasible:
        buckets.setdefault(v.bucket, []).append(v)
    chosen = []
    for bucket, vs in buckets.items():
        cands = []
        for v in vs:
            try:
                entry = entry_for(reg, v.uri, arch)
            except InstallError:
                continue
            src = reg.get_variant(v.uri)["source_hash"]
            times = {tuple(sorted(b["shape"].items())): b["median_us"] for b in reg.benchmarks(v.uri)
                     if b["arch"] == arch and b["source_hash"] == src}
            cands.append((v, entry, times))
        if not cands:
            raise InstallError(f"no variant of bucket {bucket} is verified on {arch}: run "
                               f"`mlagen build {spec.source}` on an {arch} GPU machine")
        timed = [c for c in cands if c[2]]
        common = set.intersection(*(set(t) for _, _, t in timed)) if timed else set()
        if common:
            best = min(timed, key=lambda c: _geomean([c[2][s] for s in common]))
        else:
            best = timed[0] if timed else cands[0]  # verified but never benchmarked: take the first
        chosen.append(best[1])
    return chosen


def merge_state(old: dict | None, entries: list[dict], arch: str) -> dict:
    """New installed state: ``entries`` replace old entries of the same bucket; other arch's state is dropped."""
    keep = [] if not old or old.get("arch") != arch else [
        e for e in old.get("entries", []) if e["bucket"] not in {n["bucket"] for n in entries}]
    return dict(mlagen_version=__version__, arch=arch, entries=keep + entries)
