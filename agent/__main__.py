"""``python -m agent ...`` runs ``elaswave agent ...``."""

from __future__ import annotations

import sys

from agent.cli import main

sys.exit(main())
