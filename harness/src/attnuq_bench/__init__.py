"""attnuq_bench: the experiment harness of attnuq (not part of the library).

What only our experiments call: the benchmark suites (:mod:`attnuq_bench.suites`), the registry
of uncertainty methods and every baseline (:mod:`attnuq_bench.methods`), the training loop
(:mod:`attnuq_bench.training`), experiment architectures (:mod:`attnuq_bench.models`), loaders of
the benchmark data sets (:mod:`attnuq_bench.data`), the demo and the ``attnuq bench`` /
``attnuq demo`` subcommands (:mod:`attnuq_bench.cli`). It depends on the library :mod:`attnuq`;
the library never imports it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("attnuq-bench")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
