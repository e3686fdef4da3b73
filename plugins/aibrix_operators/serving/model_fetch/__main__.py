"""``python -m aibrix_operators.serving.model_fetch``: what the vLLM pods' init containers run."""

import sys

from aibrix_operators.serving.model_fetch.cli import main

sys.exit(main())
