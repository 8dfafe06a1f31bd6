"""``python -m ring_attention.planner``."""

import sys

from .cli import main

sys.exit(main())
