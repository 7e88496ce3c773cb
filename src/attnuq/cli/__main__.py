"""``python -m attnuq.cli``: the ``attnuq`` command."""

import sys

try:
    from attnuq.cli import main
except KeyboardInterrupt:  # Ctrl-C while importing torch: no traceback, SIGINT's status
    print("attnuq: interrupted", file=sys.stderr)
    sys.exit(130)

sys.exit(main())
