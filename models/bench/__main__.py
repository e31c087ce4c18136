"""`python -m models.bench ...` is `dualread bench ...`."""

import sys

from app.cli import app

sys.argv = ["dualread", "bench", *sys.argv[1:]]
app()
