"""devicemq persistence."""
