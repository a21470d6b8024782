"""Installed state: which built variants the SGLang backend may load.

The state lives in one JSON file, ``$MLAGEN_CACHE_DIR/installed.json`` (default cache dir
``~/.cache/mlagen``)::

    {"mlagen_version": "0.1.0", "arch": "sm_90",
     "entries": [{"uri": "...", "so_path": "/abs/path.so", "role": "verify",
                  "heads": 16, "q_len": 9, "page_size": 64, "kv_lora_rank": 512,
                  "qk_rope_head_dim": 64, "mask": "tree", "nsplit": "auto",
                  "bucket": "h16_q9_kv512_rope64_ps64_tree_bf16"}]}

``role`` is ``"verify"`` (TARGET_VERIFY, q_len = max draft tokens) or ``"decode"`` (plain decode,
q_len = 1). Only the standard library is used here, so the CLI and the CPU tests can import it
without torch or SGLang.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

STATE_FILE = "installed.json"
ARCHS = ("sm_90", "sm_120")
ROLES = ("verify", "decode")
MASKS = ("tree", "causal", "none")
KV_DTYPES = ("bf16", "fp8_e4m3")  # the variant's KV cache dtype (entries written before it existed: bf16)
_INT_FIELDS = ("heads", "q_len", "page_size", "kv_lora_rank", "qk_rope_head_dim")
_STR_FIELDS = ("uri", "so_path", "bucket")


class InstalledStateError(ValueError):
    """installed.json exists but is not valid JSON or does not follow the schema."""


from mlagen.paths import cache_dir  # noqa: E402  (stdlib-only module: no torch / SGLang import)


def installed_path() -> Path:
    """Path of the installed-state file (may not exist)."""
    return cache_dir() / STATE_FILE


def empty_state(mlagen_version: str = "", arch: str = "sm_90") -> dict:
    """A valid state with no entries."""
    return {"mlagen_version": mlagen_version, "arch": arch, "entries": []}


def validate_entry(entry: Any, where: str = "entry") -> dict:
    """Check one entry against the schema and return it as a plain dict.

    Raises:
        InstalledStateError: a field is missing, has the wrong type, or an unknown value.
    """
    if not isinstance(entry, dict):
        raise InstalledStateError(f"{where}: must be an object, got {type(entry).__name__}")
    for k in _STR_FIELDS:
        if not isinstance(entry.get(k), str) or not entry[k]:
            raise InstalledStateError(f"{where}: field {k!r} must be a non-empty string")
    for k in _INT_FIELDS:
        v = entry.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise InstalledStateError(f"{where}: field {k!r} must be a positive int, got {v!r}")
    if entry.get("role") not in ROLES:
        raise InstalledStateError(f"{where}: role must be one of {ROLES}, got {entry.get('role')!r}")
    if entry.get("mask") not in MASKS:
        raise InstalledStateError(f"{where}: mask must be one of {MASKS}, got {entry.get('mask')!r}")
    ns = entry.get("nsplit")
    if not (ns == "auto" or (isinstance(ns, int) and not isinstance(ns, bool) and ns > 0)):
        raise InstalledStateError(f"{where}: nsplit must be a positive int or 'auto', got {ns!r}")
    if entry["role"] == "decode" and entry["q_len"] != 1:
        raise InstalledStateError(f"{where}: a decode entry must have q_len 1, got {entry['q_len']}")
    kv_dtype = entry.get("kv_dtype", "bf16")
    if kv_dtype not in KV_DTYPES:
        raise InstalledStateError(f"{where}: kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return dict(entry)


def validate_state(state: Any) -> dict:
    """Check a whole state object; returns a normalized copy.

    Raises:
        InstalledStateError: wrong top-level shape, unknown arch, bad entry, or a duplicated uri.
    """
    if not isinstance(state, dict):
        raise InstalledStateError(f"installed state must be an object, got {type(state).__name__}")
    if not isinstance(state.get("mlagen_version"), str):
        raise InstalledStateError("installed state: 'mlagen_version' must be a string")
    if state.get("arch") not in ARCHS:
        raise InstalledStateError(f"installed state: 'arch' must be one of {ARCHS}, got {state.get('arch')!r}")
    entries = state.get("entries")
    if not isinstance(entries, list):
        raise InstalledStateError("installed state: 'entries' must be a list")
    out, seen = [], set()
    for i, e in enumerate(entries):
        e = validate_entry(e, where=f"entries[{i}]")
        if e["uri"] in seen:
            raise InstalledStateError(f"entries[{i}]: uri {e['uri']!r} is listed twice")
        seen.add(e["uri"])
        out.append(e)
    return {"mlagen_version": state["mlagen_version"], "arch": state["arch"], "entries": out}


def read_installed(path: str | os.PathLike | None = None) -> dict | None:
    """Read and validate the installed state.

    Returns:
        The state dict, or None when the file does not exist.
    Raises:
        InstalledStateError: the file exists but is not a regular file, not UTF-8 JSON (or nested too deeply), or not
            of the schema.
    """
    p = Path(path) if path is not None else installed_path()
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):  # a FIFO would block the read, a directory fail it
            raise InstalledStateError(f"{p}: not a regular file, so not an mlagen installed state")
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise InstalledStateError(f"{p}: not UTF-8 text, so not an mlagen installed state") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InstalledStateError(f"{p}: not valid JSON ({e}); run `mlagen uninstall` and install again") from e
    except RecursionError:
        raise InstalledStateError(f"{p}: JSON nested too deeply, so not an mlagen installed state") from None
    try:
        return validate_state(data)
    except InstalledStateError as e:
        raise InstalledStateError(f"{p}: {e}") from None


def write_installed(state: dict, path: str | os.PathLike | None = None) -> Path:
    """Validate ``state`` and write it atomically (temp file in the same dir + ``os.replace``).

    Returns:
        The path written.
    Raises:
        InstalledStateError: ``state`` does not follow the schema (nothing is written).
    """
    state = validate_state(state)
    p = Path(path) if path is not None else installed_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".installed.", suffix=".tmp", dir=str(p.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(state, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return p


def clear_installed(path: str | os.PathLike | None = None) -> bool:
    """Remove the installed-state file when it is mlagen's: recorded as written by mlagen (mlagen.owned's manifest),
    or else readable as an installed state (e.g. one copied from another machine). Its name then leaves the manifest,
    so a later file of that name, someone else's, is not taken for mlagen's.

    Returns:
        True when a file was removed, False when there was none.
    Raises:
        InstalledStateError: the file is someone else's (not recorded and not an installed state); it stays.
    """
    from mlagen import owned  # stdlib-only, as this module

    p = Path(path) if path is not None else installed_path()
    if os.path.lexists(p) and not owned.is_recorded(p):
        try:
            read_installed(p)
        except InstalledStateError:
            raise InstalledStateError(f"{p} was not written by mlagen and is not an mlagen installed state: left in "
                                      "place (move it away to uninstall)") from None
    try:
        p.unlink()
        removed = True
    except FileNotFoundError:
        removed = False
    owned.forget(p)
    return removed
