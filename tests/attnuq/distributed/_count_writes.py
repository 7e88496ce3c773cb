"""``python _count_writes.py LOG_DIR CLI_ARGS...``: ``attnuq.cli.main(CLI_ARGS)`` with every
:func:`os.replace` (the last step of each ``attnuq._io`` atomic write) logged to
``LOG_DIR/writes_rank<RANK>.txt``, one destination path a line (run by ``torchrun`` as each
rank's script, or in the test's own process through :func:`logging_writes`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def logging_writes(log: Path) -> Iterator[None]:
    """Within this block each ``os.replace(src, dst)`` appends ``dst`` (absolute) to ``log``."""
    real = os.replace

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str], *a: object,
                **kw: object) -> None:
        real(src, dst, *a, **kw)  # type: ignore[arg-type]
        with open(log, "a") as fh:  # a plain append, not itself an os.replace
            fh.write(f"{Path(dst).resolve()}\n")

    os.replace = replace  # type: ignore[assignment]
    try:
        yield
    finally:
        os.replace = real


def main() -> int:
    log_dir, argv = Path(sys.argv[1]), sys.argv[2:]
    from attnuq.cli import main as cli_main

    with logging_writes(log_dir / f"writes_rank{os.environ.get('RANK', '0')}.txt"):
        return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
