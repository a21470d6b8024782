"""GPU test (pytest -m gpu): the fused metadata kernel (``VerifyKernel.fill_metadata``,
include/mlagen/mla_verify_metadata.cuh) against the torch helpers of mlagen/sglang_plugin/metadata.py,
bit for bit, on random batches: page_size 1 / 4 / 64, seq_lens and req_pool_indices int32 / int64,
no tree / causal / QLEN_ONLY / FULL_MASK, q_len 1 / 9 / 64, with and without padded rows, bs 1..33.
Outputs start poisoned; bytes outside the written region (block-table columns >= npages, tree
columns >= q_len, rows >= bs) must keep the poison.

Builds (or reuses) one small variant for this GPU's arch; skips without CUDA.

    python3 -m pytest -q -m gpu tests/test_metadata_gpu.py
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

from mlagen.sglang_plugin import metadata as md  # noqa: E402

POOL_ROWS = 40
POISON32 = 0x7F7F7F7F
POISON64 = -1
PAD_ROWS, PAD_COLS = 3, 5  # poisoned rows / columns past the written region
MODES = (None, "causal", "qlen_only", "full_mask")


@pytest.fixture(scope="module")
def kernel(gpu_arch):
    """One small built variant (fill_metadata does not depend on the variant's constants)."""
    from mlagen.build import build_variants
    from mlagen.ops import load_so

    built = build_variants(dict(name="metadata-gpu", heads_per_rank=8, q_len=9, page_size=1, nsplit=32,
                                load_width=128, mask="tree", arch=[gpu_arch]))
    k = load_so(built[0].uri, str(built[0].so_path))
    assert k.has_fill_metadata, f"{built[0].uri} was built without fill_metadata"
    return k


def _reference(out, seq_lens, rpi, r2t, *, extra, npad, npages, ps, q_len, mode, custom):
    """The backend's torch path (MlagenAttnBackend._prepare before the fused kernel) into ``out``."""
    kv, table, tree = out
    bs = seq_lens.shape[0]
    real = bs - npad
    md.fill_kv_lens(kv, seq_lens, extra, npad)
    md.fill_block_table(table, r2t, rpi, md.page_columns(r2t.shape[1], ps, r2t.device)[:npages], ps)
    if mode == "causal":
        tree[:bs, :q_len].copy_(md.causal_bits(q_len, r2t.device).expand(bs, q_len))
    elif mode is not None:
        if real > 0:
            packed = (md.pack_qlen_mask(custom, real, q_len) if mode == "qlen_only"
                      else md.pack_full_mask(custom, seq_lens[:real], q_len))
            tree[:real, :q_len].copy_(packed)
        if npad > 0:
            tree[real:bs, :q_len].zero_()


def _case(gen, ps, mode, q_len, len_dtype, rpi_dtype, padded):
    """Random inputs of one case (on the GPU)."""
    dev = "cuda"
    full_pages = int(torch.randint(1, {1: 3000, 4: 600, 64: 40}[ps] + 1, (1,), generator=gen))
    width = full_pages * ps
    bs = int(torch.randint(1, 34, (1,), generator=gen))
    npad = int(torch.randint(1, bs + 1, (1,), generator=gen)) if padded else 0
    real = bs - npad
    # any int32 slot ids, negatives included: page id = floor(slot / page_size), as torch rounds
    r2t = torch.randint(-2**31, 2**31 - 1, (POOL_ROWS, width + int(torch.randint(0, 3, (1,), generator=gen))),
                        generator=gen, dtype=torch.int64).to(torch.int32)
    r2t = r2t.to(dev)[:, :width]  # a row stride past the width (sliced on the device: .to would compact it)
    lens = torch.randint(0, width + 1, (bs,), generator=gen)
    lens[real:] = 1  # SGLang's padded rows
    rpi = torch.randint(0, POOL_ROWS, (bs,), generator=gen)
    rpi[real:] = 0
    npages = int(torch.randint(0, full_pages + 1, (1,), generator=gen))
    extra = q_len if int(torch.randint(0, 2, (1,), generator=gen)) else 0
    custom = None
    if mode in ("qlen_only", "full_mask"):
        cells = real * q_len * q_len if mode == "qlen_only" else int(((lens[:real] + q_len) * q_len).sum())
        cells += int(torch.randint(0, 50, (1,), generator=gen))  # a tail the layout does not cover
        raw = torch.randint(0, 256, (cells,), generator=gen, dtype=torch.int64)
        raw[torch.rand(cells, generator=gen) < 0.5] = 0
        custom = raw.to(torch.uint8) if int(torch.randint(0, 2, (1,), generator=gen)) else raw.bool()
        custom = custom.to(dev)
    return dict(seq_lens=lens.to(len_dtype).to(dev), rpi=rpi.to(rpi_dtype).to(dev), r2t=r2t, extra=extra,
                npad=npad, npages=npages, ps=ps, q_len=q_len, mode=mode, custom=custom)


def _poisoned(bs, npages, q_len):
    dev = "cuda"
    return (torch.full((bs + PAD_ROWS,), POISON32, dtype=torch.int32, device=dev),
            torch.full((bs + PAD_ROWS, npages + PAD_COLS), POISON32, dtype=torch.int32, device=dev),
            torch.full((bs + PAD_ROWS, q_len + PAD_COLS), POISON64, dtype=torch.int64, device=dev))


@pytest.mark.parametrize("mode", MODES, ids=[str(m) for m in MODES])
@pytest.mark.parametrize("ps", [1, 4, 64])
def test_fill_metadata_matches_torch_helpers(kernel, ps, mode):
    seed = 1000 * ps + MODES.index(mode)
    n = 0
    for q_len in (1, 9, 64):
        for len_dtype in (torch.int32, torch.int64):
            for rpi_dtype in (torch.int32, torch.int64):
                for padded in (False, True):
                    for rep in range(2):
                        gen = torch.Generator().manual_seed(seed)
                        seed += 7919
                        c = _case(gen, ps, mode, q_len, len_dtype, rpi_dtype, padded)
                        bs = c["seq_lens"].shape[0]
                        want, got = _poisoned(bs, c["npages"], q_len), _poisoned(bs, c["npages"], q_len)
                        _reference(want, c["seq_lens"], c["rpi"], c["r2t"], extra=c["extra"], npad=c["npad"],
                                   npages=c["npages"], ps=ps, q_len=q_len, mode=mode, custom=c["custom"])
                        stream = torch.cuda.current_stream()
                        if rep:  # the second repetition on a side stream
                            stream = torch.cuda.Stream()
                            stream.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(stream):  # the launch follows the current stream
                            kernel.fill_metadata(got[0], got[1], c["seq_lens"], c["rpi"], c["r2t"], extra=c["extra"],
                                                 num_padding=c["npad"], npages=c["npages"], page_size=ps, q_len=q_len,
                                                 tree_mask=got[2] if mode else None, tree_mode=mode,
                                                 custom_mask=c["custom"])
                        torch.cuda.synchronize()
                        what = (f"ps={ps} mode={mode} q_len={q_len} bs={bs} npad={c['npad']} npages={c['npages']} "
                                f"seq_lens {len_dtype} rpi {rpi_dtype} extra={c['extra']}")
                        for name, w, g in zip(("kv_lens", "block_table", "tree_mask"), want, got):
                            assert torch.equal(w, g), f"{name} differs: {what}\n{(w != g).nonzero()[:8].tolist()}"
                        kv, table, tree = got
                        assert (kv[bs:] == POISON32).all(), what
                        assert (table[bs:] == POISON32).all() and (table[:, c["npages"]:] == POISON32).all(), what
                        assert (tree[bs:] == POISON64).all() and (tree[:, q_len:] == POISON64).all(), what
                        if mode is None:
                            assert (tree == POISON64).all(), what
                        n += 1
    assert n == 3 * 2 * 2 * 2 * 2


def test_fill_metadata_errors(kernel):
    """The cheap checks: dtypes, devices, sizes against the buffers, the tree mode, and a QLEN_ONLY mask too small for
    the real rows (the message of pack_qlen_mask); nothing is written."""
    dev = "cuda"
    bs, q_len = 3, 9
    kv, table, tree = _poisoned(bs, 4, q_len)
    lens = torch.full((bs,), 5, dtype=torch.int64, device=dev)
    rpi = torch.zeros(bs, dtype=torch.int64, device=dev)
    r2t = torch.zeros(2, 16, dtype=torch.int32, device=dev)
    kw = dict(extra=q_len, num_padding=1, npages=4, page_size=1, q_len=q_len)
    with pytest.raises(ValueError, match="QLEN_ONLY verify mask has 161 elements, 162 needed for 2 requests"):
        kernel.fill_metadata(kv, table, lens, rpi, r2t, tree_mask=tree, tree_mode="qlen_only",
                             custom_mask=torch.ones(161, dtype=torch.bool, device=dev), **kw)
    with pytest.raises(ValueError, match="tree_mode must be one of"):
        kernel.fill_metadata(kv, table, lens, rpi, r2t, tree_mask=tree, tree_mode="tree", **kw)
    with pytest.raises(ValueError, match="needs a contiguous bool/uint8 custom_mask"):
        kernel.fill_metadata(kv, table, lens, rpi, r2t, tree_mask=tree, tree_mode="full_mask",
                             custom_mask=torch.ones(500, dtype=torch.float32, device=dev), **kw)
    with pytest.raises(ValueError, match="seq_lens and req_pool_indices must be int32 or int64"):
        kernel.fill_metadata(kv, table, lens.float(), rpi, r2t, **kw)
    with pytest.raises(ValueError, match="kv_lens, block_table and req_to_token must be int32"):
        kernel.fill_metadata(kv.long(), table, lens, rpi, r2t, **kw)
    with pytest.raises(ValueError, match=r"num_padding must be an int in \[0, 3\]"):
        kernel.fill_metadata(kv, table, lens, rpi, r2t, **dict(kw, num_padding=bs + 1))
    with pytest.raises(ValueError, match=rf"npages must be an int in \[0, {4 + PAD_COLS}\]"):  # the table's columns
        kernel.fill_metadata(kv, table, lens, rpi, r2t, **dict(kw, npages=5 + PAD_COLS))
    with pytest.raises(ValueError, match="all tensors must be on a CUDA device"):
        kernel.fill_metadata(kv, table, lens.cpu(), rpi, r2t, **kw)
    torch.cuda.synchronize()
    assert (kv == POISON32).all() and (table == POISON32).all() and (tree == POISON64).all()
