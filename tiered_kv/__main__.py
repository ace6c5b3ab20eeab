"""``python -m tiered_kv``: the ``tiered-kv`` command."""

import sys

from tiered_kv.cli import main

sys.exit(main())
