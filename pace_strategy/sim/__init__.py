"""What-if simulator of synchronous data-parallel training that reuses the real pacing policy."""
