"""One router per area: answer, probes, ops."""
