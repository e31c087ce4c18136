"""`python -m dualread ...` is `dualread ...`."""

from dualread.cli import main

main()
