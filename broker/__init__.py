"""devicemq: an asyncio MQTT 3.1.1 / 5.0 broker with persistent device sessions."""

__version__ = "0.1.0"
