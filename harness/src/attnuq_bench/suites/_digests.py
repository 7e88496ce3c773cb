"""Digests of the data a suite's run records were computed on, and the one-time stamp of the
records written before digests were recorded.

Every run record carries ``data_digest``, the digest of the data its group read
(:class:`attnuq_bench.suites._runner.Group` ``data``); a stored record is reused only when
it matches the data of the run at hand, so a changed data set never reuses the old records.

* UCI: :func:`split_digest` of the loaded split (every fit/val/cal/test tensor: the data file,
  the split's indices and the standardisation);
* ETT, ERA5: :func:`files_digest` of the data file;
* PhysioNet: :func:`files_digest` of the data source (the archive, or every file of the folder,
  e.g. ``set-a.tar.gz`` and ``Outcomes-a.txt``).

Records written before digests were recorded have none and are redone, unless stamped once by
this module's command, which computes each record's digest from the data files as they are
now (run it only on records computed on these same files)::

    python -m attnuq_bench.suites._digests uci --out docs/results/uci --data-dir ../shared/data
    python -m attnuq_bench.suites._digests ett --out docs/results/ett --data-dir ../shared/data
    python -m attnuq_bench.suites._digests era5 --out docs/results/era5 --data-dir ../shared/data
    python -m attnuq_bench.suites._digests physionet --out docs/results/physionet \
        --data-dir ../shared/data

It adds ``data_digest`` to every valid record that has none (nothing else changes, so the
pages render the same) and prints what it stamped; records that have one are left alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["files_digest", "split_digest", "stamp"]


def files_digest(paths: Iterable[str | os.PathLike[str]]) -> str:
    """16 hex digits of SHA-256 over the files ``paths`` name (a folder: every regular file
    under it, by relative name, sorted): names, sizes and contents.

    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / "a.txt").write_text("1 2\\n")
    >>> a = files_digest([d / "a.txt"])
    >>> _ = (d / "a.txt").write_text("1 3\\n")
    >>> a == files_digest([d / "a.txt"]), len(a)
    (False, 16)
    """
    h = hashlib.sha256()
    for top in paths:
        p = Path(top)
        if p.is_dir():
            files = sorted(q for q in p.rglob("*") if q.is_file())
            names = [str(q.relative_to(p)) for q in files]
        elif p.is_file():
            files, names = [p], [p.name]
        else:
            raise FileNotFoundError(f"data file not found: {p}")
        for q, name in zip(files, names, strict=True):
            h.update(f"{name}|{q.stat().st_size};".encode())
            with q.open("rb") as fh:
                while block := fh.read(1 << 20):
                    h.update(block)
    return h.hexdigest()[:16]


def split_digest(split: Any) -> str:
    """16 hex digits over every tensor, array and number field of a loaded split (a
    dataclass such as :class:`attnuq_bench.data.uci.UCISplit`), in field order.

    >>> from dataclasses import dataclass
    >>> import torch
    >>> @dataclass
    ... class S:
    ...     x: torch.Tensor
    ...     y_std: float
    >>> split_digest(S(torch.ones(2), 1.0)) == split_digest(S(torch.ones(2), 2.0))
    False
    """
    import numpy as np
    import torch

    from attnuq._io import cache_key, tensor_digest

    parts: list[Any] = []
    for f in dataclasses.fields(split):
        v = getattr(split, f.name)
        if isinstance(v, (torch.Tensor, np.ndarray)):
            parts.append([f.name, tensor_digest(v)])
        elif isinstance(v, (int, float, str, bool)):
            parts.append([f.name, repr(v)])
    return cache_key(parts)


# ------------------------------------------------------------------------ the one-time stamp


def stamp(
    records: Sequence[Path], digest_of: Callable[[dict[str, Any]], str], *, dry_run: bool = False
) -> list[tuple[Path, str]]:
    """Add ``data_digest = digest_of(record)`` to every valid record of ``records`` without
    one (atomically, as the runner writes them); returns ``(path, digest)`` of those stamped."""
    from attnuq._io import atomic_write_json, read_json_or_none

    done = []
    for path in records:
        rec = read_json_or_none(path, "run", validate=lambda r: isinstance(r, dict)
                                and "method" in r)
        if rec is None or rec.get("data_digest") is not None:
            continue
        d = digest_of(rec)
        if not dry_run:
            atomic_write_json(path, {**rec, "data_digest": d}, indent=1)
        done.append((path, d))
    return done


def _uci(args: argparse.Namespace) -> tuple[list[Path], Callable[[dict[str, Any]], str]]:
    from attnuq_bench.data.uci import load_uci

    memo: dict[tuple[str, int], str] = {}

    def digest(rec: dict[str, Any]) -> str:
        key = (str(rec["dataset"]), int(rec["split"]))
        if key not in memo:
            memo[key] = split_digest(load_uci(key[0], key[1], data_dir=args.data_dir))
        return memo[key]

    return sorted((Path(args.out) / "runs").glob("*/split*/**/*.json")), digest


def _one_file(paths: list[Path], src: Path) -> tuple[list[Path], Callable[[dict[str, Any]], str]]:
    d = files_digest([src])
    return paths, lambda rec: d


def _ett(args: argparse.Namespace) -> tuple[list[Path], Callable[[dict[str, Any]], str]]:
    from attnuq_bench.data.ett import resolve_ett_path

    path = resolve_ett_path(args.file or "ETTh1.csv", args.data_dir)
    return _one_file(sorted((Path(args.out) / "runs" / path.stem).glob("*.json")), path)


def _era5(args: argparse.Namespace) -> tuple[list[Path], Callable[[dict[str, Any]], str]]:
    from attnuq_bench.data.era5 import resolve_era5_path

    path = resolve_era5_path(args.file or "era5-2mt-2019-03-uk.grib", args.data_dir)
    return _one_file(sorted((Path(args.out) / "runs").glob("*.json")), path)


def _physionet(args: argparse.Namespace) -> tuple[list[Path], Callable[[dict[str, Any]], str]]:
    from attnuq_bench.suites.physionet import data_source

    return _one_file(sorted(Path(args.out).glob("seed_*.json")), data_source(args.data_dir))


_SUITES = {"uci": _uci, "ett": _ett, "era5": _era5, "physionet": _physionet}


def main(argv: Sequence[str] | None = None) -> int:
    """The stamp command (see the module docstring); exit status 0, or 2 for bad input."""
    ap = argparse.ArgumentParser(
        prog="python -m attnuq_bench.suites._digests",
        description="Stamp run records written before data digests were recorded with the "
        "digest of the data files as they are now (only for records computed on them).")
    ap.add_argument("suite", choices=sorted(_SUITES))
    ap.add_argument("--out", required=True, help="the suite's results folder (its --out)")
    ap.add_argument("--data-dir", default=None, help="the data root the records were run on")
    ap.add_argument("--file", default=None, help="ETT/ERA5: the data file (the suite's --file)")
    ap.add_argument("--dry-run", action="store_true", help="print, write nothing")
    args = ap.parse_args(argv)
    try:
        paths, digest_of = _SUITES[args.suite](args)
        done = stamp(paths, digest_of, dry_run=args.dry_run)
    except (OSError, ValueError) as exc:
        print(f"attnuq_bench.suites._digests: error: {exc}", file=sys.stderr)
        return 2
    for p, d in done:
        print(f"{'would stamp' if args.dry_run else 'stamped'} {p}: data_digest {d}")
    print(f"{len(done)} of {len(paths)} record(s) {'to stamp' if args.dry_run else 'stamped'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
