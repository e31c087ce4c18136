"""Mutation gaps (placeholder while the run is prepared)."""
