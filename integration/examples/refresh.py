#!/usr/bin/env python3
"""refresh.py: an inference server's side of refit in Python, through the
ctypes binding (integration/python/refit.py). Registers one buffer and
refreshes it from whatever sources are publishing.

    refresh.py LIBRARY HOST:PORT TOKEN_FILE OUT_FILE [NETWORK_DEVICE]

The buffer holds rows 2..5 of the tensor "example.w" (F32, shape [8, 16],
row-major): 4 x 16 floats. After the refresh it prints the report and writes
the buffer's 256 bytes to OUT_FILE. A source must be serving "example.w"
through the coordinator at HOST:PORT (tests/e2e/examples_test.cc starts one).
NETWORK_DEVICE restricts UCX to one device, e.g. "lo" on one host.

Exit status: 0 when refreshed and written, 1 on a refit error, 2 on bad
arguments.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import refit  # noqa: E402

ROWS, COLS = 4, 16


def main(argv):
    if len(argv) not in (5, 6):
        print(f"usage: {argv[0]} LIBRARY HOST:PORT TOKEN_FILE OUT_FILE [NETWORK_DEVICE]", file=sys.stderr)
        return 2
    library, address, token_file, out_file = argv[1:5]
    network = {"transports": ["tcp"]}
    if len(argv) == 6:
        network["devices"] = [argv[5]]
    config = {"rank": 0, "domain": 0, "instance": 0,
              "coordinator": {"address": address, "token_file": token_file, "timeout_ms": 10000},
              "network": network}
    rows = bytearray(ROWS * COLS * 4)
    try:
        lib = refit.Library(library)
        with lib.receiver(config) as rx:
            rx.add_buffer({"name": "w_rows", "dtype": "F32",
                           "segments": [{"tensor": "example.w", "start": [2, 0], "size": [ROWS, COLS],
                                         "offset": 0, "strides": [COLS, 1]}]}, rows)
            version = rx.refresh(refit.LATEST, timeout_ms=30000)
            print(f"refreshed to version {version}: {json.dumps(rx.report())}")
    except refit.RefitError as e:
        print(f"refresh.py: {e}", file=sys.stderr)
        return 1
    with open(out_file, "wb") as f:
        f.write(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
