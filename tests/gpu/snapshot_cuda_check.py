#!/usr/bin/env python3
"""Snapshot across a real SIGTERM and restart on the CUDA backend (spec section 11).

usage: snapshot_cuda_check.py SERVER_BINARY WORKDIR
Starts the server on --backend cuda with --snapshot-dir, prefills sequences at several
layers, answers decode steps (no new keys, so they change nothing), stops it with SIGTERM,
starts it again on the same directory and checks: the instance id is kept, every cache's
length is the same, and the same steps give bit-identical answers. Exits 0 on success,
1 on a mismatch (printed), 2 on a usage or start-up problem. The CPU-backend version of this
check is tests/service/snapshot_test.cc; this one is for the GPU machine
(tests/gpu/device_run_all.sh runs it).
"""
import os
import signal
import subprocess
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "client", "python"))
import numpy as np  # noqa: E402

import decode_indexer as di  # noqa: E402

LAYERS = (0, 30, 60)
PORT = 50093


def start(binary, snap_dir, log):
    args = [binary, "--listen", f"127.0.0.1:{PORT}", "--backend", os.environ.get("DI_CHECK_BACKEND", "cuda"), "--profile", "v32",
            "--cache-pages", "512", "--snapshot-dir", snap_dir, "--drain-timeout", "5"]
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    client = di.Client(f"127.0.0.1:{PORT}")
    client.wait_ready(timeout=120)
    deadline = time.monotonic() + 300
    while True:  # UNAVAILABLE while a snapshot is restored
        try:
            client.server_info()
            return proc, client
        except di.IndexerError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.2)


def answers(client, ids, lengths, seed):
    rng = np.random.default_rng(seed)
    info = client.server_info()
    out = {}
    for layer in LAYERS:
        rows = len(ids)
        q = rng.standard_normal((rows, info.num_heads, info.head_dim)).astype(np.float32)
        w = rng.standard_normal((rows, info.num_heads)).astype(np.float32)
        pos = np.array([n - 1 for n in lengths], dtype=np.int32)
        res = client.decode_step(layer, [di.SequenceStep(i) for i in ids], q, w, positions=pos)
        out[layer] = np.array(res.topk, copy=True)
    return out


def main():
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    binary, work = sys.argv[1], sys.argv[2]
    snap = os.path.join(work, "snap")
    os.makedirs(snap, exist_ok=True)
    log = open(os.path.join(work, "snapshot_cuda_server.log"), "ab")
    proc, client = start(binary, snap, log)
    info = client.server_info()
    rng = np.random.default_rng(7)
    ids, lengths = [11, 12, 13, 14], [3000, 1500, 5000, 2049]
    for sid, n in zip(ids, lengths):
        client.create_sequence(sid)
        for layer in LAYERS:
            keys = rng.standard_normal((n, info.head_dim)).astype(np.float32)
            client.append_keys(sid, layer, keys)
    before = answers(client, ids, lengths, seed=99)
    before_lengths = {sid: list(client.get_sequence(sid).caches) for sid in ids}
    instance = info.instance_id
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=300)
    print(f"first server exited rc={rc} after SIGTERM ({time.monotonic() - t0:.1f} s with the snapshot)")
    if rc != 0:
        return 1
    client.close()
    t0 = time.monotonic()
    proc, client = start(binary, snap, log)
    print(f"restarted and SERVING after {time.monotonic() - t0:.1f} s")
    bad = 0
    try:
        if client.server_info().instance_id != instance:
            print("instance id changed across the restore")
            bad += 1
        for sid in ids:
            got = list(client.get_sequence(sid).caches)
            if got != before_lengths[sid]:
                print(f"sequence {sid}: caches {got} != {before_lengths[sid]}")
                bad += 1
        after = answers(client, ids, lengths, seed=99)
        for layer in LAYERS:
            if not np.array_equal(before[layer], after[layer]):
                print(f"layer {layer}: answers differ after the restore")
                bad += 1
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=300)
    print("snapshot_cuda_check:", "PASSED" if bad == 0 else f"FAILED ({bad})",
          f"({len(ids)} sequences x {len(LAYERS)} layers, answers compared bit for bit)")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
