"""The network edge: the asyncio listeners (TCP, TLS, WebSocket) that carry bytes to
and from the sans-IO broker, and the logging set-up (docs/ARCHITECTURE.md)."""
