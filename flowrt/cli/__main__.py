"""``python -m flowrt.cli``: the ``flowrt`` command."""

import sys

from .commands import main

sys.exit(main())
