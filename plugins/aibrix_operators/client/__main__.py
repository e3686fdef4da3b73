"""``python -m aibrix_operators.client`` is ``aibrix-batch``."""

import sys

from aibrix_operators.client.cli import main

sys.exit(main())
