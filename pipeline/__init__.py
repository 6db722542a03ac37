"""devicemq pipeline."""
