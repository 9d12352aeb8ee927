"""RocketMQ 5's gRPC protocol (``apache.rocketmq.v2``), built from a descriptor set in a private pool.

The .proto files are apache/rocketmq-apis' own (``proto/``, vendored with their license);
``proto/messaging.desc`` is what ``protoc --include_imports --descriptor_set_out`` makes of them
(``python -m rocketstore.server.protocol --regenerate``; a test checks it matches the sources). The
message classes are made at import from that set, in a descriptor pool of their own, because:

* the runtime needs only protobuf and grpcio: no protoc, no generated modules to keep in step;
* the official Python client registers the same ``apache.rocketmq.v2`` names (an older version of the
  same files) in protobuf's default pool; generated modules of ours would collide with it in any process
  that imports both (a test, an application embedding the server next to its clients).
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path
from types import SimpleNamespace

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal.enum_type_wrapper import EnumTypeWrapper

PACKAGE = "apache.rocketmq.v2"
SERVICE = f"{PACKAGE}.MessagingService"
PROTO_DIR = Path(__file__).parent / "proto"
SOURCES = ("apache/rocketmq/v2/definition.proto", "apache/rocketmq/v2/service.proto")


def _load() -> tuple[descriptor_pool.DescriptorPool, SimpleNamespace]:
    files = descriptor_pb2.FileDescriptorSet.FromString(
        resources.files(__package__).joinpath("proto/messaging.desc").read_bytes()).file
    pool = descriptor_pool.DescriptorPool()
    for proto in files:
        pool.Add(proto)
    classes = message_factory.GetMessages(list(files), pool=pool)
    names: dict[str, object] = {}
    for full_name, cls in classes.items():
        if full_name.startswith(PACKAGE + ".") and full_name.count(".") == PACKAGE.count(".") + 1:
            names[full_name.rsplit(".", 1)[1]] = cls
        elif full_name.startswith("google.protobuf."):
            names[full_name.rsplit(".", 1)[1]] = cls  # Duration, Timestamp
    for proto in files:
        if proto.package == PACKAGE:
            for enum in proto.enum_type:
                names[enum.name] = EnumTypeWrapper(pool.FindEnumTypeByName(f"{PACKAGE}.{enum.name}"))
    return pool, SimpleNamespace(**names)


POOL, pb = _load()


def service_methods() -> list[tuple[str, type, type, bool, bool]]:
    """(name, request class, response class, client streaming, server streaming) of every rpc."""
    service = POOL.FindServiceByName(SERVICE)
    return [(m.name, getattr(pb, m.input_type.name), getattr(pb, m.output_type.name), m.client_streaming,
             m.server_streaming) for m in service.methods]


def compile_descriptor_set() -> bytes:
    """What protoc makes of the vendored sources now (needs grpcio-tools, a development dependency)."""
    import tempfile

    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "messaging.desc"
        include = resources.files("grpc_tools").joinpath("_proto")
        code = protoc.main(["protoc", f"-I{PROTO_DIR}", f"-I{include}", "--include_imports",
                            f"--descriptor_set_out={out}", *SOURCES])
        if code != 0:
            raise RuntimeError(f"protoc failed ({code})")
        return out.read_bytes()


if __name__ == "__main__":  # python -m rocketstore.server.protocol --regenerate
    if sys.argv[1:] != ["--regenerate"]:
        raise SystemExit("usage: python -m rocketstore.server.protocol --regenerate")
    (PROTO_DIR / "messaging.desc").write_bytes(compile_descriptor_set())
    print(f"wrote {PROTO_DIR / 'messaging.desc'}")
