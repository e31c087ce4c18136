"""Actor runtime: loading, generation, replay, hidden-state readout, masking, data."""
