"""Access control: RocketMQ 5's signed ``authorization`` metadata, checked on every call.

The clients sign the ``x-mq-date-time`` header with their secret key and send
``authorization: MQv2-HMAC-SHA1 Credential=<access key>, SignedHeaders=x-mq-date-time, Signature=<hex>``,
the signature being HMAC-SHA1(secret key, date-time) in hex. A call without it, with an unknown access key
or with a signature that does not match is refused with UNAUTHORIZED before its handler runs. The date-time
is not checked for freshness: the official Python client sends local time marked as UTC, so a clock window
would refuse honest clients in other time zones.

Accounts come from ``--access-key/--secret-key`` or a file of ``ACCESS_KEY SECRET_KEY`` lines (``#`` starts
a comment), so a secret need not appear in a process list.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from ..errors import ConfigError

SCHEME = "MQv2-HMAC-SHA1"


class Accounts:
    """Access key -> secret key."""

    def __init__(self, pairs: dict[str, str]) -> None:
        for access_key, secret_key in pairs.items():
            if not access_key or not secret_key or any(c.isspace() or c == "," for c in access_key):
                raise ConfigError(f"account {access_key!r}: an access key is a non-empty word without commas, "
                                  f"and needs a non-empty secret key")
        self.secrets = dict(pairs)

    @classmethod
    def from_file(cls, path: str | Path) -> Accounts:
        try:
            text = Path(path).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read accounts file {path}: {exc}") from None
        pairs: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split("#", 1)[0].split()
            if not words:
                continue
            if len(words) != 2:
                raise ConfigError(f"{path}, line {number}: expected ACCESS_KEY SECRET_KEY, found {len(words)} words")
            if words[0] in pairs:
                raise ConfigError(f"{path}, line {number}: access key {words[0]!r} appears twice")
            pairs[words[0]] = words[1]
        if not pairs:
            raise ConfigError(f"accounts file {path} names no account")
        return cls(pairs)

    def refusal(self, metadata) -> str | None:
        """Why a call with this metadata is refused, or None when it is signed by a known account."""
        headers = {key: value for key, value in metadata}
        authorization = headers.get("authorization")
        if not authorization:
            return "the request is not signed (no authorization metadata); this server requires credentials"
        scheme, _, rest = authorization.partition(" ")
        fields = {}
        for part in rest.split(","):
            name, _, value = part.strip().partition("=")
            fields[name] = value
        if scheme != SCHEME or not {"Credential", "SignedHeaders", "Signature"} <= fields.keys():
            return f"authorization is not in the {SCHEME} form"
        secret = self.secrets.get(fields["Credential"])
        if secret is None:
            return f"unknown access key {fields['Credential'][:64]!r}"
        signed = fields["SignedHeaders"].lower()
        if signed != "x-mq-date-time" or "x-mq-date-time" not in headers:
            return "the signature must cover x-mq-date-time"
        expected = sign(secret, headers["x-mq-date-time"])
        if not hmac.compare_digest(fields["Signature"].lower(), expected):
            return "signature does not match"
        return None


def sign(secret_key: str, date_time: str) -> str:
    return hmac.new(secret_key.encode(), date_time.encode(), hashlib.sha1).hexdigest()


def authorization(access_key: str, secret_key: str, date_time: str) -> list[tuple[str, str]]:
    """The metadata a client sends (for tools and tests speaking the protocol without a client)."""
    return [("x-mq-date-time", date_time),
            ("authorization", f"{SCHEME} Credential={access_key}, SignedHeaders=x-mq-date-time, "
                              f"Signature={sign(secret_key, date_time)}")]
