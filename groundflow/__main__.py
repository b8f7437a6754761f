"""``python -m groundflow ...`` is the ``groundflow`` command."""

import sys

from groundflow.cli import main

sys.exit(main())
