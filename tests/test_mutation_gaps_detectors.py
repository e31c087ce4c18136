"""Tests for mutants of heads/detectors.py that the module's own tests did not see."""
