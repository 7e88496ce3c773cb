"""``python -m attnuq.cli``: the ``attnuq`` command."""

import sys

from attnuq.cli import main

sys.exit(main())
