"""devicemq loadtest."""
