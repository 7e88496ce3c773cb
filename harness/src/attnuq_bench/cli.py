"""The harness's subcommands of ``attnuq``: ``attnuq demo`` and ``attnuq bench <suite>``.

The library's command line finds them through the entry-point group ``attnuq.commands``
(declared in ``harness/pyproject.toml``); each is a :class:`attnuq.cli.Command`.

* ``attnuq demo``: train (or reuse) a small FT-Transformer on a bundled UCI set, calibrate ``nu``,
  predict, compare with MC dropout and write a report folder (``report.html``, PNGs,
  ``results.json``).
* ``attnuq bench <suite>``: a benchmark suite (``uci``, ``ett``, ``era5``, ``physionet``,
  ``calibration``, ...) or a report over their stored results (``evidence``); only the one
  asked for is imported.

Examples
--------
>>> import argparse
>>> p = argparse.ArgumentParser()
>>> DEMO.add_arguments(p, [])
>>> p.parse_args([]).dataset
'concrete'
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from attnuq.cli import add_common_options

__all__ = ["BENCH", "DEMO", "BenchCommand", "DemoCommand"]

_DATA_DIR_HELP = "data root (default: $ATTNUQ_DATA_DIR, else ../shared/data)"


class DemoCommand:
    """``attnuq demo``: the end-to-end path a new user takes (:func:`attnuq_bench.demo.run_demo`).

    Examples
    --------
    >>> DemoCommand().distributed
    False
    """

    help = "train a small FT-Transformer on a bundled data set, calibrate nu, write a report"
    distributed = False

    def add_arguments(self, parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
        parser.description = (
            "Train (or reuse) a small FT-Transformer on a bundled UCI set, calibrate SA's nu on "
            "held-out data, predict with intervals, compare with MC dropout and write "
            "report.html, PNGs and results.json.")
        parser.add_argument(
            "--out", default="attnuq-demo", help="report folder (default: attnuq-demo)")
        parser.add_argument(
            "--dataset", default="concrete", help="UCI set name (default: concrete)")
        parser.add_argument(
            "--split", type=int, default=0, help="standard split index (default: 0)")
        parser.add_argument(
            "--retrain", action="store_true", help="retrain even if a model is cached")
        parser.add_argument(
            "--max-epochs", type=int, default=100, help="training epochs at most (default: 100)"
        )
        parser.add_argument(
            "--n-blocks", type=int, default=1, help="FT-Transformer blocks (default: 1)"
        )
        parser.add_argument(
            "--n-samples", type=int, default=100,
            help="stochastic passes for prediction (default: 100)",
        )
        parser.add_argument("--data-dir", default="bundled", help=_DATA_DIR_HELP)
        add_common_options(parser)

    def run(self, args: argparse.Namespace) -> int:
        from attnuq_bench.demo import run_demo
        from attnuq_bench.suites._options import check_options

        check_options(args)  # the flags' own names in the messages, before any work
        out = run_demo(
            out_dir=args.out,
            dataset=args.dataset,
            split=args.split,
            data_dir=args.data_dir,
            seed=args.seed,
            device=args.device,
            retrain=args.retrain,
            max_epochs=args.max_epochs,
            n_blocks=args.n_blocks,
            n_samples=args.n_samples,
        )
        print(f"report written to {out / 'report.html'}")
        return 0


class BenchCommand:
    """``attnuq bench <suite>``: run a benchmark suite registered in :mod:`attnuq_bench.suites`.

    Examples
    --------
    >>> BenchCommand().distributed
    True
    """

    help = "run a benchmark suite (uci, ett, era5, physionet, ...)"
    distributed = True

    def add_arguments(self, parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
        from attnuq_bench.suites import REPORTS, SUITES, get_suite
        from attnuq_bench.suites._options import BenchHelpFormatter

        self._argv = ["bench", *argv]  # the command line, for the resume hint
        load_suite = argv[0] if argv else None
        bench_sub = parser.add_subparsers(dest="suite", metavar="SUITE")
        bench_sub.required = True
        for name in (*SUITES, *REPORTS):
            if name != load_suite:  # suites import their extras lazily: only the one asked for
                bench_sub.add_parser(name, help=f"see: attnuq bench {name} --help")
                continue
            try:
                suite = get_suite(name)
            except ImportError as exc:  # extras missing: listed, but refuses to run
                p = bench_sub.add_parser(name, help=f"(unavailable: {exc})")
                p.set_defaults(_unavailable=str(exc))
                continue
            p = bench_sub.add_parser(name, help=suite.help, description=suite.help,
                                     formatter_class=BenchHelpFormatter)
            suite.add_arguments(p)
            add_common_options(p)
            p.set_defaults(_run=suite.run)

    def run(self, args: argparse.Namespace) -> int:
        """Check the shared options (:func:`attnuq_bench.suites._options.check_options`),
        run the suite; on SIGINT print one line saying where it stopped and the command that
        resumes it, and return 130."""
        from attnuq_bench.suites._options import check_options

        if getattr(args, "_unavailable", None):
            raise ValueError(f"suite {args.suite!r} unavailable: {args._unavailable}")
        if not hasattr(args, "_run"):
            raise ValueError(f"suite {args.suite!r} could not be loaded")
        check_options(args)  # before any work: one line, exit 2
        try:
            out = args._run(args)
        except KeyboardInterrupt as exc:
            import sys

            where = str(exc) if str(exc) else f"attnuq bench {args.suite} stopped"
            print(f"attnuq: interrupted: {where}; resume with: {self.resume_command(args)}",
                  file=sys.stderr, flush=True)
            return 130
        print(f"results written to {Path(out)}")
        return 0

    def resume_command(self, args: argparse.Namespace) -> str:
        """The command that resumes an interrupted run: this one, with ``--resume`` (ETT,
        ERA5) or ``--reuse`` (PhysioNet) added where the suite keeps stored items only then.

        Examples
        --------
        >>> b = BenchCommand()
        >>> b._argv = ["bench", "ett", "--out", "r s"]
        >>> b.resume_command(argparse.Namespace(resume=False))
        "attnuq bench ett --out 'r s' --resume"
        """
        import shlex

        argv = list(getattr(self, "_argv", ["bench", str(getattr(args, "suite", ""))]))
        for flag in ("resume", "reuse"):
            if getattr(args, flag, None) is False and f"--{flag}" not in argv:
                argv.append(f"--{flag}")
        return "attnuq " + shlex.join(argv)


#: the entry points of the group ``attnuq.commands`` (harness/pyproject.toml)
DEMO = DemoCommand()
BENCH = BenchCommand()
