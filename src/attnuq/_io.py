"""Atomic writes, validated reads and cache keys for results and checkpoints.

Every results file, checkpoint and figure that a later run may read back goes through one of
the ``atomic_*`` writers: the bytes go to a temporary file in the target's folder, are flushed
to disk and then moved over the target with :func:`os.replace`, so a reader (or a rerun after
a crash) sees either the old file or the complete new one, never a torn one.

Resumption reads back with :func:`read_json_or_none` / :func:`torch_load_or_none`: a missing
file is ``None`` (not done yet); an unreadable or invalid one (0 bytes, truncated, not the
expected shape) is ``None`` too, with a :class:`CorruptFileWarning` naming the file, so the
caller redoes that piece instead of failing on it.

:func:`cache_key` turns everything that shapes a cached piece (budget, architecture, data file
identity from :func:`file_identity`, seed, split) into a short hash for the cache folder name.

Examples
--------
>>> import pathlib, tempfile, warnings
>>> tmp = tempfile.TemporaryDirectory()
>>> p = pathlib.Path(tmp.name) / "run.json"
>>> atomic_write_json(p, {"rmse": 0.5})
>>> read_json_or_none(p, "run")
{'rmse': 0.5}
>>> _ = p.write_text("")  # a torn file: warned about, then treated as not done
>>> with warnings.catch_warnings(record=True) as w:
...     warnings.simplefilter("always")
...     print(read_json_or_none(p, "run"), "corrupt run" in str(w[0].message))
None True
>>> cache_key({"max_epochs": 5}) == cache_key({"max_epochs": 5}), len(cache_key({}))
(True, 16)
>>> tmp.cleanup()
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "NONFINITE",
    "CorruptFileWarning",
    "atomic_np_savez",
    "atomic_savefig",
    "atomic_torch_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "cache_key",
    "check_input_file",
    "check_out_dir",
    "check_out_file",
    "decode_nonfinite",
    "describe_error",
    "encode_nonfinite",
    "file_identity",
    "read_json",
    "read_json_or_none",
    "staged_dir",
    "tensor_digest",
    "torch_load_or_none",
]


class CorruptFileWarning(UserWarning):
    """A results or cache file could not be read back; the piece it held is redone."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temporary file + :func:`os.replace`).

    The one writer the others go through: the bytes go to a temporary file beside ``path``, are
    flushed and fsync'ed, then moved over ``path``; on any failure the temporary file is removed.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes, got {type(data).__name__}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; keep the usual permissions
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    atomic_write_bytes(path, text.encode("utf-8"))


#: how :func:`encode_nonfinite` spells the floats strict JSON (RFC 8259) has no literal for
NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def encode_nonfinite(obj: Any) -> Any:
    """``obj`` (nested dicts, lists, tuples) with each non-finite float spelled as a string.

    ``nan`` becomes ``"NaN"``, ``+-inf`` ``"Infinity"`` / ``"-Infinity"`` (the tokens Python's
    ``json`` would write bare, which strict parsers such as ``jq`` or JavaScript's
    ``JSON.parse`` refuse); :func:`decode_nonfinite` reverses it. Tuples come back as lists,
    as ``json`` writes them.

    >>> encode_nonfinite({"beta": float("inf"), "acc": [0.5, float("nan")]})
    {'beta': 'Infinity', 'acc': [0.5, 'NaN']}
    """
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: encode_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode_nonfinite(v) for v in obj]
    return obj


def decode_nonfinite(obj: Any) -> Any:
    """The inverse of :func:`encode_nonfinite`: the strings ``"NaN"``, ``"Infinity"`` and
    ``"-Infinity"`` (exactly these) become floats again, anywhere in ``obj``.

    >>> decode_nonfinite({"beta": "Infinity", "acc": [0.5, "NaN"], "name": "inf"})
    {'beta': inf, 'acc': [0.5, nan], 'name': 'inf'}
    """
    if isinstance(obj, str):
        return NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: decode_nonfinite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_nonfinite(v) for v in obj]
    return obj


def read_json(path: str | os.PathLike[str]) -> Any:
    """The JSON in ``path`` with the non-finite spellings of :func:`atomic_write_json` decoded
    (files written before those spellings, with bare ``NaN`` / ``Infinity`` tokens, read too).

    Raises what :func:`json.loads` and :meth:`pathlib.Path.read_bytes` raise.
    """
    return decode_nonfinite(json.loads(Path(path).read_bytes().decode("utf-8")))


def atomic_write_json(path: str | os.PathLike[str], obj: Any, **dumps_kwargs: Any) -> None:
    """``json.dumps(obj, **dumps_kwargs)`` written to ``path`` atomically, as strict JSON.

    Non-finite floats (a floor's ``beta = inf``, an undefined score ``nan``) are written as the
    strings of :func:`encode_nonfinite` (``"Infinity"``, ``"NaN"``), so every JSON parser reads
    the file; :func:`read_json` and :func:`read_json_or_none` turn them back into floats. The
    text is built before the file is touched, so an object that does not serialise leaves the
    old file in place.

    >>> import pathlib, tempfile
    >>> p = pathlib.Path(tempfile.mkdtemp()) / "r.json"
    >>> atomic_write_json(p, {"beta": float("inf")})
    >>> p.read_text(), read_json(p)
    ('{"beta": "Infinity"}', {'beta': inf})
    """
    kwargs = {**dumps_kwargs, "allow_nan": False}
    atomic_write_text(path, json.dumps(encode_nonfinite(obj), **kwargs))


def atomic_torch_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj, path)``, atomically."""
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write_bytes(path, buf.getvalue())


def atomic_np_savez(path: str | os.PathLike[str], *, compressed: bool = True,
                    **arrays: Any) -> None:
    """``np.savez[_compressed](path, **arrays)``, atomically (``path`` is used as given)."""
    import numpy as np

    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def atomic_savefig(fig: Any, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """``fig.savefig(path, **kwargs)`` atomically; the format comes from ``path``'s suffix."""
    fmt = kwargs.pop("format", None) or Path(path).suffix.lstrip(".") or "png"
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, **kwargs)
    atomic_write_bytes(path, buf.getvalue())


def describe_error(exc: BaseException, limit: int = 200) -> str:
    """``"<Type>: <first non-empty line of the message>"`` (cut at ``limit`` characters).

    >>> describe_error(RuntimeError("size mismatch\\n  details")), describe_error(EOFError())
    ('RuntimeError: size mismatch', 'EOFError')
    """
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:limit]}" if lines else type(exc).__name__


def _warn_corrupt(path: Path, what: str, why: str) -> None:
    warnings.warn(f"corrupt {what} {path} ({why}); redoing it", CorruptFileWarning, stacklevel=3)


def read_json_or_none(
    path: str | os.PathLike[str],
    what: str,
    *,
    validate: Callable[[Any], bool] | None = None,
) -> Any:
    """The JSON in ``path``, or ``None`` when it is missing or unusable.

    Parameters
    ----------
    path
        File to read.
    what
        What the file holds (``"run"``, ``"member cost"``), for the warning.
    validate
        Optional check of the parsed value; ``False`` (or an exception) marks the file corrupt.

    Returns
    -------
    The parsed value; ``None`` for a missing file (silently) or an unreadable, invalid or
    rejected one (with a :class:`CorruptFileWarning` naming ``path``: the caller redoes it).
    """
    p = Path(path)
    if not p.is_file():
        return None
    try:
        value = read_json(p)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        _warn_corrupt(p, what, describe_error(exc))
        return None
    if validate is not None:
        try:
            ok = bool(validate(value))
        except Exception as exc:  # a validator failing on odd content means odd content
            ok, why = False, describe_error(exc)
        else:
            why = "unexpected content"
        if not ok:
            _warn_corrupt(p, what, why)
            return None
    return value


def torch_load_or_none(path: str | os.PathLike[str], what: str, **load_kwargs: Any) -> Any:
    """``torch.load(path, **load_kwargs)``, or ``None`` (missing, or corrupt with a warning)."""
    import torch

    p = Path(path)
    if not p.is_file():
        return None
    try:
        return torch.load(p, **load_kwargs)
    except Exception as exc:  # truncated zip, bad pickle, ...: a torn checkpoint is retrained
        _warn_corrupt(p, what, describe_error(exc))
        return None


def _kind(mode: int) -> str:
    import stat

    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_input_file(path: str | os.PathLike[str], what: str = "data file") -> Path:
    """``path`` if it names a regular file (symbolic links followed), else an error saying what
    it is: ``FileNotFoundError`` when nothing is there, ``ValueError`` for a folder, a named
    pipe (which would block a reader forever), a device such as ``/dev/null``, a socket.

    Examples
    --------
    >>> check_input_file("/dev/null")
    Traceback (most recent call last):
    ...
    ValueError: data file /dev/null is a character device, not a regular file
    >>> check_input_file("/no/such/file.csv", "model")
    Traceback (most recent call last):
    ...
    FileNotFoundError: model not found: /no/such/file.csv
    """
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} not found: {p}") from None
    except OSError as exc:  # permission, a loop of links, a name too long
        raise ValueError(f"{what} {p} cannot be read: {exc.strerror or exc}") from None
    import stat

    if not stat.S_ISREG(st.st_mode):
        kind = _kind(st.st_mode)
        raise ValueError(f"{what} {p} is {kind}, not a regular file" if kind.startswith("a ")
                         else f"{what} {p} is not a regular file")
    return p


def file_identity(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Name, size and SHA-256 of a data file: what a cache key needs to know about it."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file not found: {p}")
    h = hashlib.sha256()
    with p.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return {"name": p.name, "size": p.stat().st_size, "sha256": h.hexdigest()}


def tensor_digest(*tensors: Any) -> str:
    """16 hex digits of SHA-256 over the shapes, dtypes and values of ``tensors``.

    The identity of the data a model is trained on, independent of where the files lie.

    >>> import torch
    >>> a = torch.arange(6.0).reshape(2, 3)
    >>> tensor_digest(a) == tensor_digest(a.clone()), tensor_digest(a) == tensor_digest(a.T)
    (True, False)
    """
    import numpy as np
    import torch

    h = hashlib.sha256()
    for t in tensors:
        if not isinstance(t, (torch.Tensor, np.ndarray)):
            raise TypeError(f"tensor_digest takes tensors or arrays, got {type(t).__name__}")
        a = t.detach().cpu().contiguous().numpy() if isinstance(t, torch.Tensor) else t
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def cache_key(spec: Any) -> str:
    """16 hex digits of SHA-256 over ``spec`` as sorted JSON (equal specs, equal keys)."""
    text = json.dumps(spec, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_out_dir(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """Refuse an output folder that cannot be one, before any work is done.

    Raises ``ValueError`` naming ``option`` when ``path`` is empty, when it (or a parent) exists
    as a non-folder, or when its nearest existing folder does not take a file (probed by
    creating and removing one: permission bits do not tell, e.g. for root or under ``/proc``).
    Returns the path; nothing is left behind.

    Examples
    --------
    >>> check_out_dir("/proc/attnuq-out")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: --out '/proc/attnuq-out': folder '/proc' does not take new files (...)
    """
    if str(path) == "":
        raise ValueError(f"{option} is empty; name a folder")
    p = Path(path)
    _check_writable(p, f"{option} {str(p)!r}", p)
    return p


def check_out_file(path: str | os.PathLike[str], option: str = "--out") -> Path:
    """Refuse an output file that cannot be written, before any work: an empty name, a
    folder, or a file whose folder cannot be (:func:`check_out_dir`) made or written."""
    if str(path) == "":
        raise ValueError(f"{option} is empty; name a file")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{option} {str(p)!r} is a folder; name the file")
    _check_writable(p.parent, f"{option} {str(p)!r}", p)
    return p


def _check_writable(folder: Path, label: str, named: Path) -> None:
    """``ValueError`` starting with ``label`` when ``folder`` (or a parent) exists as a
    non-folder, or when its nearest existing folder does not take a new file (probed: one is
    created and removed). ``named`` is the path the user gave (``folder`` itself or a file
    in it)."""
    for q in (folder, *folder.parents):
        if q.exists():
            if not q.is_dir():
                if named != folder:  # a file was named: its folder is the problem
                    raise ValueError(f"{label}: its folder {str(q)!r} is a file")
                what = "" if q == folder else f" (its parent {str(q)!r} is a file)"
                raise ValueError(f"{label} is not a folder{what}")
            try:
                fd, probe = tempfile.mkstemp(prefix=".attnuq-probe-", dir=q)
            except OSError as exc:
                raise ValueError(f"{label}: folder {str(q)!r} does not take new files "
                                 f"({exc.strerror or type(exc).__name__})") from None
            os.close(fd)
            os.unlink(probe)
            return


@contextlib.contextmanager
def staged_dir(out: str | os.PathLike[str]) -> Iterator[Path]:
    """Write a folder's files into a hidden sibling and put them in place only when the block
    ends without an exception, so that ``out`` never holds a half-written set of results.

    A new or empty ``out`` is replaced by the sibling in one rename; into a folder that already
    holds files (an overwrite) each file is moved with its own atomic rename, and files the new
    set does not name are left alone. On an exception (``KeyboardInterrupt`` included) the
    sibling is removed and ``out`` is as it was.

    Examples
    --------
    >>> import pathlib, tempfile
    >>> root = pathlib.Path(tempfile.mkdtemp())
    >>> try:
    ...     with staged_dir(root / "res") as d:
    ...         _ = (d / "a.json").write_text("{}")
    ...         raise KeyboardInterrupt
    ... except KeyboardInterrupt:
    ...     pass
    >>> sorted(p.name for p in root.iterdir())  # nothing half-written
    []
    >>> with staged_dir(root / "res") as d:
    ...     _ = (d / "a.json").write_text("{}")
    >>> sorted(p.name for p in (root / "res").iterdir())
    ['a.json']
    """
    dest = Path(out)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        yield stage
        os.chmod(stage, 0o777 & ~_umask())  # mkdtemp makes it 0700
        try:
            os.replace(stage, dest)  # dest absent, or an empty folder (POSIX rename)
        except OSError:
            if not dest.is_dir():
                raise
            for f in sorted(stage.iterdir()):
                os.replace(f, dest / f.name)
            stage.rmdir()
    finally:
        if stage.exists():
            shutil.rmtree(stage, ignore_errors=True)
