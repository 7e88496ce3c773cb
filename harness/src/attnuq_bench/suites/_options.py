"""The options every suite shares, checked once by the spine before any work.

:func:`check_options` runs before a suite's ``run`` (``attnuq bench <suite>``): an option that
a suite defines and that is below its least meaningful value (``--n-samples 1``: no spread;
``--threads -3``; ``--splits 0``; a seed outside ``[0, 2**63)``) ends the command with one line
naming the option and its value, exit status 2, instead of training backbones whose every run
then fails, or a table of zero runs.
"""

from __future__ import annotations

import argparse

__all__ = ["AT_LEAST", "check_options"]

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
}

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
    for dest in _SEEDS:
        v = getattr(args, dest, None)
        if isinstance(v, int) and not isinstance(v, bool) and not 0 <= v < 2**63:
            raise ValueError(f"{_flag(dest)} must be an int with 0 <= seed < 2**63, got "
                             f"{_flag(dest)} {v}")
