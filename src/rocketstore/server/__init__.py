"""``rocketstore serve``: RocketMQ 5's gRPC protocol in front of one store, for the official clients.

``Server(store, "127.0.0.1:8081").start()`` in Python; ``rocketstore serve --store DIR`` on the command line.
"""

from __future__ import annotations

import logging
import threading
from concurrent import futures

import grpc

from ..errors import ConfigError
from ..store import MessageStore
from .auth import Accounts
from .service import MessagingService

log = logging.getLogger("rocketstore.server")

# Receives long-poll for up to 30 s, each holding a thread: room for many consumers plus the sends.
WORKER_THREADS = 64


class Server:
    """A gRPC server of ``MessagingService`` over ``store`` (which stays the caller's to close)."""

    def __init__(self, store: MessageStore, listen: str = "127.0.0.1:8081", *, auto_create_topics: bool = True,
                 max_attempts: int = 16, transaction_check_ms: int = 6_000, accounts: Accounts | None = None) -> None:
        if store.read_only:
            raise ConfigError("rocketstore serve needs a writable store (it stores what clients send)")
        self.store = store
        self.service = MessagingService(store, auto_create_topics=auto_create_topics, max_attempts=max_attempts,
                                        transaction_check_ms=transaction_check_ms, accounts=accounts)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="rocketstore-rpc"),
                                 options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20),
                                          ("grpc.so_reuseport", 0)])
        self._grpc.add_generic_rpc_handlers([self.service.handler()])
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--listen takes HOST:PORT (e.g. 127.0.0.1:8081), not {listen!r}")
        try:
            self.port = self._grpc.add_insecure_port(listen)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {listen}: {exc}") from None
        if self.port == 0:
            raise ConfigError(f"cannot listen on {listen} (in use, or not an address of this host)")
        self.address = f"{host}:{self.port}"
        self.service.listening_on(host, self.port)
        self._stopped = threading.Event()

    def start(self) -> Server:
        self.service.start()
        self._grpc.start()
        log.info("listening on %s (store %s)", self.address, self.store.root)
        return self

    def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, let running ones finish (long polls are answered at once), then return."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.service.close()
        self._grpc.stop(grace).wait()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


__all__ = ["Accounts", "Server"]
