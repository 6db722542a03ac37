"""The one exception the protocol layers raise for a peer's mistake."""

from __future__ import annotations

from broker.packets import ReasonCode


class MQTTError(Exception):
    """A protocol violation by the peer: the connection ends with ``reason_code``.

    Raised by the codec and the session layer; the connection layer turns it
    into a DISCONNECT (MQTT 5) or a closed socket (3.1.1), or a CONNACK when it
    happens while the CONNECT itself is processed.
    """

    def __init__(self, reason_code: ReasonCode, message: str) -> None:
        super().__init__(message)
        self.reason_code = reason_code

    def __str__(self) -> str:
        return f"{self.reason_code.name.lower()}: {self.args[0]}"
