"""Filesystem locations (FlashInfer ``jit/env.py`` pattern). Nothing is written into the package.

- ``MLAGEN_CACHE_DIR`` (default ``~/.cache/mlagen``): registry.sqlite, built .so files, locks.
- ``MLAGEN_GENERATED_DIR`` (default ``<repo>/generated`` when running from a checkout, else
  ``<cache>/generated``): rendered sources and build.ninja files.

A variable that is set but empty counts as unset (``MLAGEN_CACHE_DIR=`` is the default cache, never
the current directory).
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
TEMPLATE_DIR = REPO_DIR / "templates"
INCLUDE_DIR = REPO_DIR / "include"


def env(name: str) -> str | None:
    """The environment variable ``name``, or None when it is unset or empty (whitespace only)."""
    value = os.environ.get(name)
    return value if value and value.strip() else None


def cache_dir() -> Path:
    """Root of mlagen's cache (env ``MLAGEN_CACHE_DIR``; a relative one is taken from the current directory and made
    absolute, so the module paths the registry and installed.json keep are valid from any directory)."""
    return Path(env("MLAGEN_CACHE_DIR") or Path.home() / ".cache" / "mlagen").expanduser().absolute()


def generated_dir() -> Path:
    """Where rendered sources and per-variant build.ninja files go (env ``MLAGEN_GENERATED_DIR``)."""
    env_dir = env("MLAGEN_GENERATED_DIR")
    if env_dir:
        return Path(env_dir).expanduser().absolute()  # ninja runs in this directory: relative paths would break
    if (REPO_DIR / "pyproject.toml").exists():
        return REPO_DIR / "generated"
    return cache_dir() / "generated"


def variant_dir(uri: str) -> Path:
    """Directory of one compiled module's rendered source, build.ninja, log and PTX under :func:`generated_dir`;
    the argument is its build key (:attr:`mlagen.spec.Variant.build_key`, shared by nsplit siblings), not a uri."""
    return generated_dir() / uri


def so_dir() -> Path:
    """Where built modules are installed (``<cache>/lib``, as ``<build_key>.<source hash[:16]><ext suffix>``)."""
    return cache_dir() / "lib"


def lock_dir() -> Path:
    """Lock files: one per module build (``<cache>/locks/<build_key>.lock``) and ``installed.json.lock``, which
    ``mlagen install`` / ``uninstall`` hold around their read and write of installed.json."""
    return cache_dir() / "locks"


def registry_path() -> Path:
    """The SQLite registry file (``<cache>/registry.sqlite``)."""
    return cache_dir() / "registry.sqlite"
