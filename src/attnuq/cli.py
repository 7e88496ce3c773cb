"""The ``attnuq`` command line: ``demo``, ``bench <suite>``, ``calibrate``, ``report``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from attnuq import __version__

__all__ = ["main"]


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnuq",
        description="Prediction uncertainty from attention layers.",
    )
    parser.add_argument("--version", action="version", version=f"attnuq {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    bench = sub.add_parser("bench", help="run a benchmark suite (uci, ett, era5, physionet, ...)")
    bench_sub = bench.add_subparsers(dest="suite", metavar="SUITE")
    bench_sub.required = True
    from attnuq.bench import SUITES, get_suite

    for name in SUITES:
        try:
            suite = get_suite(name)
        except ImportError as exc:  # extras missing: the suite is listed but refuses to run
            p = bench_sub.add_parser(name, help=f"(unavailable: {exc})")
            p.set_defaults(_unavailable=str(exc))
            continue
        except (ModuleNotFoundError, RuntimeError):
            continue
        p = bench_sub.add_parser(name, help=suite.help, description=suite.help)
        suite.add_arguments(p)
        p.set_defaults(_run=suite.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "bench":
            if getattr(args, "_unavailable", None):
                raise RuntimeError(f"suite {args.suite!r} unavailable: {args._unavailable}")
            out = args._run(args)
            print(f"results written to {out}")
            return 0
    except (FileNotFoundError, ValueError, RuntimeError, KeyError) as exc:
        print(f"attnuq: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
