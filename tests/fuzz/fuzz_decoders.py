"""Coverage-guided fuzzing (atheris) of every decoder that reads untrusted bytes.

    python tests/fuzz/fuzz_decoders.py -max_total_time=60

Any exception that is not a ``rocketstore.errors.RocketStoreError`` is a crash, as is the fast
recovery scan disagreeing with the reference validator.
"""

from __future__ import annotations

import contextlib
import sys

import atheris

# Only rocketstore is instrumented (numpy, numba and pyarrow took ~18 s to instrument and slowed every run);
# _kernels is compiled by numba, so it has no tracing hooks.
with atheris.instrument_imports(include=["rocketstore"], exclude=["rocketstore.codec._kernels"]):
    from rocketstore.codec import decode_offset_msg_id, decode_properties, decode_record, decode_uniq_key
    from rocketstore.codec.batch import validate_records
    from rocketstore.codec.record import read_layout
    from rocketstore.errors import RocketStoreError


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    choice = fdp.ConsumeIntInRange(0, 3)
    if choice == 0:
        blob = fdp.ConsumeBytes(fdp.remaining_bytes())
        with contextlib.suppress(RocketStoreError):
            decode_record(blob, 0, check_crc=True, decompress=True, max_body_size=1 << 20)
        stop, count, _last = validate_records(blob, 0, len(blob), check_crc=True)
        pos = 0
        for _ in range(count):
            pos += read_layout(blob, pos, len(blob), check_crc=True).size
        assert pos == stop
    elif choice == 1:
        text = fdp.ConsumeUnicodeNoSurrogates(fdp.remaining_bytes())
        for name, value in decode_properties(text).items():
            assert name and value and "\x02" not in name
    else:
        text = fdp.ConsumeUnicodeNoSurrogates(64)
        with contextlib.suppress(RocketStoreError):
            (decode_offset_msg_id if choice == 2 else decode_uniq_key)(text)


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
