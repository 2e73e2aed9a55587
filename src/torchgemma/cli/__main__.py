"""``python -m torchgemma.cli``: the ``torchgemma`` command."""

import sys

from . import main

sys.exit(main())
