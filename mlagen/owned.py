"""What mlagen wrote, so that ``mlagen clean`` deletes only that.

Every directory mlagen writes into holds a manifest, ``.mlagen-manifest``: one line per entry that
mlagen created directly in it (a file or directory name, or a glob for the outputs a tool writes under
names mlagen does not choose, e.g. nvcc's ``-keep`` files), and the line ``.`` when mlagen created the
directory itself. :func:`clean` deletes the listed files, descends only into listed directories that
carry a manifest of their own, then deletes the manifest, and the directory itself only when mlagen
created it and nothing else is left in it. Files mlagen did not record (anything a user put there)
are never touched; the one exception is a ``.mlagen-manifest.<pid>.tmp`` that a crash during :func:`forget`'s
rewrite left, a name only mlagen writes. Two limits: a file already present when mlagen would first record it is someone
else's and stays unrecorded (:func:`record`); and a glob line (nvcc's ``-keep`` files of one module in
that module's own ``keep/`` directory) covers whatever matches it in that mlagen-made directory.

Several processes (parallel builds sharing a cache, ``mlagen uninstall``, ``mlagen clean``) may use one
manifest at once. Each read holds ``flock(2)`` on the manifest's directory shared, each change exclusive
(the directory, not the manifest: a rewrite replaces the manifest atomically, and the lock outlives it).
A line already present is never written again, so commands that add nothing (``list``, a cached
``build``) also work on a cache they cannot write. A manifest that is not a regular file (a symlink, a
FIFO) is someone else's: it is neither read nor written, and what mlagen would have recorded in it stays
unrecorded (``clean`` leaves it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import os
import re
import stat
import sys
from pathlib import Path

from mlagen import paths

MANIFEST = ".mlagen-manifest"
_CREATED = "."
# forget()'s rewrite goes through "<MANIFEST>.<pid>.tmp": a name of mlagen's own, left only by a crash mid-rewrite.
_REWRITE_TMP = re.compile(re.escape(MANIFEST) + r"\.\d+\.tmp")
# Earlier versions recorded an interrupted module copy in lib/ ("<module><ext suffix>.tmp<pid>") by a glob,
# "*<ext suffix>.tmp*" or "*<ext suffix>.tmp[0-9]*"; both also match a user's "x<ext suffix>.tmp-notes". Such a
# line now covers only names that end in ".tmp" and digits. (The copies are recorded by their own name now.)
_LEGACY_TMP_GLOB = re.compile(r"\*([^*?\[\]/]*\.so)\.tmp(?:\*|\[0-9\]\*)")

_held_fds: set[int] = set()  # directory locks this process holds right now


def _close_held_in_child() -> None:  # a fork (without exec) while a lock is held must not keep it for the child
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)
    _held_fds.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def _roots() -> list[Path]:
    return [paths.cache_dir().resolve(), paths.generated_dir().resolve()]


def _under_roots(d: Path) -> bool:
    r = Path(d).resolve()
    return any(r == root or root in r.parents for root in _roots())


@contextlib.contextmanager
def _dir_locked(d: Path, *, exclusive: bool):
    """flock(2) on directory ``d`` (shared or exclusive) for the block. Raises FileNotFoundError /
    NotADirectoryError when ``d`` is not a directory."""
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    _held_fds.add(fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        if fd in _held_fds:  # (not in a child forked inside this block: the fork hook closed it there)
            _held_fds.discard(fd)
            os.close(fd)


def _read_lines(d: Path) -> list[str]:
    """The raw lines of ``d``'s manifest (the caller holds the directory lock); none when it is missing or not a
    regular file. Bytes that are not UTF-8 read as the file-system names they would be (surrogateescape)."""
    try:
        fd = os.open(d / MANIFEST, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):  # a symlink / FIFO / socket: someone else's
            return []
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return []
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read()
    finally:
        os.close(fd)
    return data.decode(sys.getfilesystemencoding(), "surrogateescape").splitlines()


def _parse(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(l.strip() for l in lines if l.strip() and not l.startswith("#")))


def _entries(d: Path) -> list[str]:
    try:
        with _dir_locked(Path(d), exclusive=False):
            return _parse(_read_lines(Path(d)))
    except (FileNotFoundError, NotADirectoryError):
        return []


def _names_entries(line: str) -> bool:
    """Whether a manifest line names entries of its directory (not ``.``, the manifest itself, or a path)."""
    return line not in (_CREATED, "..", MANIFEST) and "/" not in line


def _line_matches(line: str, name: str) -> bool:
    """Whether manifest ``line`` covers the entry ``name`` of its directory."""
    if line == name:
        return True
    if not _names_entries(line) or not any(c in line for c in "*?["):
        return False
    legacy = _LEGACY_TMP_GLOB.fullmatch(line)
    if legacy:
        return re.fullmatch(".*" + re.escape(legacy.group(1)) + r"\.tmp\d+", name) is not None
    return fnmatch.fnmatchcase(name, line)


def _append(d: Path, line: str) -> None:
    d = Path(d)
    if line in _entries(d):  # nothing to write: a read-only cache is fine
        return
    with _dir_locked(d, exclusive=True):
        if line in _parse(_read_lines(d)):
            return
        try:
            fd = os.open(d / MANIFEST, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENXIO):  # someone else's symlink / FIFO: record nothing
                return
            raise
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.write(fd, (line + "\n").encode(sys.getfilesystemencoding(), "surrogateescape"))
        finally:
            os.close(fd)


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
    return any(_line_matches(line, path.name) for line in _entries(path.parent))


class NotOwnedError(Exception):
    """A file mlagen would write exists and mlagen did not write it (see :func:`refuse_foreign`)."""


def refuse_foreign(paths_: list[Path], hint: str = "move it away") -> None:
    """Raise :class:`NotOwnedError` naming the first of ``paths_`` that exists and is not recorded as mlagen's (a
    user's file of a name mlagen writes): call it for every path a command will write, before the first write.

    Raises:
        NotOwnedError: such a file exists (one line: its path, and ``hint``).
    """
    for p in paths_:
        if os.path.lexists(p) and not is_recorded(p):
            raise NotOwnedError(f"{p} exists and was not written by mlagen: {hint}")


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
    name, someone else's, does not count as mlagen's. The manifest is rewritten to a temporary file and renamed
    over the old one (a crash leaves the old manifest whole) under the directory's exclusive lock, so a concurrent
    writer's line is never lost. Nothing is written when the name is not listed."""
    path = Path(path)
    d = path.parent
    if path.name not in _entries(d):
        return
    with _dir_locked(d, exclusive=True):
        lines = _read_lines(d)
        kept = [l for l in lines if l.strip() != path.name]
        if len(kept) == len(lines):
            return
        tmp = d / f"{MANIFEST}.{os.getpid()}.tmp"
        tmp.unlink(missing_ok=True)  # a name only mlagen uses (a crash of an earlier process with this pid)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with contextlib.suppress(OSError):  # keep the manifest's mode (e.g. group-writable in a shared cache)
            os.fchmod(fd, stat.S_IMODE(os.stat(d / MANIFEST).st_mode))
        with os.fdopen(fd, "wb") as f:
            f.write("".join(l + "\n" for l in kept).encode(sys.getfilesystemencoding(), "surrogateescape"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, d / MANIFEST)


def record_glob(directory: str | os.PathLike, pattern: str) -> None:
    """Note that a tool run by mlagen writes the files matching ``pattern`` (no '/') in ``directory``."""
    assert "/" not in pattern
    ensure_dir(directory)
    if _under_roots(Path(directory)):
        _append(Path(directory), pattern)


def _plan(d: Path) -> tuple[list[Path], bool]:
    """(paths mlagen wrote under ``d``, deepest first; whether ``d`` itself goes too)."""
    if d.is_symlink() or not (d / MANIFEST).is_file() or (d / MANIFEST).is_symlink():
        return [], False
    entries = _entries(d)
    created = _CREATED in entries
    out: list[Path] = []
    gone: set[str] = {MANIFEST}
    children = sorted(d.iterdir())
    for c in children:  # a rewrite's temporary file that a crash left (its name is mlagen's)
        if _REWRITE_TMP.fullmatch(c.name) and c.is_file() and not c.is_symlink():
            out.append(c)
            gone.add(c.name)
    for name in filter(_names_entries, entries):
        for p in [c for c in children if _line_matches(name, c.name)]:
            if p.is_symlink() or p.is_file():
                out.append(p)
                gone.add(p.name)
            elif p.is_dir():
                sub, sub_goes = _plan(p)
                out += sub
                if sub_goes:
                    gone.add(p.name)
    out.append(d / MANIFEST)
    goes = created and all(c.name in gone for c in children)
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


def _remove_manifest(m: Path) -> bool:
    """Delete manifest ``m`` under its directory's exclusive lock, unless a file it lists still exists (one that could
    not be deleted, or one a concurrent build recorded after the plan was made) or a directory it lists kept its own
    manifest (so a later clean still reaches what is left there). Returns whether it went."""
    d = m.parent
    with _dir_locked(d, exclusive=True):
        children = list(d.iterdir())
        for line in filter(_names_entries, _parse(_read_lines(d))):
            for c in children:
                if _line_matches(line, c.name) and (c.is_symlink() or c.is_file() or (c / MANIFEST).is_file()):
                    return False
        m.unlink()
        return True


def _remove_rewrite_tmp(p: Path) -> None:
    """Delete a :func:`forget` temporary file under its directory's exclusive lock: forget holds that lock for as long
    as its own temporary file exists, so one seen under the lock is a crash's leftover."""
    with _dir_locked(p.parent, exclusive=True):
        p.unlink()


def _remove_unless_held(p: Path) -> None:
    """Delete lock file ``p`` (a build's, filelock's flock) only while holding it: one a running build holds stays
    (OSError), since a later build would otherwise lock a new file of that name beside the running one."""
    fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError when held
        p.unlink()
    finally:
        os.close(fd)


def remove(planned: list[Path]) -> list[Path]:
    """Delete the paths of a :func:`plan` in order (directories only when empty, manifests only when every file they
    list is gone). Returns what went."""
    removed = []
    for p in planned:
        try:
            if p.name == MANIFEST and not p.is_symlink():
                if not _remove_manifest(p):
                    continue
            elif _REWRITE_TMP.fullmatch(p.name):
                _remove_rewrite_tmp(p)
            elif p.name.endswith(".lock") and p.is_file() and not p.is_symlink():
                _remove_unless_held(p)
            elif p.is_dir() and not p.is_symlink():
                p.rmdir()  # empty by construction; a file added meanwhile keeps it (OSError below)
            else:
                p.unlink()
        except OSError:  # gone already, or a directory that is not empty (someone else's file): keep it
            continue
        removed.append(p)
    return removed
