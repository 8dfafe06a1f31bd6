"""``python -m ring_attention.planner``."""

from .cli import main

raise SystemExit(main())
