"""``python -m commkit``: the ``commkit`` command (bench, tune, sim)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
