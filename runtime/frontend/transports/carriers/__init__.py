"""Phone carriers' media streams: one transport each on the lifecycle's seam (issue 32)."""
