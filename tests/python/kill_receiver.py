"""One vLLM worker of test_vllm_kill.py: vLLM's LlamaForCausalLM at tp 2 on
the CPU, refreshed through refit's engine with "verify" on (every box is
checked against its source's hash).

Version 1 lands. For version 2, this worker writes pulling2.<rank> when its
refresh has its plan and starts pulling (refit's log line "refresh to 2:
plan after"), and landed2.<rank> (the progress, as JSON) once refit's
progress says that bytes of version 2 have landed here: the events on which
the test kills trainer rank 1, which stopped itself after publishing. The
refresh fails, finish commits nothing, and every parameter must still be at
version 1. Version 3, published by rank 0 and a new rank 1, must land and
verify.

    kill_receiver.py RANK PORT DIR
"""

import json
import re
import sys
import threading
import time
from pathlib import Path

import torch

import refit
from vllm_receiver import build, make_engine, mismatches, set_current_vllm_config, wait_for

TP = 2
TRAINERS = 2


def main(rank, port, out):
    vc, model, reference = build(rank, port, out, TP)

    def on_line(level, line):
        # refit's threads: no refit calls here, only the event file.
        m = re.search(r"refresh to (\d+): plan after", line)
        if m:
            (out / f"pulling{m.group(1)}.{rank}").write_text(line)

    refit.set_log_handler(on_line)

    def expect(version):
        reference.load_weights(torch.load(out / f"v{version}.pt").items())
        bad = mismatches(model, reference)
        assert not bad, f"{bad} differ from vLLM's load_weights of version {version}"

    with set_current_vllm_config(vc):
        engine = make_engine(vc, model, out, rank, {"verify": True, "log_level": "debug"})

        def round_(version):
            for r in range(TRAINERS):
                wait_for(out / f"published{version}.{r}")
            engine.start_weight_update()
            try:
                engine.update_weights({"version": version})
            finally:
                engine.finish_weight_update()
            return engine.report()

        def watch_landed(version, stop):
            # The progress is read on this thread while update_weights runs
            # on the main one (refit.Receiver.progress: any thread).
            while not stop.is_set():
                p = engine.progress()
                if p["version"] == version and p["network_bytes_landed"] > 0:
                    (out / f"landed{version}.{rank}").write_text(json.dumps(p))
                    return
                time.sleep(0.01)

        round_(1)
        expect(1)
        print(f"receiver {rank}: version 1 bit-exact", flush=True)
        (out / f"ack1.{rank}").write_text("ok")

        stop = threading.Event()
        watcher = threading.Thread(target=watch_landed, args=(2, stop))
        watcher.start()
        try:
            round_(2)
        except refit.Error as e:
            failed = engine.report()
            print(f"receiver {rank}: version 2 failed after pulling {failed.get('network_bytes')} bytes: "
                  f"{type(e).__name__}: {e}", flush=True)
        else:
            raise SystemExit(f"receiver {rank}: version 2 landed although trainer rank 1 was killed")
        finally:
            stop.set()
            watcher.join()
            (out / f"ack2.{rank}").write_text("failed")
        expect(1)
        print(f"receiver {rank}: every parameter still at version 1 after the kill", flush=True)

        report = round_(3)
        expect(3)
        verify = report.get("verify", {})
        assert verify.get("bytes", 0) > 0 and verify.get("unverified_bytes") == 0, report
        print(f"receiver {rank}: version 3 bit-exact, verified {verify['bytes']} bytes in {verify['boxes']} boxes",
              flush=True)
        (out / f"ack3.{rank}").write_text("ok")
        engine.shutdown()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), Path(a[2]))
