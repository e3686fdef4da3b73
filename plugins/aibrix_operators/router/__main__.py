"""``python -m aibrix_operators.router``: run the P/D router."""

from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
