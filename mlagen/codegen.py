"""Render variants into CUDA sources: one jinja2 Environment (StrictUndefined), one render helper,
and files written only when their content changed so ninja stays incremental.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from pathlib import Path

import jinja2

from mlagen import __version__, owned, paths
from mlagen.spec import Variant
from mlagen.tables import MASKS, SCHEDULES, SMEM_LIMIT

MODULE_TEMPLATE = "mla_verify_module.cu.j2"


@functools.lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(paths.TEMPLATE_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )


def render(template: str, **context) -> str:
    """Render ``templates/<template>`` with ``context``; a missing variable raises jinja2.UndefinedError."""
    return _env().get_template(template).render(**context)


def template_context(v: Variant) -> dict:
    """The only values a template sees: ints and vetted tokens from :mod:`mlagen.tables`."""
    return dict(
        mlagen_version=__version__,
        uri=v.build_key,
        heads=int(v.heads),
        q_len=int(v.q_len),
        kv_lora_rank=int(v.kv_lora_rank),
        qk_rope_head_dim=int(v.qk_rope_head_dim),
        page_size=int(v.page_size),
        load_width=0 if v.load_width == "bulk" else int(v.load_width),  # 0 = bulk copies
        block_n=int(v.block_n),
        num_warps=int(v.num_warps),
        row_tiles=int(v.row_tiles),
        stages=int(v.stages),
        overlap=int(v.overlap),
        schedule=v.schedule if v.schedule in SCHEDULES else "rowblock",
        mask_cpp=MASKS[v.mask][0],
        smem_limit=min(SMEM_LIMIT[a] for a in v.archs),
        kv_fp8=int(v.dtype == "fp8_e4m3"),  # e4m3 KV cache (dimsplit, dimsplit_t; the feasibility filter enforces it)
    )


def render_variant(v: Variant, module_name: str | None = None) -> str:
    """CUDA source (pybind11 module) of variant ``v``, as module ``module_name`` (default its build_key)."""
    ctx = template_context(v)
    if module_name is not None:
        ctx["uri"] = module_name
    return render(MODULE_TEMPLATE, **ctx)


def headers_digest() -> str:
    """sha256 over every file under include/ (the kernel headers are part of each variant's source)."""
    h = hashlib.sha256()
    for p in sorted(f for f in paths.INCLUDE_DIR.rglob("*") if f.is_file()):
        h.update(p.relative_to(paths.INCLUDE_DIR).as_posix().encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def source_hash(source: str, flags: list[str], nvcc_version: str) -> str:
    """Cache key of a build: sha256 of rendered source + kernel headers + flags + ``nvcc_version`` (the builds pass
    :func:`mlagen.ninja_gen.toolchain_key`: nvcc's release line and its NVCC_* environment variables)."""
    h = hashlib.sha256()
    for part in (source, headers_digest(), "\0".join(flags), nvcc_version):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_if_changed(path: Path, text: str) -> bool:
    """Write ``text`` to ``path`` only if it differs from the current content. Returns True if written."""
    path = Path(path)
    try:
        if path.read_bytes() == text.encode():  # (bytes: a file that is not UTF-8 is simply different)
            return False
    except FileNotFoundError:
        pass
    owned.ensure_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")  # unique: concurrent writers
    with os.fdopen(fd, "w", encoding="utf-8") as f:  # (compared as UTF-8 bytes above and by the build)
        f.write(text)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; keep the usual mode for shared caches
    os.replace(tmp, path)
    return True
