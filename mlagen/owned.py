"""What mlagen wrote, so that ``mlagen clean`` deletes only that.

Every directory mlagen writes into holds a manifest, ``.mlagen-manifest``: one line per entry that
mlagen created directly in it (a file or directory name, or a glob for the outputs a tool writes under
names mlagen does not choose, e.g. nvcc's ``-keep`` files), and the line ``.`` when mlagen created the
directory itself. :func:`clean` deletes the listed files, descends only into listed directories that
carry a manifest of their own, then deletes the manifest, and the directory itself only when mlagen
created it and nothing else is left in it. Files mlagen did not record (anything a user put there)
are never touched. Two limits: a file already present when mlagen would first record it is someone
else's and stays unrecorded (:func:`record`); and a glob line (nvcc's ``-keep`` files of one module in
that module's own ``keep/`` directory, an interrupted copy's ``*.cpython-*.so.tmp<pid>`` in ``lib/``)
covers whatever matches it in those mlagen-made directories.

Several processes (parallel builds sharing a cache, ``mlagen uninstall``) may write one manifest at once:
every read and write holds ``flock(2)`` on the manifest itself (shared to read, exclusive to add or drop
a line), so an append and a rewrite never interleave and no process ever reads a half-written file.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob as _glob
import os
from pathlib import Path

from mlagen import paths

MANIFEST = ".mlagen-manifest"
_CREATED = "."
# Glob lines that earlier mlagen versions wrote, and the narrower pattern each stands for now: "*.so.tmp*" (an
# interrupted module copy in lib/) would also have matched a user's "x.so.tmp-notes"; the copies are always
# "<module><python ext suffix>.tmp<pid>".
_LEGACY_GLOBS = {"*.so.tmp*": "*.cpython-*.so.tmp[0-9]*"}


def _roots() -> list[Path]:
    return [paths.cache_dir().resolve(), paths.generated_dir().resolve()]


def _under_roots(d: Path) -> bool:
    r = Path(d).resolve()
    return any(r == root or root in r.parents for root in _roots())


@contextlib.contextmanager
def _locked(manifest: Path, mode: str):
    """``manifest`` opened with ``mode`` under flock(2): shared for "r", exclusive otherwise (released on close)."""
    with open(manifest, mode) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH if mode == "r" else fcntl.LOCK_EX)
        yield f


def _parse(text: str) -> list[str]:
    lines = (l.strip() for l in text.splitlines() if l.strip() and not l.startswith("#"))
    return list(dict.fromkeys(_LEGACY_GLOBS.get(l, l) for l in lines))


def _entries(d: Path) -> list[str]:
    try:
        with _locked(Path(d) / MANIFEST, "r") as f:
            return _parse(f.read())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _append(d: Path, line: str) -> None:
    with _locked(Path(d) / MANIFEST, "a+") as f:  # the check and the write under one exclusive lock
        f.seek(0)
        if line not in _parse(f.read()):
            f.write(line + "\n")  # O_APPEND: at the end whatever the read position


def ensure_dir(d: str | os.PathLike) -> Path:
    """``mkdir -p d``, recording every directory this creates at or below mlagen's cache / generated
    roots (a manifest with ``.`` in it, and its name in the parent's manifest)."""
    d = Path(d)
    if d.is_dir():
        return d
    missing = []
    p = d
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    d.mkdir(parents=True, exist_ok=True)
    for new in reversed(missing):  # top-down
        if not _under_roots(new):
            continue  # above the roots (e.g. ~/.cache): create, but leave no manifest there
        _append(new, _CREATED)
        if _under_roots(new.parent):
            _append(new.parent, new.name)
    return d


def is_recorded(path: str | os.PathLike) -> bool:
    """Whether ``path``'s directory manifest lists it (by name, or by a glob line that matches it)."""
    path = Path(path)
    for line in _entries(path.parent):
        if line == path.name or (_glob.has_magic(line) and line not in (_CREATED, MANIFEST)
                                 and "/" not in line and path.match(line)):
            return True
    return False


def record(path: str | os.PathLike, *, written: bool = False) -> Path:
    """Note that mlagen is about to write ``path`` (a file, or a directory made by :func:`ensure_dir`) in its
    directory's manifest; a no-op outside the cache and generated roots. Call it before the write: a path that
    already exists and is not recorded is someone else's (e.g. a user's file of the same name), so it stays out of
    the manifest and ``mlagen clean`` never deletes it. ``written=True``: mlagen has just written the whole file
    (e.g. an installed.json of its own format that it rewrote), which is then recorded as mlagen's whatever was
    there before. Returns ``path``."""
    path = Path(path)
    ensure_dir(path.parent)
    if _under_roots(path.parent) and (written or not (os.path.lexists(path) and not is_recorded(path))):
        _append(path.parent, path.name)
    return path


def forget(path: str | os.PathLike) -> None:
    """Drop ``path``'s own line from its directory's manifest (mlagen deleted the file), so a later file of that
    name, someone else's, does not count as mlagen's."""
    path = Path(path)
    try:
        with _locked(path.parent / MANIFEST, "r+") as f:  # rewritten in place: other writers wait on the lock
            lines = f.read().splitlines()
            kept = [l for l in lines if l.strip() != path.name]
            if len(kept) != len(lines):
                f.seek(0)
                f.write("".join(l + "\n" for l in kept))
                f.truncate()
    except (FileNotFoundError, NotADirectoryError):
        return


def record_glob(directory: str | os.PathLike, pattern: str) -> None:
    """Note that a tool run by mlagen writes the files matching ``pattern`` (no '/') in ``directory``."""
    assert "/" not in pattern
    ensure_dir(directory)
    if _under_roots(Path(directory)):
        _append(Path(directory), pattern)


def _plan(d: Path) -> tuple[list[Path], bool]:
    """(paths mlagen wrote under ``d``, deepest first; whether ``d`` itself goes too)."""
    if d.is_symlink() or not (d / MANIFEST).is_file():
        return [], False
    entries = _entries(d)
    created = _CREATED in entries
    out: list[Path] = []
    gone: set[str] = {MANIFEST}
    for name in entries:
        if name == _CREATED or "/" in name or name in ("..", MANIFEST):
            continue
        for p in sorted(d.glob(name)) if _glob.has_magic(name) else [d / name]:
            if p.is_symlink() or p.is_file():
                out.append(p)
                gone.add(p.name)
            elif p.is_dir():
                sub, sub_goes = _plan(p)
                out += sub
                if sub_goes:
                    gone.add(p.name)
    out.append(d / MANIFEST)
    goes = created and all(c.name in gone for c in d.iterdir())
    if goes:
        out.append(d)
    return out, goes


def plan(root: str | os.PathLike) -> list[Path]:
    """What :func:`clean` would delete under ``root`` (files first, then directories). A root that is a symlink (e.g.
    ``~/.cache/mlagen`` pointing at a larger disk) is followed; symlinks below it are not."""
    return _plan(Path(root).resolve() if Path(root).is_symlink() else Path(root))[0]


def clean(root: str | os.PathLike) -> list[Path]:
    """Delete what mlagen recorded under ``root`` (see the module doc). Returns what went."""
    return remove(plan(root))


def remove(planned: list[Path]) -> list[Path]:
    """Delete the paths of a :func:`plan` in order (directories only when empty). Returns what went."""
    removed = []
    for p in planned:
        try:
            if p.is_dir() and not p.is_symlink():
                p.rmdir()  # empty by construction; a file added meanwhile keeps it (OSError below)
            else:
                p.unlink()
        except OSError:  # gone already, or a directory that is not empty (someone else's file): keep it
            continue
        removed.append(p)
    return removed
