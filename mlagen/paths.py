"""Filesystem locations (FlashInfer ``jit/env.py`` pattern). Nothing is written into the package.

- ``MLAGEN_CACHE_DIR`` (default ``~/.cache/mlagen``): registry.sqlite, built .so files, locks.
- ``MLAGEN_GENERATED_DIR`` (default ``<repo>/generated`` when running from a checkout, else
  ``<cache>/generated``): rendered sources and build.ninja files.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
TEMPLATE_DIR = REPO_DIR / "templates"
INCLUDE_DIR = REPO_DIR / "include"


def cache_dir() -> Path:
    """Root of mlagen's cache (env ``MLAGEN_CACHE_DIR``)."""
    return Path(os.environ.get("MLAGEN_CACHE_DIR", Path.home() / ".cache" / "mlagen")).expanduser()


def generated_dir() -> Path:
    """Where rendered sources and per-variant build.ninja files go (env ``MLAGEN_GENERATED_DIR``)."""
    env = os.environ.get("MLAGEN_GENERATED_DIR")
    if env:
        return Path(env).expanduser()
    if (REPO_DIR / "pyproject.toml").exists():
        return REPO_DIR / "generated"
    return cache_dir() / "generated"


def variant_dir(uri: str) -> Path:
    return generated_dir() / uri


def so_dir() -> Path:
    return cache_dir() / "lib"


def lock_dir() -> Path:
    return cache_dir() / "locks"


def registry_path() -> Path:
    return cache_dir() / "registry.sqlite"
