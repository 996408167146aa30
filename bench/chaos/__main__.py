"""``python -m bench.chaos``: the soak (bench/chaos/__init__.py says what it does)."""

import sys

from bench.chaos.run import main

sys.exit(main())
