import os

import pytest


def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_arch():
    """mlagen's arch name for this machine's GPU ("sm_90" / "sm_120"); the test is skipped on other GPUs."""
    import torch

    major, _ = torch.cuda.get_device_capability()
    arch = {9: "sm_90", 12: "sm_120"}.get(major)
    if arch is None:
        pytest.skip(f"no mlagen arch for compute capability {torch.cuda.get_device_capability()}")
    return arch


@pytest.fixture(scope="session")
def build_native(gpu_arch):
    """``build_native(spec_dict)`` -> [BuiltVariant]: the spec's variants that are feasible on its archs (the default
    sm_120 + sm_90, so the same set a CPU build selects), each compiled for this GPU's arch only. A GPU test runs that
    arch's code and no other, so it need not wait for nvcc's pass for the other arch; the sm_120 fit of every variant
    is still decided on the spec's archs, and every ``mlagen build`` and the CPU build tests check it on sm_120 code.

    Raises:
        mlagen.build.BuildError: a selected variant failed to build (as ``build_variants``).
    """
    import dataclasses

    from mlagen.build import build_variants
    from mlagen.feasibility import split_feasible
    from mlagen.spec import parse_spec

    def build(spec: dict):
        feasible, _ = split_feasible(parse_spec(spec).variants())
        assert feasible, f"spec {spec.get('name')} has no feasible variant"
        uris = ",".join(dataclasses.replace(v, archs=(gpu_arch,)).uri for v in feasible)
        return build_variants(dict(spec, arch=[gpu_arch]), kernels=uris)

    return build


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    """Fresh MLAGEN_CACHE_DIR / MLAGEN_GENERATED_DIR under tmp_path."""
    monkeypatch.setenv("MLAGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MLAGEN_GENERATED_DIR", str(tmp_path / "generated"))
    return tmp_path


@pytest.fixture(scope="session")
def built_small(tmp_path_factory):
    """One real compiled variant (sm_120 + sm_90) in a session-scoped cache; fails loudly."""
    from mlagen.build import build
    from mlagen.spec import parse_spec

    root = tmp_path_factory.mktemp("mlagen_build")
    old = {k: os.environ.get(k) for k in ("MLAGEN_CACHE_DIR", "MLAGEN_GENERATED_DIR")}
    os.environ["MLAGEN_CACHE_DIR"] = str(root / "cache")
    os.environ["MLAGEN_GENERATED_DIR"] = str(root / "generated")
    try:
        spec = parse_spec(dict(name="ci", heads_per_rank=8, q_len=9, page_size=1, nsplit=[32, "auto"],
                               load_width=128, mask="tree", arch=["sm_120", "sm_90"]))
        rep = build(spec, jobs=2)
        assert not rep.failed, rep.failed
        assert len(rep.built) == 2
        yield dict(root=root, report=rep, spec=spec)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
