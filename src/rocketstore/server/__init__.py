"""``rocketstore serve``: RocketMQ 5's gRPC protocol in front of one store, for the official clients.

``Server(store, "127.0.0.1:8081").start()`` in Python; ``rocketstore serve --store DIR`` on the command line.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent import futures

import grpc

from ..errors import ConfigError
from ..store import MessageStore
from .auth import Accounts
from .renewal import RenewPolicy
from .service import MessagingService

log = logging.getLogger("rocketstore.server")

# Calls open at once, long polls and telemetry streams included (each official client keeps one telemetry stream
# and a consumer one receive open); one more is refused at once with RESOURCE_EXHAUSTED rather than queued.
MAX_CALLS = 1024
# Threads that run the short calls (sends, acks, routes...) and the receives' reads of the store. A waiting
# receive or an open telemetry stream is a task on the server's event loop and holds none.
WORKER_THREADS = 32
# What a stop gives running calls to finish (sends, acks; long polls are answered at once) before cancelling them.
STOP_GRACE_S = 5.0



def parse_listen(listen: str) -> tuple[str, int]:
    """``--listen``'s HOST:PORT checked before a store opens: a port past 65535 was bound modulo 65536 by grpc (99999
    listened on 34463), and an impossible IPv4 address failed in grpc's C core with a line of its own."""
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"--listen takes HOST:PORT, a port from 0 to 65535 (e.g. 127.0.0.1:8081), not {listen!r}")
    bare = host.strip("[]")
    if bare.replace(".", "").isdigit():
        import ipaddress

        try:
            ipaddress.IPv4Address(bare)
        except ValueError:
            raise ConfigError(f"--listen: {host} is not an IPv4 address") from None
    return host, int(port)

class Server:
    """A gRPC server of ``MessagingService`` over ``store`` (which stays the caller's to close).

    grpc's asyncio server, on an event loop of its own thread: the handlers that wait (ReceiveMessage's long
    poll, Telemetry) are coroutines, every other handler runs in ``WORKER_THREADS`` threads; calls beyond
    ``max_calls`` open at once get RESOURCE_EXHAUSTED.
    """

    def __init__(self, store: MessageStore, listen: str = "127.0.0.1:8081", *, auto_create_topics: bool = True,
                 max_attempts: int = 16, transaction_check_ms: int = 6_000, accounts: Accounts | None = None,
                 max_calls: int = MAX_CALLS, service: MessagingService | None = None,
                 renew_policy: RenewPolicy | None = None) -> None:
        if store.read_only:
            raise ConfigError("rocketstore serve needs a writable store (it stores what clients send)")
        host, _port = parse_listen(listen)
        self.store = store
        self.service = service or MessagingService(store, auto_create_topics=auto_create_topics,
                                                   max_attempts=max_attempts,
                                                   transaction_check_ms=transaction_check_ms, accounts=accounts,
                                                   renew_policy=renew_policy)
        self._workers = futures.ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="rocketstore-rpc")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._workers)  # ReceiveMessage reads the store there
        self._thread = threading.Thread(target=self._loop.run_forever, name="rocketstore-grpc", daemon=True)
        try:
            self._grpc, self.port = self._loop.run_until_complete(self._bind(listen, max_calls))
        except BaseException:
            self._loop.close()
            self._workers.shutdown()
            raise
        self.address = f"{host}:{self.port}"
        self.service.listening_on(host, self.port)
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()

    async def _bind(self, listen: str, max_calls: int) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(self._workers, maximum_concurrent_rpcs=max_calls,
                                 options=[("grpc.max_receive_message_length", 64 << 20),
                                          ("grpc.max_send_message_length", 64 << 20),
                                          ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers([self.service.handler()])
        try:
            port = server.add_insecure_port(listen)
        except RuntimeError as exc:
            raise ConfigError(f"cannot listen on {listen}: {exc}") from None
        if port == 0:
            raise ConfigError(f"cannot listen on {listen} (in use, or not an address of this host)")
        return server, port

    def _run(self, coroutine, timeout: float | None = None):
        """Run ``coroutine`` on the server's loop, from another thread, and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> Server:
        self.service.start()
        self._thread.start()
        self._run(self._grpc.start())
        log.debug("listening on %s (store %s)", self.address, self.store.root)  # the command line says it
        return self

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop serving; when this returns, no call is using the store (which can then be closed).

        New calls are refused at once; long polls are answered (no message) and telemetry streams end; other
        running calls get up to ``grace`` seconds to finish, then are cancelled; last, the store work they
        started in the worker threads is waited for (a cancelled call's put still completes, or fails, before
        the store is closed under it)."""
        with self._stop_lock:
            if self._stopped.is_set():
                return
            if self._thread.is_alive():
                stopping = asyncio.run_coroutine_threadsafe(self._grpc.stop(grace), self._loop)  # refuses new calls
                self.service.close()
                stopping.result()
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
            else:
                self.service.close()
            self._workers.shutdown(wait=True)
            self._loop.close()
            self.service.save_pop_state()  # again: calls that ran on through the grace period may have acked
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once ``stop`` has finished (within ``timeout`` seconds)."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


__all__ = ["Accounts", "RenewPolicy", "Server"]
