"""A real ``rocketstore serve`` for the serve tests: a subprocess on 127.0.0.1 with an ephemeral port, spoken to
with raw gRPC calls built from rocketstore's own protocol classes, stopped by its pid."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from rocketstore import StoreConfig
from rocketstore.server.protocol import SERVICE

SMALL = ["--max-hash-slot-num", "97", "--max-index-num", "400"]
CONFIG = StoreConfig(max_hash_slot_num=97, max_index_num=400)


class Served:
    """A running ``rocketstore serve`` subprocess, stopped by its pid."""

    def __init__(self, root: Path, *args: str, listen: str = "127.0.0.1:0") -> None:
        self.root = root
        self.proc = subprocess.Popen([sys.executable, "-m", "rocketstore.cli.app", "serve", "--store", str(root),
                                      "--listen", listen, *SMALL, *args], stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            found = re.search(r"serve: listening on (\S+:\d+)", line)
            if found:
                self.address = found.group(1)
                self.port = int(self.address.rpartition(":")[2])
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.proc.kill()
        raise AssertionError("serve did not start: " + "".join(self.lines))

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def call(self, method: str, request, response_type, *, stream: bool = False, address: str | None = None,
             timeout: float = 10):
        with grpc.insecure_channel(address or self.address) as channel:
            path = f"/{SERVICE}/{method}"
            if stream:
                rpc = channel.unary_stream(path, request_serializer=type(request).SerializeToString,
                                           response_deserializer=response_type.FromString)
                return list(rpc(request, timeout=timeout))
            rpc = channel.unary_unary(path, request_serializer=type(request).SerializeToString,
                                      response_deserializer=response_type.FromString)
            return rpc(request, timeout=timeout)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """A signal by pid (SIGTERM: a graceful stop that closes the store); the exit code. A server that has not
        stopped 30 s later is asked for its threads' stacks (SIGUSR1), killed, and reported with its log."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGUSR1)
            time.sleep(2)
            self.proc.kill()
            self.proc.wait(30)
            time.sleep(0.5)  # the drain thread reads the rest of stderr
            raise AssertionError("serve did not stop within 30 s; its log and stacks:\n"
                                 + "".join(self.lines)[-20000:]) from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
