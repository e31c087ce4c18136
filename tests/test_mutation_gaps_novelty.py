"""Tests for mutants of heads/novelty.py that the module's own tests did not see."""
