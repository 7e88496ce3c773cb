"""Compiled CPU kernel for the dense sampler's inverse-CDF step (private, optional).

The dense path of :func:`attnuq.ops.sampled_attention` turns each chunk of scores into draws:
row maximum, ``2^(s - max)``, a CDF and one lookup per draw. In torch ops that is four passes
over the scores plus ``searchsorted``; on CPU it costs more than the scores GEMM itself. The C
kernel in ``csrc/sample_rows.c`` does it with SIMD in one pass per row after the maximum (blocks
of at most 16 keys in an interleaved order, so that the in-block prefix sums are vector adds; a
branch-free search over the blocks and at most 16 compares per draw; details in the source).

The kernel is compiled on first use with the system C compiler (``$CC`` or ``cc``; ``-O3``, with
``-march=native`` and ``-fopenmp`` when accepted) into a cache directory (``$ATTNUQ_CACHE_DIR``;
else ``$XDG_CACHE_HOME/attnuq`` or ``~/.cache/attnuq``, and a per-user temporary directory when
that is not writable), keyed by the source, the flags, the compiler's version and the CPU, and
loaded with :mod:`ctypes`. With OpenMP the rows of a call are split over the process's OpenMP
threads (in a torch process the shared ``libgomp`` is torch's own pool); without it, over Python
threads (ctypes releases the GIL). Without a compiler, or with ``ATTNUQ_NATIVE=0``, the
pure-torch path runs instead (same distribution, slower); :func:`status` says which and why.

The two paths walk the keys along the CDF in different orders, so the same uniforms give
different (equally distributed) draws; the same generator state gives the same draws on a given
path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

__all__ = ["available", "disabled", "sample_rows", "status"]

_SRC = Path(__file__).with_name("csrc") / "sample_rows.c"
# fewest score elements per thread before rows are split over threads
_MIN_ELEMS_PER_THREAD = 1 << 15
_enabled = True


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


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile the kernel to ``out`` (atomically); an error message, or None on success."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as exc:
        return f"cannot write to the cache directory {out.parent}: {exc} (set ATTNUQ_CACHE_DIR)"
    try:
        proc = subprocess.run(
            [cc, *flags, "-shared", "-fPIC", "-o", tmp, str(_SRC), "-lm"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            return f"{cc} {' '.join(flags)} failed: {proc.stderr.strip()[-500:]}"
        os.replace(tmp, out)
        return None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"{cc} could not run: {exc}"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    """``(library, reason)``: the loaded kernel, or None and why not (cached per process)."""
    if os.environ.get("ATTNUQ_NATIVE", "1").strip() == "0":
        return None, "disabled by ATTNUQ_NATIVE=0"
    if not _SRC.is_file():
        return None, f"kernel source missing: {_SRC}"
    cc = os.environ.get("CC", "cc")
    try:
        version = subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"no C compiler ({cc!r}: {exc}); set CC or install one"
    errors = []
    for flags in (
        ["-O3", "-march=native", "-fopenmp"],
        ["-O3", "-fopenmp"],
        ["-O3", "-march=native"],
        ["-O3"],
    ):
        key = hashlib.sha256(
            "\0".join(
                [_SRC.read_text(), " ".join(flags), version, _cpu_id(), sys.platform]
            ).encode()
        ).hexdigest()[:16]
        path = None
        for folder in _cache_dirs():
            cand = folder / f"sample_rows-{key}.so"
            err = None if cand.is_file() else _compile(cc, flags, cand)
            if err is None:
                path = cand
                break
            errors.append(err)
            if not err.startswith("cannot write"):
                break  # a compiler error: another folder would not help
        if path is None:
            continue
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            errors.append(f"loading {path} failed: {exc}")
            continue
        for name in ("attnuq_sample_rows_f32", "attnuq_sample_rows_f64"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int64
            fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
            fn.argtypes += [ctypes.c_void_p, ctypes.c_int64]
            fn.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        lib.attnuq_openmp.restype = ctypes.c_int64
        lib.attnuq_openmp.argtypes = []
        return lib, f"compiled with {cc} {' '.join(flags)}: {path}"
    return None, "; ".join(errors)


def status() -> dict[str, object]:
    """Whether the kernel is in use: ``{"available": bool, "enabled": bool, "reason": str}``.

    Example
    -------
    >>> from attnuq.ops import _native
    >>> sorted(_native.status())
    ['available', 'enabled', 'reason']
    """
    lib, reason = _load()
    return {"available": lib is not None, "enabled": _enabled, "reason": reason}


def available() -> bool:
    """True when the kernel is compiled, loaded and not switched off by :func:`disabled`."""
    return _enabled and _load()[0] is not None


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block the dense sampler uses the pure-torch path (for tests and benchmarks).

    Example
    -------
    >>> from attnuq.ops import _native
    >>> with _native.disabled():
    ...     _native.available()
    False
    """
    global _enabled
    prev, _enabled = _enabled, False
    try:
        yield
    finally:
        _enabled = prev


def _has_openmp(lib: ctypes.CDLL) -> bool:
    """Whether the kernel splits rows itself (compiled with OpenMP)."""
    return bool(lib.attnuq_openmp())


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="attnuq-sample")


def sample_rows(
    s: torch.Tensor, u: torch.Tensor, out: torch.Tensor, empty: torch.Tensor
) -> None:
    """Inverse-CDF draws for every row of ``s`` (CPU, needs :func:`available`).

    ``s`` ``(R, L)`` scores in log2 units (``-inf`` = excluded key), rows contiguous;
    ``u`` ``(R, nu)`` uniforms in ``[0, 1)``, contiguous, same dtype (float32 or float64);
    ``out`` ``(R, nu)`` int32 or int64, contiguous: the drawn key of each uniform;
    ``empty`` ``(R,)`` bool, contiguous: rows whose every score is ``-inf`` (their indices are 0).
    """
    lib = _load()[0]
    if lib is None:
        raise RuntimeError(f"native sampling kernel unavailable: {_load()[1]}")
    rows, lk = s.shape
    nu = u.shape[1]
    if not (
        s.device.type == "cpu"
        and s.dtype in (torch.float32, torch.float64)
        and u.dtype == s.dtype
        and u.shape == (rows, nu)
        and out.shape == (rows, nu)
        and out.dtype in (torch.int32, torch.int64)
        and empty.shape == (rows,)
        and empty.dtype == torch.bool
        and s.stride(1) == 1
        and u.is_contiguous()
        and out.is_contiguous()
        and empty.is_contiguous()
    ):
        raise ValueError(
            "sample_rows needs CPU float32/float64 s (R, L) with unit key stride, contiguous u "
            f"(R, nu), out (R, nu) int32/int64 and empty (R,) bool; got s {tuple(s.shape)} "
            f"{s.dtype} {s.device} stride {s.stride()}, u {tuple(u.shape)} {u.dtype}, "
            f"out {tuple(out.shape)} {out.dtype}, empty {tuple(empty.shape)} {empty.dtype}"
        )
    fn = lib.attnuq_sample_rows_f32 if s.dtype == torch.float32 else lib.attnuq_sample_rows_f64
    i32 = out.dtype == torch.int32
    ss, us, os_ = s.element_size(), u.element_size(), out.element_size()
    sp, up, op, ep = s.data_ptr(), u.data_ptr(), out.data_ptr(), empty.data_ptr()
    stride = s.stride(0)

    workers = min(torch.get_num_threads(), max(1, rows * max(lk, nu) // _MIN_ELEMS_PER_THREAD))
    workers = max(1, min(workers, rows))

    def run(r0: int, r1: int, threads: int) -> int:
        o = op + r0 * nu * os_
        return int(
            fn(
                sp + r0 * stride * ss, r1 - r0, lk, stride, up + r0 * nu * us, nu,
                o if i32 else None, None if i32 else o, ep + r0, threads,  # bool: 1 byte
            )
        )

    if workers == 1 or _has_openmp(lib):
        # one call; with OpenMP the kernel splits the rows over the process's OpenMP threads
        # (torch's own, which would otherwise spin idle beside Python threads)
        codes = [run(0, rows, workers)]
    else:
        # the calling thread takes the first share; ctypes releases the GIL during each call
        bounds = [rows * i // workers for i in range(workers + 1)]
        pool = _pool(workers - 1)
        futs = [pool.submit(run, bounds[i], bounds[i + 1], 1) for i in range(1, workers)]
        codes = [run(bounds[0], bounds[1], 1)] + [f.result() for f in futs]
    if any(c != 0 for c in codes):
        raise MemoryError(f"native sampling kernel could not allocate scratch for Lk={lk}")
