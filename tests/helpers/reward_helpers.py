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
