"""The reward pool against verifiers that break its protocol or its process (issue 41): bytes
written to the worker's socket, a forged reply, a fork whose child returns into the worker's loop,
children left behind, a verifier that leaks memory. None may stop the run or shift a score onto
another item; each is counted."""

import os
import time

import pytest

import prorl.rewards as rewards
from prorl.rewards.pool import RewardPool


@pytest.fixture
def registered():
    saved = dict(rewards._REGISTRY)
    for key, name in (
        ("scribble", "scribble_on_the_socket"),
        ("forge", "forged_reply"),
        ("fork", "fork_and_score"),
        ("truth", "ground_truth_score"),
        ("sleeper", "fork_a_sleeper"),
        ("leak", "leak_20_mib"),
        ("pid", "worker_pid"),
        ("hog", "hog_memory"),
        ("tree", "fork_a_tree"),
    ):
        rewards.register(key, f"reward_helpers:{name}")
    yield
    rewards._REGISTRY.clear()
    rewards._REGISTRY.update(saved)


TRUTHS = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]


@pytest.mark.tally("faults")
@pytest.mark.parametrize("bad", ["scribble", "forge"])
def test_a_verifier_that_breaks_the_reply_is_scored_0_counted_and_the_rest_hold(registered, bad):
    """Before: the junk frame raised UnpicklingError out of score_batch (the run exited 1); a
    forged reply was taken as the item's score."""
    sources = ["truth"] * 3 + [bad] + ["truth"] * 4
    with RewardPool(num_workers=2, timeout_s=5, preload=()) as pool:
        res = pool.score_batch(sources, [str(i) for i in range(8)], TRUTHS)
        assert res.scores == [*TRUTHS[:3], 0.0, *TRUTHS[4:]]
        assert res.errored == [False] * 3 + [True] + [False] * 4
        assert res.errors[3].startswith("protocol: "), res.errors[3]
        assert pool.protocol_failures == 2  # the first try and the one retry
        again = pool.score_batch(["truth"] * 4, list("abcd"), TRUTHS[:4])  # healthy after
        assert again.scores == TRUTHS[:4] and not any(again.errored)


@pytest.mark.tally("faults")
def test_a_forking_verifier_shifts_no_score(registered):
    """The child of a fork returns into the worker's loop; before, its reply was taken for the
    next item's and every later score of the batch moved by one."""
    with RewardPool(num_workers=1, timeout_s=5, preload=()) as pool:
        for _ in range(2):
            res = pool.score_batch(["fork"] + ["truth"] * 7, [str(i) for i in range(8)], TRUTHS)
            assert res.scores == TRUTHS and not any(res.errored), res


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.tally("faults")
def test_children_of_verifiers_die_with_their_worker(registered, tmp_path):
    """Children of a timed-out verifier and of one that returned: gone once the pool killed or
    closed their worker (before, they outlived the run)."""
    pids = tmp_path / "pids"
    with RewardPool(num_workers=2, timeout_s=1.5, preload=()) as pool:
        res = pool.score_batch(["sleeper"] * 3, ["hang", "a", "b"], [str(pids)] * 3)
        assert res.timed_out == [True, False, False] and res.scores == [0.0, 1.0, 1.0]
        children = [int(x) for x in pids.read_text().split()]
        assert len(children) == 3
        time.sleep(0.2)
        assert sum(map(_alive, children)) == 2  # the timed-out one's child went with it
    deadline = time.monotonic() + 5
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, children)), [p for p in children if _alive(p)]


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.tally("faults")
def test_a_leaking_verifier_s_worker_is_recycled_and_its_memory_bounded(registered):
    """20 MiB kept per call: before, the worker grew by that much per item for the run's life."""
    limit = 120 * 2**20
    with RewardPool(num_workers=1, timeout_s=5, preload=(), max_rss_bytes=limit) as pool:
        for k in range(4):
            res = pool.score_batch(["leak"] * 5, [f"{k}-{i}" for i in range(5)], [None] * 5)
            assert res.scores == [1.0] * 5
        assert pool.recycled >= 2 and pool.replaced == 0
        assert _rss(pool.workers[0].proc.pid) <= limit + 20 * 2**20


@pytest.mark.tally("faults")
def test_a_worker_is_recycled_after_max_calls(registered):
    with RewardPool(num_workers=1, timeout_s=5, preload=(), max_calls=3) as pool:
        res = pool.score_batch(["pid"] * 7, [str(i) for i in range(7)], [None] * 7)
    pids = [e["pid"] for e in res.extras]
    # one worker at a time, replaced after every third item
    assert [pids.index(p) for p in pids] == [0, 0, 0, 3, 3, 3, 6], pids
    assert pool.recycled == 2


@pytest.mark.tally("faults")
def test_a_verifier_allocating_past_the_worker_bound_is_contained(registered):
    """1 GiB in 16 MiB pieces against a 256 MiB bound (RLIMIT_DATA): the allocation fails inside
    the item, which scores 0 as an error; the worker is replaced and the batch goes on. Before, the
    worker took the whole 1 GiB (only the resident-memory check after the item recycled it)."""
    bound = 256 * 2**20
    sources = ["truth", "hog", "truth", "truth"]
    with RewardPool(num_workers=1, timeout_s=20, preload=(), max_memory_bytes=bound) as pool:
        first = pool.workers[0].proc.pid
        res = pool.score_batch(sources, list("abcd"), [0.1, 1024, 0.3, 0.4])
        assert res.scores == [0.1, 0.0, 0.3, 0.4]
        assert res.errored == [False, True, False, False]
        assert res.errors[1].startswith("MemoryError"), res.errors[1]
        assert pool.memory_exceeded == 1 and pool.replaced == 0
        assert pool.workers[0].proc.pid != first  # a fresh worker scored the rest
        # under the bound, the same verifier scores normally
        assert pool.score_batch(["hog"], ["e"], [64]).scores == [1.0]


def _processes_in_groups(groups: set[int]) -> set[int]:
    """Live processes whose process group is one of `groups` (zombies excluded)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            out.add(int(pid))
    return out


@pytest.mark.tally("faults")
def test_no_process_of_the_pool_s_groups_outlives_it(registered, tmp_path):
    """Verifiers that fork a child and grandchild, fork into the worker's loop, or leave a child
    behind a timed-out call: while the pool runs their processes are in its groups; once it is
    closed, none is left (before: 15 and 42 orphans after a run that exited 0)."""
    pids = str(tmp_path / "pids")
    sources = ["tree", "fork", "sleeper", "tree", "truth", "sleeper"]
    responses = ["a", "b", "hang", "c", "d", "e"]
    with RewardPool(num_workers=1, timeout_s=1.5, preload=()) as pool:
        res = pool.score_batch(sources, responses, [pids, 0.5, pids, pids, 0.7, pids])
        assert res.scores == [1.0, 0.5, 0.0, 1.0, 0.7, 1.0] and res.timed_out[2]
        # "a"'s child and grandchild and "hang"'s sleeper died with the first worker, killed for
        # the timeout; "c"'s two and "e"'s sleeper live in the second worker's group
        left = {int(x) for x in open(pids).read().split()}
        assert len(left) == 6
        groups = set(pool.process_groups)
        during = _processes_in_groups(groups)
        assert len(groups) == 2 and len(left & during) == 3
        assert during - left == {pool.workers[0].proc.pid}
    deadline = time.monotonic() + 5
    while _processes_in_groups(groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _processes_in_groups(groups) == set()


def _data_limit(pid: int) -> str:
    with open(f"/proc/{pid}/limits") as f:
        return next(line.split()[3] for line in f if line.startswith("Max data size"))


@pytest.mark.parametrize("gib, want", [(0.5, str(2**29)), (0.0, None)])
def test_reward_worker_memory_gib_is_the_workers_kernel_limit(gib, want):
    """reward.worker_memory_gib reaches the kernel: the trainer's pool workers' RLIMIT_DATA, read
    from /proc; 0 leaves the limit the trainer had (a reward function that loads a judge model)."""
    from prorl import data
    from prorl.config import load_config
    from prorl.train_run import make_pool

    cfg = load_config("default", [f"reward.worker_memory_gib={gib}", "reward.num_workers=1"])
    pool = make_pool(cfg, data.builtin("digit_sums", n=2, split="train"))
    try:
        got = _data_limit(pool.workers[0].proc.pid)
        assert got == (want or _data_limit(os.getpid()))
    finally:
        pool.close()
