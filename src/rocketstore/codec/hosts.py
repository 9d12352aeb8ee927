"""Born and store hosts: raw address bytes (4 or 16) followed by the port as an i32."""

from __future__ import annotations

import functools
import ipaddress
import socket
import struct
from typing import NamedTuple

from ..errors import InvalidFlagError

_PORT = struct.Struct(">i")


class Host(NamedTuple):
    """A socket address as RocketMQ stores it. ``str()`` gives Java's form, e.g. ``2001:db8:0:0:0:0:0:1:40000``."""

    ip: str
    port: int

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.ip

    def to_bytes(self) -> bytes:
        family = socket.AF_INET6 if self.is_ipv6 else socket.AF_INET
        return socket.inet_pton(family, self.ip) + _PORT.pack(self.port)

    @classmethod
    def from_bytes(cls, raw: bytes | bytearray | memoryview) -> Host:
        return host_of(bytes(raw))

    @classmethod
    def _decode(cls, raw: bytes) -> Host:
        if len(raw) == 8:
            return cls(socket.inet_ntop(socket.AF_INET, raw[:4]), _PORT.unpack_from(raw, 4)[0])
        if len(raw) == 20:
            return cls(socket.inet_ntop(socket.AF_INET6, raw[:16]), _PORT.unpack_from(raw, 16)[0])
        raise ValueError(f"a host is 8 or 20 bytes, not {len(raw)}")

    @classmethod
    def parse(cls, text: str | Host | tuple[str, int]) -> Host:
        """Accept ``1.2.3.4:10911``, ``[2001:db8::1]:10911``, Java's ``2001:db8:0:0:0:0:0:1:10911`` or a tuple."""
        if isinstance(text, tuple):
            if len(text) != 2 or not isinstance(text[0], str) or type(text[1]) is not int:
                raise InvalidFlagError(f"a host pair is (ip text, port number), not {text!r}")
            ip, port = text
        elif not isinstance(text, str):
            raise InvalidFlagError(f"a host is 'ip:port' text or an (ip, port) pair, not {type(text).__name__}")
        else:
            raw = text.strip().lstrip("/")
            if raw.startswith("["):
                ip, _, port_text = raw[1:].partition("]:")
            else:
                ip, _, port_text = raw.rpartition(":")
            try:
                port = int(port_text)
            except ValueError:
                raise InvalidFlagError(f"not a host:port address: {text!r}") from None
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            raise InvalidFlagError(f"not an IP address: {ip!r}") from None
        if not 0 <= port <= 0xFFFF:
            raise InvalidFlagError(f"port out of range in {text!r}")
        family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
        return cls(socket.inet_ntop(family, address.packed), port)  # the same spelling as from_bytes

    def __str__(self) -> str:
        if not self.is_ipv6:
            return f"{self.ip}:{self.port}"
        groups = struct.unpack(">8H", socket.inet_pton(socket.AF_INET6, self.ip))
        return ":".join(f"{g:x}" for g in groups) + f":{self.port}"


@functools.lru_cache(maxsize=4096)
def host_of(raw: bytes) -> Host:
    """Hosts repeat (one store host, a few producers): every read decodes the same few bytes."""
    return Host._decode(raw)
