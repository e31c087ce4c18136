"""Studies and sweeps: one-off measurements behind the reports in docs/ (`python -m studies.X`).

Nothing here serves: the runtime packages (`app`, `heads`, `models`, `clients`) never import
it, and it may import any of them (docs/architecture.md, the import rules).
"""
