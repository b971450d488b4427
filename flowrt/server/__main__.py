"""``python -m flowrt.server`` is ``flowrt serve``."""

import sys

from .cli import main

sys.exit(main())
