"""Tests for mutants of heads/pixel_novelty.py that its own tests did not see.

No actor is built.
"""
