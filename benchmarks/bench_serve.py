"""`rocketstore serve` with the official Python client, against a no-op MessagingService on the same grpc server.

Each server runs in its own process on 127.0.0.1 with an ephemeral port (stopped by pid); the client
(rocketmq-python-client) runs here. The no-op service answers routes, heartbeats and telemetry like the real
one, but SendMessage stores nothing and ReceiveMessage hands out one canned batch: the rate the client and
the grpc server can reach at all, so the ratio is what storing, dispatching and popping cost on top.

Rows: send rate and p99 latency with 1 and 8 producer threads (target: >= 0.5x the no-op's rate), and a
SimpleConsumer's receive+ack rate over everything sent (every sent message id must come back; duplicates
beyond at-least-once are counted and reported).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

import numpy as np
from harness import Result, bench_main, run_threads

HERE = Path(__file__).resolve().parent
SMALL = ["--max-hash-slot-num", "50021", "--max-index-num", "200000"]
CANNED_BODY = b"x" * 100
CANNED_CRC = f"{zlib.crc32(CANNED_BODY):08X}"  # a wrong digest costs the client an error log line per message


# --- the servers ---------------------------------------------------------------------------------------

def noop_main(root: str) -> None:
    """Serve the no-op MessagingService until SIGTERM (run as ``bench_serve.py --noop ROOT``)."""
    from rocketstore import MessageStore, StoreConfig
    from rocketstore.server import Server
    from rocketstore.server import service as real
    from rocketstore.server.protocol import pb

    class NoopService(real.MessagingService):
        def SendMessage(self, request, context):
            entries = [pb.SendResultEntry(status=real.status(), message_id=m.system_properties.message_id, offset=0)
                       for m in request.messages]
            self.metrics.add("sent", len(entries))
            return pb.SendMessageResponse(status=real.status(), entries=entries)

        def ReceiveMessage(self, request, context):
            yield pb.ReceiveMessageResponse(status=real.status())
            yield pb.ReceiveMessageResponse(delivery_timestamp=real._stamp(time.time_ns() // 1_000_000))
            for i in range(max(1, request.batch_size or 32)):
                system = pb.SystemProperties(message_id=f"{i:032X}", body_encoding=pb.Encoding.IDENTITY,
                                             born_timestamp=real._stamp(0), born_host="127.0.0.1",
                                             store_timestamp=real._stamp(0), store_host="127.0.0.1:10911",
                                             queue_id=0, queue_offset=i, delivery_attempt=1, receipt_handle="noop",
                                             body_digest=pb.Digest(type=pb.DigestType.CRC32, checksum=CANNED_CRC))
                system.invisible_duration.FromSeconds(30)
                yield pb.ReceiveMessageResponse(message=pb.Message(topic=request.message_queue.topic,
                                                                   system_properties=system, body=CANNED_BODY))

        def AckMessage(self, request, context):
            entries = [pb.AckMessageResultEntry(message_id=e.message_id, receipt_handle=e.receipt_handle,
                                                status=real.status()) for e in request.entries]
            return pb.AckMessageResponse(status=real.status(), entries=entries)

    sys.setswitchinterval(0.0005)  # as `rocketstore serve` sets it
    with MessageStore.open(root, StoreConfig(max_hash_slot_num=50021, max_index_num=200000)) as store:
        server = Server(store, "127.0.0.1:0", service=NoopService(store)).start()  # the same grpc server as serve's
        print(f"listening on {server.address}", file=sys.stderr, flush=True)
        stopped = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stopped.set())
        stopped.wait()
        server.stop(1)


class Running:
    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            found = re.search(r"listening on (127\.0\.0\.1:\d+)", line)
            if found:
                self.address = found.group(1)
                threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
                return
        raise RuntimeError(f"server did not start (exit {self.proc.wait()})")

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(root: Path, noop: bool) -> Running:
    if noop:
        return Running([sys.executable, str(Path(__file__).resolve()), "--noop", str(root)])
    return Running([sys.executable, "-m", "rocketstore.cli.app", "serve", "--store", str(root), "--listen",
                    "127.0.0.1:0", *SMALL])


# --- the client side ---------------------------------------------------------------------------------------

def client_config(address: str):
    from rocketmq import ClientConfiguration, Credentials

    return ClientConfiguration(address, Credentials(), request_timeout=10)


def sends(address: str, threads: int, seconds: float) -> tuple[float, float, list[str]]:
    """(messages/s, p99 µs, every message id acknowledged) of ``threads`` threads sharing one producer."""
    from rocketmq import Message, Producer

    producer = Producer(client_config(address), ("Bench",))
    producer.startup()
    ids: list[list[str]] = [[] for _ in range(threads)]
    body = b"x" * 100

    def send(n: int, i: int) -> None:
        msg = Message()
        msg.topic = "Bench"
        msg.body = body
        msg.tag = "T"
        msg.keys = f"k-{n}-{i}"
        ids[n].append(producer.send(msg).message_id)

    try:
        send(0, -1)  # routes and settings are fetched before timing (its id stays: the consumer must get it too)
        rate, latencies = run_threads(send, threads, seconds)
    finally:
        producer.shutdown()
    return rate, float(np.percentile(latencies, 99)) / 1000, [i for mine in ids for i in mine]


INVISIBLE_S = 10


def receives(address: str, want: set[str] | None, seconds: float) -> tuple[float, list[str], int]:
    """(messages/s, every message id received, how many came back only after their invisible time) of one
    SimpleConsumer receiving and acking, until every id in ``want`` came back (or, for the no-op, for
    ``seconds``).

    Done is decided by ids, not by a count: a count also counts what was stored but not in ``want`` and
    redeliveries, and stopped short when it reached the number. The rate counts up to the first empty
    receive. A message handed out in a receive whose answer the client never saw is invisible for
    INVISIBLE_S and then delivered again (at-least-once): only one still missing after that counts as lost."""
    from rocketmq import FilterExpression, SimpleConsumer

    consumer = SimpleConsumer(client_config(address), "BenchGroup", {"Bench": FilterExpression()}, await_duration=2)
    consumer.startup()
    got: list[str] = []
    missing = set(want or ())
    late = 0
    try:
        started = time.perf_counter()
        deadline = started + (seconds if want is None else max(120.0, seconds))
        while (want is None or missing) and time.perf_counter() < deadline:
            batch = consumer.receive(32, INVISIBLE_S)
            for m in batch:
                consumer.ack(m)
                got.append(m.message_id)
                missing.discard(m.message_id)
            if want is not None and not batch:
                break
        took = time.perf_counter() - started
        if missing:
            redelivery_deadline = time.perf_counter() + INVISIBLE_S + 5
            while missing and time.perf_counter() < redelivery_deadline:
                batch = consumer.receive(32, INVISIBLE_S)
                for m in batch:
                    consumer.ack(m)
                    got.append(m.message_id)
                    missing.discard(m.message_id)
                    late += 1
    finally:
        consumer.shutdown()
    return len(got) / took, got, late


def run(quick: bool) -> list[Result]:
    seconds = 1.0 if quick else 5.0
    results: list[Result] = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        measured: dict[bool, dict] = {}
        for noop in (True, False):
            server = start(Path(tmp) / ("noop" if noop else "store"), noop)
            try:
                rows = {}
                sent: list[str] = []
                for threads in (1, 8):
                    rate, p99, ids = sends(server.address, threads, seconds)
                    rows[threads] = (rate, p99)
                    sent += ids
                recv_rate, got, late = receives(server.address, None if noop else set(sent), seconds)
                measured[noop] = {"send": rows, "receive": recv_rate, "sent": sent, "got": got, "late": late}
            finally:
                server.stop()
        real, noop = measured[False], measured[True]
        lost = len(set(real["sent"]) - set(real["got"]))
        duplicated = len(real["got"]) - len(set(real["got"]))
        if lost:
            raise AssertionError(f"{lost} acknowledged sends never came back to the consumer")
        strangers = set(real["got"]) - set(real["sent"])
        if strangers:
            raise AssertionError(f"the consumer received {len(strangers)} message ids that were never sent")
        for threads in (1, 8):
            label = f"{threads} producer thread{'s' * (threads > 1)}"
            results.append(Result("serve (official Python client)", f"send, {label}", real["send"][threads][0],
                                  "msg/s", "no-op MessagingService", noop["send"][threads][0], 0.5))
            results.append(Result("serve (official Python client)", f"send p99, {label}", real["send"][threads][1],
                                  "us", "no-op MessagingService", noop["send"][threads][1],
                                  higher_is_better=False))
        results.append(Result("serve (official Python client)", "receive + ack, 1 SimpleConsumer", real["receive"],
                              "msg/s", "no-op MessagingService", noop["receive"],
                              notes={"sent": len(real["sent"]), "received": len(real["got"]), "lost": lost,
                                     "duplicated": duplicated, "redelivered after invisible": real["late"]}))
    return results


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--noop":
        noop_main(sys.argv[2])
        raise SystemExit(0)
    raise SystemExit(bench_main("serve", run, __doc__.splitlines()[0]))
