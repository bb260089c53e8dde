"""Reports: dependency-free chart output (PNG) for run summaries."""
