"""The `dualread` command line (`dualread.cli:main`, also `python -m dualread`): the top of
the import layers, above `studies`/`bench`, `app`, `heads`, `models` and `clients`.

The library itself stays in those top-level packages; docs/architecture.md says why they
are not (yet) installed under this name.
"""
