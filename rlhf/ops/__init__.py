"""Hardware facts and cost models used by benches and throughput metrics (no training logic)."""
