"""Building, caching and loading the C kernel library (private).

The kernels of ``csrc/*.c`` are compiled into one shared library on first use with the system
C compiler (``$CC`` or ``cc``; ``-O3 -fno-math-errno``, with ``-march=native`` and
``-fopenmp`` when accepted) into a cache directory (``$ATTNUQ_CACHE_DIR``; else
``$XDG_CACHE_HOME/attnuq`` or ``~/.cache/attnuq``, and a per-user temporary directory when that
is not writable). The file name is keyed by the sources and headers, the flags, the compiler's
version and the CPU, so a change of any of them builds a new library.

A library in the cache is code this process maps and runs, so it is only loaded when it is

* ours: the folder and the file belong to this user and nobody else may write to them
  (:func:`_unsafe`), and
* whole: its size and SHA-256 digest equal those recorded beside it (``<name>.sha256``)
  when it was built. A torn file (a build killed mid-write, a full disk, a copy cut short)
  would otherwise be mapped by ``dlopen`` and kill the process with SIGBUS when a page past its
  end is touched; it is rebuilt instead.

Both files are written under temporary names and renamed into place (atomic on POSIX): the
digest first, then the library. A reader that meets a library without its digest, or the
digest of another build (two processes building at once), rebuilds; it never loads a library
it could not verify. :mod:`attnuq.ops._native` declares the kernels' signatures on the loaded
library.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["CSRC", "SOURCES", "load_library"]

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("sample_rows.c", "levy.c", "fused.c", "levy_train.c")  # compiled into one library
# ATTNUQ_NATIVE_PORTABLE=1: build without AVX-512 (-mno-avx512f), i.e. the portable 8-lane path
# of the fused kernels, as an AVX2 machine runs it (for tests on an AVX-512 machine)
_PORTABLE_ENV = "ATTNUQ_NATIVE_PORTABLE"


def _cache_dirs() -> list[Path]:
    """``$ATTNUQ_CACHE_DIR`` alone when set; else the user cache (``$XDG_CACHE_HOME/attnuq`` or
    ``~/.cache/attnuq``) and, should it not be writable, a per-user temporary directory."""
    env = os.environ.get("ATTNUQ_CACHE_DIR")
    if env:
        return [Path(env)]
    xdg = os.environ.get("XDG_CACHE_HOME")
    user = getattr(os, "getuid", lambda: "user")()
    return [
        (Path(xdg) if xdg else Path.home() / ".cache") / "attnuq",
        Path(tempfile.gettempdir()) / f"attnuq-{user}",
    ]


def _cpu_id() -> str:
    """The CPU model and feature flags (``-march=native`` output depends on them)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _unsafe(path: Path) -> str | None:
    """Why ``path`` (a cache folder or a library in it) must not be used, or None.

    A shared library is code this process runs: one in a folder another user owns, or may
    write to, could have been put there by them. So the folder and the library must belong to
    this user and be writable by nobody else (on systems without ``os.getuid``, no check).
    """
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return None
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None  # not there yet: it will be created (or the write fails with a reason)
    except OSError as exc:
        return f"cannot inspect {path}: {exc}"
    if st.st_uid != getuid():
        return (f"refusing the kernel cache {path}: it is owned by uid {st.st_uid}, not by this "
                f"user (uid {getuid()}); set ATTNUQ_CACHE_DIR to a folder of your own")
    if st.st_mode & 0o022:
        return (f"refusing the kernel cache {path}: it is writable by group or others (mode "
                f"{st.st_mode & 0o777:o}); chmod go-w it or set ATTNUQ_CACHE_DIR")
    return None


def _digest_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _fingerprint(path: Path) -> str:
    """``"<size> <sha256>"`` of the file at ``path`` (read once)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            size += len(block)
    return f"{size} {h.hexdigest()}"


def verified(lib: Path) -> bool:
    """Whether ``lib`` exists and its size and digest equal those recorded beside it.

    Example
    -------
    >>> import tempfile
    >>> from pathlib import Path
    >>> from attnuq.ops import _build
    >>> d = Path(tempfile.mkdtemp())
    >>> so = d / "kernels-x.so"
    >>> _ = so.write_bytes(b"\\x7fELF...")
    >>> _build.verified(so)  # no digest recorded: not trusted
    False
    >>> _ = _build._digest_path(so).write_text(_build._fingerprint(so))
    >>> _build.verified(so)
    True
    >>> _ = so.write_bytes(b"\\x7fEL")  # torn
    >>> _build.verified(so)
    False
    >>> import shutil; shutil.rmtree(d)
    """
    try:
        recorded = _digest_path(lib).read_text(encoding="ascii").strip()
        return recorded == _fingerprint(lib)
    except (OSError, UnicodeDecodeError):
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile the kernels to ``out`` with their digest beside it (both written under temporary
    names and renamed into place); an error message, or None on success."""
    try:
        out.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write to the cache directory {out.parent}: {exc} (set ATTNUQ_CACHE_DIR)"
    try:
        proc = subprocess.run(
            [cc, *flags, "-shared", "-fPIC", "-o", tmp, *(str(CSRC / n) for n in SOURCES),
             "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            return f"{cc} {' '.join(flags)} failed: {proc.stderr.strip()[-500:]}"
        with open(tmp, "rb+") as f:  # on disk before it is published under its name
            os.fsync(f.fileno())
        # the digest of the new file, then the file: a reader between the two renames sees a
        # digest that does not match the old file and rebuilds
        _write_atomic(_digest_path(out), (_fingerprint(Path(tmp)) + "\n").encode("ascii"))
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc} could not run: {exc}"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _flag_sets() -> list[list[str]]:
    """Compiler flags to try, best first (``-fno-math-errno``: sqrt vectorises; the kernels
    never read errno)."""
    extra = ["-mno-avx512f"] if os.environ.get(_PORTABLE_ENV, "").strip() == "1" else []
    return [
        ["-O3", "-fno-math-errno", "-march=native", "-fopenmp", *extra],
        ["-O3", "-fno-math-errno", "-fopenmp", *extra],
        ["-O3", "-fno-math-errno", "-march=native", *extra],
        ["-O3", "-fno-math-errno", *extra],
    ]


def load_library() -> tuple[ctypes.CDLL | None, str]:
    """``(library, reason)``: the kernel library, built or taken from the cache and loaded,
    with the compiler line and path; or None and why not (``ATTNUQ_NATIVE=0``, no compiler,
    every cache folder refused, ...). Signatures are not declared here."""
    if os.environ.get("ATTNUQ_NATIVE", "1").strip() == "0":
        return None, "disabled by ATTNUQ_NATIVE=0"
    missing = [n for n in SOURCES if not (CSRC / n).is_file()]
    if missing:
        return None, f"kernel source missing: {', '.join(str(CSRC / n) for n in missing)}"
    # the key covers every source and header of csrc/
    text = "\0".join(p.read_text() for p in sorted(CSRC.glob("*.[ch]")))
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"no C compiler ({cc!r}: {exc}); set CC or install one"
    errors = []
    for flags in _flag_sets():
        key = hashlib.sha256(
            "\0".join([text, " ".join(flags), version, _cpu_id(), sys.platform]).encode()
        ).hexdigest()[:16]
        path = None
        for folder in _cache_dirs():
            cand = folder / f"kernels-{key}.so"
            err = _unsafe(folder) or _unsafe(cand)
            if err is not None:
                errors.append(err)
                continue  # another folder of ours may do (an explicit ATTNUQ_CACHE_DIR: none)
            # a library that is missing, torn or of unknown provenance is (re)built
            err = None if verified(cand) else _compile(cc, flags, cand)
            if err is None:
                path = cand
                break
            errors.append(err)
            if not err.startswith("cannot write"):
                break  # a compiler error: another folder would not help
        if path is None:
            continue
        try:
            return ctypes.CDLL(str(path)), f"compiled with {cc} {' '.join(flags)}: {path}"
        except OSError as exc:
            errors.append(f"loading {path} failed: {exc}")
    return None, "; ".join(errors)
