"""Worker processes for tests/test_multiworker.py (MultiWorkerMirroredStrategy).

Two modes:

``multiworker_worker.py launch STEPS TIMEOUT``
    Picks two free ports on 127.0.0.1, starts two workers (this script in
    ``worker`` mode) with a TF_CONFIG naming only those addresses, waits for
    both at most TIMEOUT seconds, kills both if either fails or the time runs
    out, and prints one JSON line: the results of both workers.

``multiworker_worker.py worker INDEX PORT0 PORT1 STEPS``
    One worker: trains two copies of the same small tanh MLP for STEPS steps
    with the same data, one with ``memory_saving_gradients.gradients`` and one
    with ``tf.compat.v1.gradients``, called per replica inside
    ``strategy.run``; gradients are all-reduced across the two workers.
    Prints one JSON line: losses (all-reduced means) and a checksum of the
    trained weights.

Each worker trains on its own half of the data, so equal weights on both
workers after training show that the gradients were all-reduced.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

LAYERS = 8
WIDTH = 32
BATCH_PER_WORKER = 16
LR = 0.5


def _free_ports(count: int) -> list:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def _bring_up_loopback() -> None:
    """In a fresh network namespace (``unshare -rn``) the loopback is down: bring it up."""
    import fcntl
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, siocgifflags, request))[1]
        fcntl.ioctl(s, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))


def _interfaces() -> list:
    """Network interfaces this process sees (Linux), e.g. ['lo'] in a private namespace."""
    try:
        with open("/proc/net/dev") as f:
            return sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
    except OSError:
        return []


def launch(steps: int, timeout: float) -> int:
    if os.environ.get("MULTIWORKER_PRIVATE_NETNS") == "1":
        _bring_up_loopback()
    ports = _free_ports(2)
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "worker", str(i),
             str(ports[0]), str(ports[1]), str(steps)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            start_new_session=True,
        )
        for i in range(2)
    ]
    deadline = time.monotonic() + timeout
    outputs: list = [None, None]
    failed = None
    try:
        while any(o is None for o in outputs):
            for i, proc in enumerate(procs):
                if outputs[i] is None and proc.poll() is not None:
                    out, err = proc.communicate()
                    outputs[i] = (proc.returncode, out, err)
                    if proc.returncode != 0:
                        failed = f"worker {i} exited with {proc.returncode}:\n{err[-3000:]}"
            if failed:
                break
            if time.monotonic() > deadline:
                failed = f"workers did not finish within {timeout} s"
                break
            time.sleep(0.1)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if failed:
        for i, proc in enumerate(procs):
            if outputs[i] is None:
                _, err = proc.communicate()
                failed += f"\nworker {i} (killed) stderr:\n{err[-2000:]}"
        print(failed, file=sys.stderr)
        return 1
    results = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in outputs]
    print(json.dumps({"ports": ports, "workers": results, "interfaces": _interfaces()}))
    return 0


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the launcher dies, so no worker outlives a killed test."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker(index: int, port0: int, port1: int, steps: int) -> None:
    _die_with_parent()
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{port0}", f"127.0.0.1:{port1}"]},
        "task": {"type": "worker", "index": index},
    })
    import numpy as np
    import tensorflow as tf

    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=30.0,
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    import memory_saving_gradients as msg

    rng = np.random.RandomState(0)
    init = [rng.standard_normal([WIDTH, WIDTH]).astype(np.float32) * 0.4 for _ in range(LAYERS)]
    data = rng.standard_normal([2, BATCH_PER_WORKER, WIDTH]).astype(np.float32)[index]
    with strategy.scope():
        ours = [tf.Variable(w, name=f"ours{i}") for i, w in enumerate(init)]
        theirs = [tf.Variable(w, name=f"theirs{i}") for i, w in enumerate(init)]

    def train_step(weights, use_ours, x):
        h, units = x, []
        for w in weights:
            h = tf.tanh(tf.matmul(h, w))
            units.append(h)
        loss = tf.reduce_mean(tf.square(h - 0.5))
        if use_ours:
            grads = msg.gradients(loss, weights, checkpoints=units[1::3])
        else:
            grads = tf.compat.v1.gradients(loss, weights)
        ctx = tf.distribute.get_replica_context()
        grads = ctx.all_reduce(tf.distribute.ReduceOp.MEAN, grads)
        for w, g in zip(weights, grads):
            w.assign_sub(LR * g)
        return loss

    @tf.function
    def train_fn(x):
        a = strategy.run(train_step, args=(ours, True, x))
        b = strategy.run(train_step, args=(theirs, False, x))
        mean = tf.distribute.ReduceOp.MEAN
        return strategy.reduce(mean, a, axis=None), strategy.reduce(mean, b, axis=None)

    x = tf.constant(data)
    losses, baseline = [], []
    for _ in range(steps):
        a, b = train_fn(x)
        losses.append(float(a))
        baseline.append(float(b))
    graph = train_fn.get_concrete_function(x).graph
    copies = sum(1 for op in graph.get_operations() if op.type == "Tanh" and "recompute" in op.name)
    print(json.dumps(dict(
        index=index,
        replicas=strategy.num_replicas_in_sync,
        losses=losses,
        baseline_losses=baseline,
        weights_checksum=float(sum(np.sum(np.abs(w.numpy())) for w in ours)),
        max_weight_diff=float(max(np.max(np.abs(a.numpy() - b.numpy())) for a, b in zip(ours, theirs))),
        recomputed_tanh_ops=copies,
    )))


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "launch":
        sys.exit(launch(int(sys.argv[2]), float(sys.argv[3])))
    worker(*[int(a) for a in sys.argv[2:6]])
