"""Module-level verifiers for the pool tests (workers import them by reference, as they must)."""

import os
import time


def constant_half(response, ground_truth, extra):
    return 0.5


def echo_extra(response, ground_truth, extra):
    return {"score": 1.0 if response == ground_truth else 0.0, "data_source": extra["data_source"]}


def sleep_forever(response, ground_truth, extra):
    while True:
        time.sleep(60)


def hard_exit(response, ground_truth, extra):
    os._exit(3)


def raises(response, ground_truth, extra):
    raise RuntimeError("verifier bug")


def out_of_range(response, ground_truth, extra):
    return 2.0


def counting(response, ground_truth, extra):
    """Appends one line per call to the file named by the ground truth; scores 1 if the response is
    'yes'."""
    with open(ground_truth["log"], "a") as f:
        f.write(response + "\n")
    return 1.0 if response == "yes" else 0.0


def zero_with_stderr(response, ground_truth, extra):
    return {"score": 0.0, "stderr": "Traceback: boom"}


def scribble_on_the_socket(response, ground_truth, extra):
    """Writes a frame that is no pickle to the worker's own connection (its fd is the worker's
    last argument), then scores 1."""
    import struct
    import sys

    junk = b"this is not a pickle"
    os.write(int(sys.argv[-1]), struct.pack("!i", len(junk)) + junk)
    return 1.0


def forged_reply(response, ground_truth, extra):
    """Sends a well-formed reply of its own, with an id that no request has, then scores 0."""
    import sys
    from multiprocessing.connection import Connection

    conn = Connection(int(sys.argv[-1]))
    conn.send(("ok", -7, 1.0, {}))
    conn._handle = None  # not closed: the worker still uses the descriptor
    return 0.0


def fork_and_score(response, ground_truth, extra):
    """Forks; parent and child both return the ground truth (a number) as the score, and the child
    returns into the worker's loop."""
    os.fork()
    return float(ground_truth)


def ground_truth_score(response, ground_truth, extra):
    return float(ground_truth)


def fork_a_sleeper(response, ground_truth, extra):
    """Starts a child that sleeps for a minute, writes its pid to the file the ground truth
    names, and scores 1 (or hangs, when the response says so)."""
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    with open(ground_truth, "a") as f:
        f.write(f"{pid}\n")
    while response == "hang":
        time.sleep(60)
    return 1.0


_KEPT: list = []


def leak_20_mib(response, ground_truth, extra):
    """Keeps 20 MiB per call (touched, so resident) and scores 1."""
    _KEPT.append(bytearray(20 * 2**20))
    return 1.0


def worker_pid(response, ground_truth, extra):
    return {"score": 1.0, "pid": os.getpid()}


def hog_memory(response, ground_truth, extra):
    """Allocates `ground_truth` MiB in 16 MiB pieces, touched, and scores 1 if it got them all."""
    held = [bytearray(16 * 2**20) for _ in range(int(ground_truth) // 16)]
    return 1.0 if len(held) * 16 >= int(ground_truth) else 0.0


def fork_a_tree(response, ground_truth, extra):
    """Starts a child that starts a grandchild (a daemon's double fork, still in the worker's
    process group); both sleep for a minute. Appends both pids to the file the ground truth names
    once both run, and scores 1."""
    r, w = os.pipe()
    if os.fork() == 0:
        os.close(r)
        grandchild = os.fork()
        if grandchild == 0:
            os.close(w)  # the parent's read ends when the child closes its end
            time.sleep(60)
            os._exit(0)
        os.write(w, f"{os.getpid()}\n{grandchild}\n".encode())
        os.close(w)
        time.sleep(60)
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as pipe, open(ground_truth, "a") as f:
        f.write(pipe.read())
    return 1.0
