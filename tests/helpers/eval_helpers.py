"""A module-level verifier for the eval tests (reward workers import it by reference, as they must).

The ground truth says what to return, so each prompt's scores are known by construction whatever the
(random) checkpoint writes, except `parity`, whose score is a stated function of the response text.
"""


def by_ground_truth(response, ground_truth, extra):
    if ground_truth == "always":
        return 1.0
    if ground_truth == "never":
        return 0.0
    if ground_truth == "half":
        return 0.5
    if ground_truth == "parity":
        return float(len(response) % 2 == 0)
    raise ValueError(f"unknown ground truth {ground_truth!r}")
