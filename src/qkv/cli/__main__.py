"""``python -m qkv.cli ...`` (what ``torchrun -m qkv.cli train ...`` runs)."""

import sys

from . import main

sys.exit(main())
