"""SIP digest authentication, server side (RFC 3261 §22, RFC 2617 qop=auth, RFC 8760 SHA-256).

Nonces are stateless: `<time hex>.<HMAC(secret, time)>`, valid for `NONCE_TTL_S`; an older one is answered with a
fresh challenge marked `stale=true`, so the caller retries without asking its user again. We challenge with
SHA-256 first and MD5 second (RFC 8760 §2.4: in order of preference; most trunks and baresip speak MD5 only).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

NONCE_TTL_S = 300.0
_HASHES = {"MD5": hashlib.md5, "SHA-256": hashlib.sha256}


@dataclass(frozen=True)
class DigestCheck:
    ok: bool
    stale: bool = False


class DigestAuth:
    def __init__(self, username: str, password: str, realm: str) -> None:
        self.username = username
        self.password = password
        self.realm = realm
        self._secret = secrets.token_bytes(32)

    def nonce(self, now: float | None = None) -> str:
        stamp = f"{int((now or time.time()) * 1000):x}"
        mac = hmac.new(self._secret, stamp.encode(), hashlib.sha256).hexdigest()[:32]
        return f"{stamp}.{mac}"

    def challenges(self, stale: bool = False) -> list[str]:
        """The WWW-Authenticate header values, one per algorithm."""
        nonce = self.nonce()
        extra = ", stale=true" if stale else ""
        return [f'Digest realm="{self.realm}", nonce="{nonce}", algorithm={alg}, qop="auth"{extra}'
                for alg in ("SHA-256", "MD5")]

    def check(self, params: dict[str, str], method: str) -> DigestCheck:
        """The Authorization header's parameters for a request of `method`."""
        algorithm = params.get("algorithm", "MD5").upper()
        if algorithm == "SHA256":
            algorithm = "SHA-256"
        digest = _HASHES.get(algorithm)
        nonce = params.get("nonce", "")
        if digest is None or params.get("username") != self.username or params.get("realm") != self.realm:
            return DigestCheck(False)

        def h(text: str) -> str:
            return digest(text.encode()).hexdigest()

        ha1 = h(f"{self.username}:{self.realm}:{self.password}")
        ha2 = h(f"{method}:{params.get('uri', '')}")
        qop = params.get("qop")
        if qop == "auth":
            expected = h(f"{ha1}:{nonce}:{params.get('nc', '')}:{params.get('cnonce', '')}:auth:{ha2}")
        elif qop is None:
            expected = h(f"{ha1}:{nonce}:{ha2}")
        else:
            return DigestCheck(False)
        if not hmac.compare_digest(expected, params.get("response", "")):
            return DigestCheck(False)
        stamp, _, mac = nonce.partition(".")
        good_mac = hmac.new(self._secret, stamp.encode(), hashlib.sha256).hexdigest()[:32]
        if not hmac.compare_digest(mac, good_mac):
            return DigestCheck(False)
        try:
            issued = int(stamp, 16) / 1000.0
        except ValueError:
            return DigestCheck(False)
        return DigestCheck(True) if time.time() - issued <= NONCE_TTL_S else DigestCheck(False, stale=True)
