"""The ``attnuq`` command line.

* ``attnuq calibrate MODEL DATA``: fit :class:`attnuq.SARegressor` (``--task
  classification``: :class:`attnuq.SAClassifier`) for a user's saved model (a Hugging Face
  model folder or a ``torch.save``-d module) on a CSV or NPZ file of held-out inputs and
  targets; writes ``estimator.json``.
* ``attnuq predict MODEL FITTED.json INPUTS --out FILE``: mean, lower, upper (and samples) of
  each input row, as ``.npz`` or ``.csv``; for a classifier the class probabilities, the
  predicted class, the uncertainty scores and the prediction set at ``--level``.
* ``attnuq report RESULTS_JSON``: (re)write ``report.html`` from a results file.
* Commands of installed plugins: a distribution that declares entry points in the group
  ``attnuq.commands`` adds one subcommand per entry point (its name). The benchmark harness
  (``attnuq-bench``, in ``harness/`` of the repository) adds ``attnuq demo`` and
  ``attnuq bench <suite>`` this way; without it those two say how to install it (exit 2).

A plugin command is an object with ``help`` (str), ``distributed`` (bool: share the work across
``torchrun`` ranks), ``add_arguments(parser, argv)`` (``argv``: the words after the command name,
so that a command can load only what they ask for) and ``run(args) -> int`` (the exit status).

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set),
``calibrate`` and the distributed plugin commands initialise a process group (gloo; NCCL for a
CUDA ``--device``) and share their work across the ranks; rank 0 alone writes the results
(:mod:`attnuq.distributed`).

Bad input ends with a one-line ``attnuq: error: ...`` on stderr and exit status 2: invalid
options and files, a model that fails on the given data, a model folder without weights or with
a torn weights file, an ``--out`` that names a file (checked before any work). Set
``ATTNUQ_TRACEBACK=1`` to see the full traceback instead.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any, Protocol

from attnuq._runtime import version
from attnuq.calibration import CRITERIA, PER_LAYER, SEARCHES, get_criterion

__all__ = [
    "COMMANDS_GROUP", "Command", "add_common_options", "build_parser", "main", "plugin_commands",
]

#: entry-point group through which installed distributions add subcommands
COMMANDS_GROUP = "attnuq.commands"
#: commands the benchmark harness provides, named in the message when it is not installed
_HARNESS_COMMANDS = ("bench", "demo")
_HARNESS_HINT = ("pip install attnuq-bench "
                 "(from a clone of the repository: pip install -e harness)")


class Command(Protocol):
    """A subcommand a plugin adds (see the module docstring)."""

    help: str
    distributed: bool

    def add_arguments(self, parser: argparse.ArgumentParser, argv: Sequence[str]) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def plugin_commands() -> dict[str, Any]:
    """The entry points of the group ``attnuq.commands``, by command name (not yet loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=COMMANDS_GROUP)}


class _UserError(Exception):
    """An error caused by the command's input: printed as one line, exit status 2."""


#: errors whose message already says what was wrong with the input (no type name shown)
_PLAIN = (_UserError, ValueError, FileNotFoundError, FileExistsError, NotADirectoryError)


def _input_errors() -> tuple[type[BaseException], ...]:
    """The error types a command reports as bad input (one line, exit 2), not as a crash.

    Our validation raises ``ValueError`` / ``TypeError`` / ``KeyError``; ``calibrate``
    documents ``RuntimeError`` (no attention site reached), and a user's model that fails on
    the user's data raises one too; files bring ``OSError``, ``EOFError``, ``tarfile`` and
    ``zlib`` errors, and ``safetensors`` its own type; a missing extra is an ``ImportError``.
    """
    import tarfile
    import zlib

    kinds: list[type[BaseException]] = [
        _UserError, OSError, ValueError, KeyError, TypeError, RuntimeError, EOFError,
        ImportError, tarfile.TarError, zlib.error,
    ]
    st = sys.modules.get("safetensors")  # only a loaded safetensors can have raised
    err = getattr(st, "SafetensorError", None)
    if isinstance(err, type) and issubclass(err, BaseException):
        kinds.append(err)
    return tuple(kinds)


def _one_line(exc: BaseException) -> str:
    """The first non-empty line of ``exc``'s message, with its type unless it is one of ours."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    if isinstance(exc, _PLAIN) and msg:
        return msg
    return f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__


def seed_arg(text: str) -> int:
    """``--seed``: an int with ``0 <= seed < 2**63`` (argparse reports a refusal, exit 2)."""
    from attnuq._validation import check_seed

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int, got {text!r}") from None
    try:
        check_seed(value, "--seed", allow_none=False)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an int with 0 <= seed < 2**63, got {text!r}"
        ) from None
    return value


def add_common_options(p: argparse.ArgumentParser) -> None:
    """Give a command ``--seed`` and ``--device`` (``main`` resolves the device) unless it has them.

    Examples
    --------
    >>> p = argparse.ArgumentParser()
    >>> add_common_options(p)
    >>> p.parse_args(["--device", "cpu"]).seed
    0
    """
    have = {opt for action in p._actions for opt in action.option_strings}
    if "--seed" not in have:
        p.add_argument("--seed", type=seed_arg, default=0, help="random seed (default: 0)")
    if "--device" not in have:
        p.add_argument(
            "--device", default="cpu",
            help="torch device: cpu, cuda, cuda:N or auto (default: cpu)",
        )


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The argument parser of ``attnuq``, with the plugins' commands.

    ``argv`` is the command line: a plugin command gets the words after its name (so the bench
    loads only the suite asked for); the other plugins are listed but not loaded.
    """
    parser = argparse.ArgumentParser(
        prog="attnuq", description="Prediction uncertainty from attention layers."
    )
    parser.add_argument("--version", action="version", version=f"attnuq {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    cal = sub.add_parser(
        "calibrate",
        help="fit calibrated SA intervals (or class probabilities and prediction sets) for a "
        "saved model on held-out data",
        description="Fit attnuq.SARegressor (the recommended recipe: nu on a validation part, "
        "the conformal step on a calibration part), or with --task classification "
        "attnuq.SAClassifier (nu and a temperature by the validation NLL, conformal prediction "
        "sets from the calibration part), for a saved model and write OUT/estimator.json for "
        "attnuq predict. MODEL: a Hugging Face model folder (config.json + weights) or a file "
        "written by torch.save(module). DATA: an .npz file with arrays 'x' (or several named "
        "input arrays passed as keyword arguments) and 'y', or a .csv file whose --target "
        "columns are the targets and whose other columns are the inputs; for classification "
        "the targets are integer class ids and the model's output its logits. The rows are "
        "split at random (--seed) into validation and calibration parts.",
    )
    cal.add_argument("model", help="Hugging Face model folder or torch.save()d module file")
    cal.add_argument("data", help="held-out data: .npz (x, y) or .csv")
    cal.add_argument(
        "--target", action="append", default=None,
        help="CSV target column (repeatable; default: the last column)",
    )
    cal.add_argument(
        "--output-key", default=None,
        help="field of a model output object holding the prediction (default: the first tensor);"
        " with --head, the hidden states fed to the head (default: last_hidden_state)",
    )
    cal.add_argument(
        "--head", default=None, metavar="FILE",
        help="torch.save()d head applied to MODEL's pooled embedding: an nn.Module, or a linear "
        "head's state dict {'weight': (K, D), 'bias': (K,)}",
    )
    cal.add_argument(
        "--pool", default=None, choices=["mean", "cls", "none"],
        help="pooling before --head (only with --head): attention-mask-weighted mean over "
        "tokens, the first token, or none (the field is already (B, D)); default: mean",
    )
    cal.add_argument(
        "--task", default="regression", choices=["regression", "classification"],
        help="regression: intervals (SARegressor); classification: class probabilities and "
        "prediction sets (SAClassifier; targets are class ids, the output logits: (B, C), or "
        "(B,) / (B, 1) for a binary model) (default: regression)",
    )
    cal.add_argument(
        "--criterion", default=None, choices=list(CRITERIA),
        help="regression only: calibration criterion (default: auto): " + "; ".join(
            f"{name}: {get_criterion(name).description}".replace("%", "%%") for name in CRITERIA
        ),
    )
    cal.add_argument("--search", default="bo", choices=list(SEARCHES), help="default: bo")
    cal.add_argument(
        "--per-layer", default=None, choices=list(PER_LAYER),
        help="regression only: also calibrate one nu per attention site: geometric = nu_l = nu_0 "
        "r^(l/(L-1)) over the sites in find_attention order, at most twice the shared search's "
        "passes; the map goes to calibration.json (nu_map). Not with --criterion scale or "
        "coverage (default: off)",
    )
    cal.add_argument(
        "--centre", default=None, choices=["frozen", "mean", "auto"],
        help="regression only: centre of the intervals: the frozen output (SA never moves the "
        "point prediction), the mean of the SA draws, or auto: the one of lower cross-fitted "
        "validation CRPS (default: frozen)",
    )
    cal.add_argument(
        "--score", default=None, choices=["aps", "lac", "raps"],
        help="classification only: conformal score of the prediction sets (default: aps)",
    )
    cal.add_argument(
        "--temperature", default=None, choices=["joint", "after", "none"],
        help="classification only: the temperature on the logits, fitted with nu (joint: each "
        "nu scored at its own best temperature), after nu, or none (default: joint)",
    )
    cal.add_argument("--n-passes", type=int, default=None,
                     help="stochastic passes per input, in the search and for the prediction "
                     "(default: 6 for regression; for classification 10 in the search and 32 "
                     "for the probabilities)")
    cal.add_argument("--cal-fraction", type=float, default=0.5,
                     help="share of DATA's rows for the calibration part (default: 0.5)")
    cal.add_argument("--batch-size", type=int, default=64, help="default: 64")
    cal.add_argument("--out", default="attnuq-calibration",
                     help="output folder (default: attnuq-calibration); refused if it holds "
                     "files, unless --overwrite")
    cal.add_argument("--overwrite", action="store_true",
                     help="replace the files of a taken --out folder")
    add_common_options(cal)

    prd = sub.add_parser(
        "predict",
        help="calibrated intervals (or class probabilities and prediction sets) of a saved "
        "model with a fitted estimator",
        description="Predict with a model and the estimator JSON that attnuq calibrate wrote: "
        "writes mean, lower and upper (and the raw SA samples with --samples) of every input row "
        "to --out (.npz, or .csv with one row per input); for a classifier: label, the class "
        "probabilities prob_<c>, confidence, entropy, expected_entropy, mutual_information and "
        "the prediction set at --level (set_size, set_<c>). INPUTS: an .npz file (array 'x', or "
        "named input arrays; an array 'y' is ignored) or a .csv file (every column is an input, "
        "except --target columns). --head, --pool and --output-key default to what the "
        "calibration used.",
    )
    prd.add_argument("model", help="Hugging Face model folder or torch.save()d module file")
    prd.add_argument("fitted", help="estimator.json written by attnuq calibrate")
    prd.add_argument("input", metavar="INPUTS", help="inputs: .npz or .csv")
    prd.add_argument("--level", type=float, default=0.9,
                     help="level in (0, 1) of the central intervals, or of a classifier's "
                     "prediction sets (they hold the label with that probability) (default: 0.9)")
    prd.add_argument("--out", required=True, help="output file: .npz or .csv")
    prd.add_argument("--samples", action="store_true",
                     help="also write the raw SA samples (S, N, ...); a classifier's are "
                     "probability draws (S, N, C), .npz only (default: off)")
    prd.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    prd.add_argument("--head", default=None, metavar="FILE",
                     help="head on the pooled embedding (default: the calibration's)")
    prd.add_argument("--pool", default=None, choices=["mean", "cls", "none"],
                     help="pooling before --head (default: the calibration's)")
    prd.add_argument("--output-key", default=None,
                     help="field of the model output (default: the calibration's)")
    prd.add_argument("--target", action="append", default=None,
                     help="CSV columns to drop from the inputs (default: the calibration's "
                     "target columns, where present; the other columns must then be the "
                     "calibration's input columns, in its order)")
    prd.add_argument("--batch-size", type=int, default=64, help="default: 64")
    prd.add_argument("--no-strict", action="store_true",
                     help="accept a model whose parameters differ from the calibrated one "
                     "(a warning instead of an error)")
    prd.add_argument(
        "--device", default="cpu", help="torch device: cpu, cuda, cuda:N or auto (default: cpu)"
    )

    rep = sub.add_parser(
        "report", help="write report.html from a results.json",
        description="Render a self-contained report.html (figures embedded) from a results.json.",
    )
    rep.add_argument("results", help="path to results.json")
    rep.add_argument("--out", default=None, help="HTML file (default: beside results.json)")

    asked = argv[0] if argv else None
    for name, ep in sorted(plugin_commands().items()):
        if name in ("calibrate", "report"):
            continue  # the library's own commands cannot be replaced
        if name != asked:  # not loaded: a plugin's imports cost only when it is asked for
            sub.add_parser(name, help=f"see: attnuq {name} --help")
            continue
        cmd = ep.load()
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.add_arguments(p, list(argv[1:]))
        p.set_defaults(_command=cmd)
    return parser


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from attnuq.cli._calibrate import calibrate_saved_model

    out = calibrate_saved_model(args)
    from attnuq.distributed import is_primary

    if is_primary():
        print(f"calibration report written to {out}")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from attnuq.cli._calibrate import predict_saved_model

    out = predict_saved_model(args)
    print(f"predictions written to {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from attnuq.html_report import render_report

    out = render_report(args.results, args.out)
    print(f"report written to {out}")
    return 0


#: options naming a folder a command writes into, and options naming a file it writes
_OUT_DIRS = ("out", "model_dir", "cache_dir")
_OUT_FILES = ("table", "md")


def _check_outputs(args: argparse.Namespace) -> None:
    """Refuse output paths that cannot be written, before any work (training, calibration).

    A folder option (``--out``, ``--model-dir``, ``--cache-dir``; ``report --out`` is a file)
    that names an existing file, or a file option (``--table``, ``--md``) that names a folder.
    """
    from attnuq._io import check_out_dir, check_out_file

    file_out = args.command in ("report", "predict")
    dirs = [o for o in _OUT_DIRS if not (o == "out" and file_out)]
    for opt in dirs:
        val = getattr(args, opt, None)
        if isinstance(val, str):
            check_out_dir(val, "--" + opt.replace("_", "-"))
    files = [*_OUT_FILES, *(["out"] if file_out else [])]
    for opt in files:
        val = getattr(args, opt, None)
        if isinstance(val, str):
            check_out_file(val, "--" + opt.replace("_", "-"))


def _interrupted(exc: BaseException) -> bool:
    """``exc`` is, or was raised while handling or because of, a ``KeyboardInterrupt`` (Ctrl-C
    during an import can surface as another error whose cause is the interrupt)."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _say_interrupted(command: str) -> int:
    """One line on stderr for Ctrl-C, and the shell's status for SIGINT (128 + 2)."""
    print(f"attnuq: interrupted: attnuq {command} stopped", file=sys.stderr, flush=True)
    return 130


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``attnuq`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _HARNESS_COMMANDS and argv[0] not in plugin_commands():
        print(f"attnuq: error: 'attnuq {argv[0]}' needs the benchmark harness: {_HARNESS_HINT}",
              file=sys.stderr)
        return 2
    try:
        parser = build_parser(argv)  # loads the harness's commands: an import can be stopped
        args = parser.parse_args(argv)
    except BaseException as exc:
        if _interrupted(exc):
            return _say_interrupted(argv[0] if argv else "attnuq")
        raise
    command: Command | None = getattr(args, "_command", None)
    started = False
    try:
        if getattr(args, "device", None) is not None:
            from attnuq._runtime import resolve_device

            args.device = str(resolve_device(args.device))
        _check_outputs(args)
        if args.command == "calibrate" or (command is not None and command.distributed):
            # under torchrun: share the work
            from attnuq.distributed import init_from_env

            started = init_from_env(getattr(args, "device", None))
            if started and str(getattr(args, "device", "")).startswith("cuda"):
                import torch

                args.device = f"cuda:{torch.cuda.current_device()}"  # this rank's GPU
        if args.command == "calibrate":
            return _cmd_calibrate(args)
        if args.command == "report":
            return _cmd_report(args)
        if args.command == "predict":
            return _cmd_predict(args)
        if command is not None:
            return int(command.run(args))
    except _input_errors() as exc:
        if os.environ.get("ATTNUQ_TRACEBACK", "") not in ("", "0"):
            raise
        print(f"attnuq: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BaseException as exc:
        from attnuq.distributed import WorkerDone

        if isinstance(exc, WorkerDone):  # this rank's share is done; rank 0 writes the page
            return 0
        if _interrupted(exc) and os.environ.get("ATTNUQ_TRACEBACK", "") in ("", "0"):
            return _say_interrupted(args.command)
        raise
    finally:
        if started:
            import torch.distributed as dist

            dist.destroy_process_group()
    parser.error(f"unknown command {args.command!r}")
    return 2
