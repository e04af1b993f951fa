"""``python -m kit`` is the ``kit`` command."""

import sys

from kit.cli import main

sys.exit(main())
