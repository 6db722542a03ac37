"""What a failed TLS handshake says, sorted into the few things an operator can fix.

Redis and Kafka clients (persistence/redis_security.py, kafka_security.py) name
their own settings for each kind; the reading of OpenSSL's reasons is here once.
"""

from __future__ import annotations

import ssl

CLIENT_CERT_REQUIRED = "client certificate required"
HOSTNAME = "host name"
EXPIRED = "expired"
UNSIGNED = "not signed by the CA"
CLIENT_CERT_REFUSED = "client certificate refused"
NOT_TLS = "not TLS"
OTHER = "other"


def reason(error: ssl.SSLError) -> str:
    """OpenSSL's reason and, for a failed verification, what failed."""
    detail = getattr(error, "verify_message", None) or error.reason or str(error)
    return f"{error.reason}: {detail}" if detail != error.reason else str(detail)


def kind(text: str) -> str:
    """One of the kinds above for a reason text (:func:`reason`)."""
    upper = text.upper()
    if "CERTIFICATE_REQUIRED" in upper:
        return CLIENT_CERT_REQUIRED
    if "HOSTNAME" in upper or "IP ADDRESS MISMATCH" in upper:
        return HOSTNAME
    if "EXPIRED" in upper:
        return EXPIRED
    if "VERIFY" in upper or "SELF" in upper:
        return UNSIGNED
    if "UNKNOWN_CA" in upper or "BAD_CERTIFICATE" in upper:
        return CLIENT_CERT_REFUSED
    if "WRONG_VERSION" in upper or "RECORD_LAYER" in upper or "PACKET_LENGTH" in upper:
        return NOT_TLS
    return OTHER


def explain(service: str, text: str, hints: dict[str, str]) -> str:
    """One line for a failed handshake with ``service``: the reason and the hint of its
    kind (``hints[OTHER]`` for a kind without one of its own)."""
    return f"TLS with {service} failed ({text}): {hints.get(kind(text), hints[OTHER])}"
