"""``python -m qkv ...``: the ``qkv`` command (``qkv.cli.main``)."""

import sys

from .cli import main

sys.exit(main())
