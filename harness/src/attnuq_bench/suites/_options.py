"""The options every suite shares, checked once by the spine before any work.

:func:`check_options` runs before a suite's ``run`` (``attnuq bench <suite>``): an option that
a suite defines and that is below its least meaningful value (``--n-samples 1``: no spread;
``--threads -3``; ``--splits 0``; a seed outside ``[0, 2**63)``) ends the command with one line
naming the option and its value, exit status 2, instead of training backbones whose every run
then fails, or a table of zero runs. :func:`add_methods_argument` gives ``--methods`` (and
``--rerun``) one syntax in every suite (names as several arguments or comma-separated), and
:class:`BenchHelpFormatter` shows every option's default in ``--help``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

__all__ = ["AT_LEAST", "AT_MOST", "DIVISIBLE", "FLOAT_RANGES", "BenchHelpFormatter",
           "add_methods_argument", "check_method_names", "check_options", "split_methods"]

#: option (argparse dest) -> least value, with the reason for the ones that are not 1
AT_LEAST: dict[str, int] = {
    "n_samples": 2,  # a predictive spread (std, interval, CRPS) needs two draws
    "n_passes": 2,  # calibration's spread needs two passes
    "mc_passes": 2,
    "grid_size": 2,  # a grid has two ends
    "first_split": 0,
    "split_seed": 0,
    "encoder_layers": 0,
    "plots": 0,
    "splits": 1, "threads": 1, "max_epochs": 1, "epochs": 1, "patience": 1, "n_blocks": 1,
    "swag_epochs": 1, "swag_snapshots": 1, "ensemble": 1, "ensemble_members": 1,
    "member_epochs": 1, "member_jobs": 1, "chunk": 1, "context": 1, "horizon": 1,
    "history": 1, "nu_max": 1, "seeds": 1, "max_evals": 1, "test_stride": 1, "val_stride": 1,
    "sampler_draws": 1, "max_train_queries": 1, "gp_iters": 1, "d": 1, "batch_size": 1,
    "window": 1, "heads": 1, "levy_heads": 1, "levy_d": 1, "d_model": 1, "ffn": 1, "patch": 1,
    "embed_dim": 1, "max_images": 1, "max_stays": 1, "sub_stays": 1, "max_steps_per_epoch": 1,
}

#: option (argparse dest) -> greatest value, with the reason
AT_MOST: dict[str, tuple[int, str]] = {
    "n_blocks": (6, "rtdl's default FT-Transformer configs"),
}

#: float options (argparse dest) -> (least, open at least, below): learning rates are > 0,
#: dropout rates in [0, 1), weight decays >= 0; every one finite
FLOAT_RANGES: dict[str, tuple[float, bool, float]] = {
    "lr": (0.0, True, float("inf")), "levy_lr": (0.0, True, float("inf")),
    "dropout": (0.0, False, 1.0),
    "weight_decay": (0.0, False, float("inf")), "levy_weight_decay": (0.0, False, float("inf")),
}

#: (width, heads) option pairs: multi-head attention splits the width into equal heads
DIVISIBLE: tuple[tuple[str, str], ...] = (("d", "heads"), ("d_model", "heads"),
                                          ("embed_dim", "heads"), ("levy_d", "levy_heads"))

_SEEDS = ("seed", "split_seed", "only_seed")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_options(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first option of ``args`` below its least value
    (:data:`AT_LEAST`; ints only: ``--batch-size auto`` and unset options pass) or a seed
    outside ``[0, 2**63)``.

    Examples
    --------
    >>> check_options(argparse.Namespace(n_samples=8, threads=1, batch_size="auto"))
    >>> check_options(argparse.Namespace(threads=-3))
    Traceback (most recent call last):
    ...
    ValueError: --threads must be an int >= 1, got --threads -3
    """
    for dest, least in AT_LEAST.items():
        v = getattr(args, dest, None)
        if isinstance(v, bool) or not isinstance(v, int):
            continue  # unset (None), 'auto', or not this suite's option
        if v < least:
            why = {2: " (a spread needs two)"}.get(least, "") if dest != "grid_size" else ""
            raise ValueError(f"{_flag(dest)} must be an int >= {least}{why}, got "
                             f"{_flag(dest)} {v}")
    for dest, (most, why_most) in AT_MOST.items():
        v = getattr(args, dest, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > most:
            raise ValueError(f"{_flag(dest)} must be at most {most} ({why_most}), got "
                             f"{_flag(dest)} {v}")
    for dest in _SEEDS:
        v = getattr(args, dest, None)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v < 2**63:
            raise ValueError(f"{_flag(dest)} must be an int with 0 <= seed < 2**63, got "
                             f"{_flag(dest)} {v}")
    for dest, (lo, open_lo, hi) in FLOAT_RANGES.items():
        v = getattr(args, dest, None)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not (math.isfinite(v) and (v > lo if open_lo else v >= lo) and v < hi):
            lo_txt = f"{'>' if open_lo else '>='} {lo:g}"
            rng = lo_txt if math.isinf(hi) else f"{lo_txt} and < {hi:g}"
            raise ValueError(f"{_flag(dest)} must be finite and {rng}, got {_flag(dest)} {v}")
    for width, heads in DIVISIBLE:
        w, h = getattr(args, width, None), getattr(args, heads, None)
        if isinstance(w, int) and isinstance(h, int) and h > 0 and w % h:
            raise ValueError(f"{_flag(width)} must be divisible by {_flag(heads)} (equal "
                             f"heads), got {_flag(width)} {w} and {_flag(heads)} {h}")


def check_method_names(names: Sequence[str] | None) -> None:
    """``ValueError`` naming the first of ``names`` (``--methods``) that is not a registered
    method (:func:`attnuq_bench.methods.available_methods`); ``None`` passes."""
    from attnuq_bench.methods import available_methods

    known = available_methods()
    for m in names or []:
        if m not in known:
            raise ValueError(f"unknown method {m!r}; known: {known}")


def split_methods(values: str | Sequence[str] | None) -> list[str]:
    """The method names of ``--methods`` / ``--rerun``: words given as several arguments, or
    separated by commas, or both (``sa conformal``, ``sa,conformal``, ``sa, conformal``), in
    the order given, each once.

    Examples
    --------
    >>> split_methods(["sa,conformal", "mc-dropout", "sa"])
    ['sa', 'conformal', 'mc-dropout']
    >>> split_methods("sa, conformal")
    ['sa', 'conformal']
    >>> split_methods(None)
    []
    """
    if values is None:
        return []
    words = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for word in words:
        for name in str(word).split(","):
            name = name.strip()
            if name and name not in out:
                out.append(name)
    return out


class _MethodsAction(argparse.Action):
    """Stores :func:`split_methods` of the words given (one shared syntax in every suite)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        names = split_methods(values)
        if not names:
            parser.error(f"{option_string} needs at least one method name, got {values!r}")
        setattr(namespace, self.dest, names)


def add_methods_argument(parser: argparse.ArgumentParser, flag: str = "--methods", *,
                         default: Sequence[str] | None, help: str) -> None:
    """Add ``flag`` (``--methods`` or ``--rerun``) with the syntax every suite shares: method
    names as several arguments or comma-separated (:func:`split_methods`); the value is a
    list of names (``default`` when the option is absent). ``help`` says what the names
    select and the default; the syntax is appended.

    Examples
    --------
    >>> p = argparse.ArgumentParser()
    >>> add_methods_argument(p, default=["sa"], help="methods to run (default: sa)")
    >>> p.parse_args(["--methods", "sa,conformal", "gaussian"]).methods
    ['sa', 'conformal', 'gaussian']
    >>> p.parse_args([]).methods
    ['sa']
    """
    parser.add_argument(
        flag, nargs="+", action=_MethodsAction, metavar="METHOD",
        default=None if default is None else list(default),
        help=f"{help}; names separated by spaces or commas",
    )


class BenchHelpFormatter(argparse.HelpFormatter):
    """The help of ``attnuq bench <suite>``: each option's default is shown, appended as
    ``(default: VALUE)`` unless its help already says it (``off`` for a flag).

    Examples
    --------
    >>> p = argparse.ArgumentParser(formatter_class=BenchHelpFormatter)
    >>> _ = p.add_argument("--epochs", type=int, default=30, help="training epochs")
    >>> _ = p.add_argument("--retrain", action="store_true", help="train again")
    >>> "training epochs (default: 30)" in " ".join(p.format_help().split())
    True
    >>> "train again (default: off)" in " ".join(p.format_help().split())
    True
    """

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default is argparse.SUPPRESS or action.default is None):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif isinstance(action, argparse._StoreFalseAction):
            shown = "on"
        elif isinstance(action.default, (list, tuple)):
            shown = " ".join(str(v) for v in action.default)
        else:
            shown = str(action.default)
        shown = shown.replace("%", "%%")  # argparse expands %-formats in help
        return f"{text} (default: {shown})" if text else f"(default: {shown})"
