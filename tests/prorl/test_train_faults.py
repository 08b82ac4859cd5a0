"""Faults around `prorl/train.py` that must end with a clear message and nothing corrupted (issues
8, 20): an unusable output directory (not writable, too little disk, in use by another run), Ctrl-C
without torchrun, torchrun itself killed (its workers must not train on unseen), damaged checkpoints
(the previous one is resumed, or exit 4 naming the file), a damaged model directory or data file
(exit 2 naming it), and resuming with `model.fsdp` switched on or another number of ranks."""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys

import pytest
from train_helpers import (
    ROOT,
    TINY,
    alive,
    complete_steps,
    launch,
    process_tree,
    run,
    train_command,
    wait_for,
    wait_gone,
)

LONG = [*TINY, "trainer.total_steps=200"]  # never reached: every test here stops the run early
# train.py with a disk that has 1 KiB free (shutil.disk_usage replaced before prorl is imported)
DISK_FULL = (
    "import collections, shutil, sys; usage = collections.namedtuple('usage', 'total used free'); "
    "shutil.disk_usage = lambda path: usage(2**40, 2**40, 1024); from prorl.train import main; "
    "sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.tally("faults")
@pytest.mark.parametrize("case", ["file_in_the_way", "read_only", "disk_full"])
def test_unusable_output_dir_fails_before_training(tmp_path, case):
    expected = "is not writable"
    if case == "disk_full":
        out, expected = tmp_path / "run", "not enough free disk space"
    elif case == "file_in_the_way":
        (tmp_path / "file").write_text("")
        out = tmp_path / "file" / "run"  # a regular file where a directory must be made
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into read-only directories")
        (tmp_path / "ro").mkdir(mode=0o555)
        out = tmp_path / "ro" / "run"
    cmd = train_command(out, [], nproc=None)
    if case == "disk_full":
        cmd[1:2] = ["-c", DISK_FULL]  # instead of prorl/train.py
    proc = run(cmd, timeout=120)
    assert proc.returncode == 5, proc.stderr[-3000:]
    assert expected in proc.stderr and str(out) in proc.stderr, proc.stderr[-3000:]
    assert "held-out accuracy before RL" not in proc.stdout  # no validation, no step
    if case != "disk_full":
        assert "reward self-test" not in proc.stdout  # nothing was loaded or started


@pytest.mark.tally("faults")
@pytest.mark.slow
def test_ctrl_c_finishes_the_step_and_a_second_run_on_the_dir_is_refused(tmp_path):
    """One process, no torchrun: a terminal's Ctrl-C reaches its whole process group, reward workers
    included; the step still finishes with its verifiers, is saved, and the process exits 0."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(train_command(out, LONG, nproc=None), log)
    assert wait_for(lambda: complete_steps(out / "checkpoints"), proc), log.read_text()[-3000:]

    second = run(train_command(out, LONG, nproc=None), timeout=300)
    assert second.returncode == 5, second.stderr[-3000:]
    assert f"{out} is in use by another run (pid {proc.pid} " in second.stderr, second.stderr[
        -3000:
    ]

    tree = process_tree(proc.pid)
    assert len(tree) >= 2, tree  # the trainer and its reward worker
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    stopped = [
        line for line in text.splitlines() if line.startswith("prorl: stopped by SIGINT after step")
    ]
    assert stopped and "Traceback" not in text, text[-3000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert complete_steps(out / "checkpoints")[-1] == step
    assert not wait_gone(tree, timeout=10), "a reward worker is left behind"


@pytest.mark.tally("faults")
@pytest.mark.slow
def test_workers_of_a_killed_torchrun_stop_after_their_step(tmp_path):
    """`kill -9` of torchrun alone: its workers live in sessions of their own and would train on,
    unseen; they notice the lost parent after the step, save it and exit."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    proc = launch(train_command(out, LONG), log)
    assert wait_for(lambda: complete_steps(out / "checkpoints"), proc), log.read_text()[-3000:]
    tree = process_tree(proc.pid)
    proc.kill()
    proc.wait()
    assert not wait_gone(tree, timeout=60), "workers still running a minute after torchrun died"
    text = log.read_text()
    stopped = [
        line for line in text.splitlines() if line.startswith("prorl: stopped by the loss of torch")
    ]
    assert stopped, text[-3000:]
    step = int(stopped[0].split("after step ")[1].split()[0])
    assert complete_steps(out / "checkpoints")[-1] == step


def _rank_worker(tree, rank: int) -> int:
    """The pid of torchrun's worker for `rank` (its environment says RANK=rank)."""
    for pid in tree:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if (
            b"prorl/train.py" in cmd
            and f"RANK={rank}".encode() in env
            and b"-m\0torch.distributed.run" not in cmd
        ):
            return pid
    raise AssertionError(f"no worker for rank {rank} in {tree}")


@pytest.mark.tally("faults")
@pytest.mark.slow
def test_a_frozen_rank_is_named_and_ends_the_run_cleanly(tmp_path):
    """SIGSTOP of one rank's trainer: the other says what it waits for (trainer.wait_warning_s),
    then ends with exit code 7 and a plain message once its collective times out
    (trainer.collective_timeout_s), the last complete checkpoint untouched - instead of waiting
    silently for 600 s and dying in a traceback."""
    out, log = tmp_path / "run", tmp_path / "run.log"
    overrides = [*LONG, "trainer.collective_timeout_s=20", "trainer.wait_warning_s=4"]
    proc = launch(train_command(out, overrides), log)
    assert wait_for(lambda: complete_steps(out / "checkpoints"), proc), log.read_text()[-3000:]
    tree = process_tree(proc.pid)
    frozen, waiting = _rank_worker(tree, 1), _rank_worker(tree, 0)
    os.kill(frozen, signal.SIGSTOP)
    saved = complete_steps(out / "checkpoints")
    try:
        # once rank 0 has exited, the stopped rank is killed: torchrun would otherwise wait its 30 s
        # shutdown grace for a process that cannot act on SIGTERM
        wait_for(lambda: not alive(waiting), proc, timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen, signal.SIGKILL)
    text = log.read_text()
    assert "prorl: rank 0 has waited" in text and "for the other ranks (" in text, text[-3000:]
    assert "prorl: rank 0: the other ranks stopped answering" in text, text[-3000:]
    assert "exitcode: 7" in text or proc.returncode != 0, text[-3000:]
    assert complete_steps(out / "checkpoints")[: len(saved)] == saved


@pytest.mark.tally("faults")
@pytest.mark.slow
def test_a_killed_rank_under_max_restarts_resumes_from_the_last_checkpoint(tmp_path):
    """torchrun --max-restarts=1: once rank 1 is killed (SIGKILL, as the OOM killer would), torchrun
    restarts both ranks, which resume from the last complete checkpoint and finish the run, every
    step logged once. (torchrun's store keeps the first attempt's keys: a restarted rank that read
    them waited for the dead rank's address until the collective timeout.)"""
    out, log = tmp_path / "run", tmp_path / "run.log"
    cmd = train_command(out, [*TINY, "trainer.total_steps=12", "trainer.collective_timeout_s=20"])
    cmd.insert(cmd.index("--nproc_per_node=2") + 1, "--max-restarts=1")
    proc = launch(cmd, log)
    saved = wait_for(lambda: max(complete_steps(out / "checkpoints"), default=0) >= 2, proc)
    assert saved, log.read_text()[-3000:]
    os.kill(_rank_worker(process_tree(proc.pid), 1), signal.SIGKILL)
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert text.count("prorl: resumed from") == 1, text[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(13))


@pytest.mark.tally("faults")
@pytest.mark.slow
def test_a_killed_rank_on_one_of_two_nodes_under_max_restarts_resumes(tmp_path):
    """Two torchrun agents (two "nodes" on localhost, c10d rendezvous, one rank each) with
    --max-restarts=1: once rank 1 is killed, both agents restart their workers - the dead one's
    counts a restart, the other's does not (a membership change), so TORCHELASTIC_RESTART_COUNT
    differs between the nodes - and the run resumes from its last checkpoint to the end, every step
    logged once. (Keyed on that count, the restarted ranks read different attempts' keys and gloo
    failed to connect.)"""
    out = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    short = ["trainer.total_steps=4", "trainer.val_before_train=false", "trainer.val_every=0"]
    cmd = train_command(out, [*TINY, *short, "trainer.collective_timeout_s=20"])
    at = cmd.index("--standalone")
    cmd[at : at + 2] = ["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d"]
    cmd[at + 3 : at + 3] = [f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two-nodes"]
    cmd.insert(at + 5, "--max-restarts=1")
    logs = [tmp_path / f"node{i}.log" for i in (0, 1)]
    nodes = [launch(cmd, log) for log in logs]
    saved = wait_for(lambda: max(complete_steps(out / "checkpoints"), default=0) >= 2, nodes[0])
    assert saved, logs[0].read_text()[-3000:]
    tree = [pid for node in nodes for pid in process_tree(node.pid)]
    os.kill(_rank_worker(tree, 1), signal.SIGKILL)
    for node in nodes:
        node.wait(timeout=300)
    text = "".join(log.read_text() for log in logs)
    assert [node.returncode for node in nodes] == [0, 0], text[-4000:]
    assert text.count("prorl: resumed from") == 1, text[-4000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 5)), rows


# --------------------------------------------------------------------------------------------------
# Damaged checkpoints, model directories and data files (issue 20)


def _truncate(path) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _zero_fill(path) -> None:
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(bytes(size))


@pytest.mark.tally("faults")
@pytest.mark.slow
def test_a_damaged_checkpoint_resumes_the_previous_one_and_all_damaged_exit_4(tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    first = run(train_command(out, [*TINY, "trainer.total_steps=2"], nproc=None))
    assert first.returncode == 0 and complete_steps(ckpts) == [1, 2], first.stderr[-3000:]
    shard, rng_file = (
        ckpts / "step_00000002" / "__0_0.distcp",
        ckpts / "step_00000001" / "rng" / "rank_00000.pt",
    )
    _zero_fill(shard)
    os.remove(rng_file)  # only costs determinism: named, and the checkpoint still resumed

    second = run(train_command(out, [*TINY, "trainer.total_steps=3"], nproc=None))
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-3000:]
    assert f"{shard}: contents differ from the checksum" in second.stderr, text[-3000:]
    assert f"RNG file {rng_file} is missing" in second.stderr, text[-3000:]
    assert f"prorl: resumed from {ckpts / 'step_00000001'} (step 1)" in second.stdout, text[-3000:]
    assert "Traceback" not in text
    steps = [json.loads(line)["step"] for line in open(out / "metrics.jsonl")]
    assert steps == [0, 1, 2, 3], steps  # step 2 trained again, logged once

    metas = [ckpts / f"step_{s:08d}" / "meta.json" for s in complete_steps(ckpts)]
    for meta in metas:
        _truncate(meta)
    third = run(train_command(out, [*TINY, "trainer.total_steps=4"], nproc=None))
    assert third.returncode == 4, third.stderr[-3000:]
    assert "cannot resume: no usable checkpoint" in third.stderr and "Traceback" not in third.stderr
    for meta in metas:
        assert f"{meta}: " in third.stderr, third.stderr[-3000:]
    assert "weights_only" not in third.stderr
    export = run(
        [sys.executable, "-m", "prorl.export", str(metas[-1].parent), str(tmp_path / "hf")]
    )
    assert export.returncode == 2 and f"is damaged: {metas[-1]}: " in export.stderr, export.stderr[
        -3000:
    ]


@pytest.mark.slow
def test_switching_fsdp_on_and_changing_the_number_of_ranks_resume(tmp_path):
    """A run saved replicated is the same model under FSDP2 (DCP reshards), then on 2 ranks (the
    prompt record kept)."""
    out = tmp_path / "run"
    first = run(train_command(out, [*TINY, "trainer.total_steps=1"], nproc=None))
    assert first.returncode == 0, first.stderr[-3000:]
    for nproc, total in ((1, 2), (2, 3)):
        resumed = run(
            train_command(
                out, [*TINY, f"trainer.total_steps={total}", "model.fsdp=true"], nproc=nproc
            )
        )
        text = resumed.stdout + resumed.stderr
        assert resumed.returncode == 0, text[-3000:]
        assert (
            f"(step {total - 1})" in resumed.stdout and "prorl: resumed from" in resumed.stdout
        ), text[-3000:]
    assert "saved by 1 ranks, this run has 2: RNG states not restored" in resumed.stderr
    # the prompt record (global) survives the change of ranks: fewer prompts unseen after every step
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    unseen = [r["scheduler/unseen"] for r in rows if "scheduler/unseen" in r]
    assert len(unseen) == 3 and unseen[0] > unseen[1] > unseen[2], unseen


def _model_copy(tmp_path, file, damage):
    path = tmp_path / "model"
    shutil.copytree(os.path.join(ROOT, "prorl", "assets", "tiny-reasoner"), path)
    damage(path / file)
    return [f"model.path={path}"], str(path / file)


def _edit_weights(file, how: str) -> None:
    """One tensor of safetensors `file` transposed, or given a NaN."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(file))
    name = "model.layers.0.mlp.up_proj.weight"
    if how == "transpose":
        state[name] = state[name].t().contiguous()
    else:
        state[name][0, 0] = float("nan")
    save_file(state, str(file), metadata={"format": "pt"})


def _set_vocab(config_json, vocab_size: int) -> None:
    """config.json and the (tied) embedding cut to `vocab_size` rows: a consistent checkpoint whose
    vocabulary is smaller than its tokenizer's."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads(config_json.read_text())
    config_json.write_text(json.dumps({**cfg, "vocab_size": vocab_size}))
    weights = config_json.parent / "model.safetensors"
    state = load_file(str(weights))
    for name in [k for k in state if k.endswith(("embed_tokens.weight", "lm_head.weight"))]:
        state[name] = state[name][:vocab_size].contiguous()
    save_file(state, str(weights), metadata={"format": "pt"})


def _data_file(tmp_path, lines: list[bytes]):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return [f"data.train_files=[{path}]"], str(path)


ROW = json.dumps({"data_source": "math", "prompt": "1+1=", "ground_truth": "2"}).encode()
BAD_INPUT = {  # case -> (overrides, the file the message names, what it says)
    "truncated safetensors": (
        lambda t: _model_copy(t, "model.safetensors", _truncate),
        "truncated or damaged safetensors",
    ),
    "zero-filled safetensors": (
        lambda t: _model_copy(t, "model.safetensors", _zero_fill),
        "truncated, zero-filled or not safetensors",
    ),
    "truncated config.json": (
        lambda t: _model_copy(t, "config.json", _truncate),
        "is not valid JSON",
    ),
    "no tokenizer.json": (lambda t: _model_copy(t, "tokenizer.json", os.remove), "is missing"),
    "vocab smaller than the tokenizer": (  # 98 rows for the 100 tokens of the shipped tokenizer
        lambda t: _model_copy(t, "config.json", lambda p: _set_vocab(p, 98)),
        "ids 98..99 (98 '~', 99 '<unk>') have no row",
    ),
    "non-UTF-8 data": (
        lambda t: _data_file(t, [ROW, ROW.replace(b"1+1", b"1\xff1")]),
        "row 1 (line 2): not UTF-8",
    ),
    "a transposed tensor": (
        lambda t: _model_copy(t, "model.safetensors", lambda p: _edit_weights(p, "transpose")),
        "wrong shape model.layers.0.mlp.up_proj.weight",
    ),
    "empty data file": (lambda t: _data_file(t, []), "the file is empty"),
    "a dict as a math ground truth": (
        lambda t: _data_file(t, [ROW.replace(b'"2"', b'{"x": 2}')]),
        "row 0: field 'ground_truth' must be a string or number",
    ),
}


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_exits_2_naming_the_file(tmp_path, case):
    make, expected = BAD_INPUT[case]
    overrides, named = make(tmp_path)
    cmd = train_command(tmp_path / "run", overrides, nproc=None)
    cmd[2:2] = ["--config", "default"]  # the embedded default's sizes with a model.path of its own
    proc = run(cmd, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert named in proc.stderr and expected in proc.stderr, proc.stderr[-3000:]
    # found before any work
    assert "Traceback" not in proc.stderr and "reward self-test" not in proc.stdout


@pytest.mark.tally("bad_inputs")
def test_a_nan_weight_in_the_input_model_exits_2_naming_the_tensor(tmp_path):
    """Before, it was trained from silently and ended up in checkpoints/final."""
    overrides, named = _model_copy(tmp_path, "model.safetensors", lambda p: _edit_weights(p, "nan"))
    cmd = train_command(tmp_path / "run", [*overrides, "trainer.total_steps=1"], nproc=None)
    cmd[2:2] = ["--config", "default"]
    proc = run(cmd, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"{named}: tensor model.layers.0.mlp.up_proj.weight holds NaN" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.tally("bad_inputs")
@pytest.mark.slow
def test_prompts_longer_than_max_prompt_tokens_are_counted_per_file(tmp_path):
    overrides, named = _data_file(tmp_path, [ROW] * 6)
    proc = run(
        train_command(tmp_path / "run", [*overrides, "data.max_prompt_tokens=4"], nproc=None)
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (
        f"prorl: data: 6 of 6 prompts of {named} are longer than data.max_prompt_tokens=4"
        in proc.stdout
    )
    assert "no training prompt fits data.max_prompt_tokens=4: all 6 are longer" in proc.stderr


@pytest.mark.tally("faults")
def test_steps_that_keep_no_group_are_skipped_and_a_stall_stops_cleanly(tmp_path):
    """Every answer cut at 2 tokens scores 0, so dynamic sampling keeps no group on any rank: each
    such step is counted and skipped (the run goes on and exports), and
    `trainer.max_consecutive_skips` of them in a row stop both ranks together with exit 6 and the
    reason, never a traceback of prorl's."""
    empty = [
        *TINY,
        "rollout.max_response_tokens=2",
        "algorithm.max_rounds=2",
        "trainer.save_every=0",
    ]
    res = run(train_command(tmp_path / "skips", [*empty, "trainer.total_steps=2"]))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [json.loads(line) for line in open(tmp_path / "skips" / "metrics.jsonl")]
    steps = [r for r in rows if "dynamic_sampling/kept_groups" in r]
    assert [r["dynamic_sampling/kept_groups"] for r in steps] == [0.0, 0.0]
    # later refills are skipped by the prompt scheduler
    assert steps[0]["dynamic_sampling/rounds"] == 2
    assert (tmp_path / "skips" / "checkpoints" / "final" / "config.json").is_file()

    stall = [*empty, "trainer.total_steps=10", "trainer.max_consecutive_skips=3"]
    res = run(train_command(tmp_path / "stall", stall))
    out = res.stdout + res.stderr
    # torchrun's report
    assert res.returncode != 0 and re.search(r"exitcode\s*: 6 ", out), out[-3000:]
    assert "3 consecutive steps learnt nothing" in out and "no group kept" in out, out[-3000:]
    # no traceback from prorl's code (torchrun prints its own)
    assert f'File "{ROOT}' not in out, out[-3000:]


# train.py whose AdamW writes a NaN into its first parameter at its first step after the first save
NAN_AFTER_STEP_1 = (
    "import sys, torch; from prorl.engine.checkpoint import Checkpointer\n"
    "step, save, saved = torch.optim.AdamW.step, Checkpointer.save, []\n"
    "def poisoned(self, *a, **k):\n"
    "    out = step(self, *a, **k)\n"
    "    if saved:\n"
    "        with torch.no_grad(): self.param_groups[0]['params'][0].view(-1)[0] = float('nan')\n"
    "    return out\n"
    "def counted(self, *a, **k):\n"
    "    out = save(self, *a, **k); saved.append(1); return out\n"
    "torch.optim.AdamW.step, Checkpointer.save = poisoned, counted\n"
    "from prorl.train import main; sys.exit(main(sys.argv[1:]))"
)


@pytest.mark.tally("faults")
def test_a_nan_weight_is_never_saved_and_exits_9_naming_tensor_and_step(tmp_path):
    """A weight that turns NaN (here planted in the optimizer; in the field a NaN weight decay or
    learning-rate floor did it) stops the run at the next save with exit 9, the tensor and the step
    named, and the last good checkpoint kept; nothing is exported."""
    out = tmp_path / "run"
    cmd = train_command(out, [*TINY, "trainer.total_steps=3"], nproc=None)
    cmd[1:2] = ["-c", NAN_AFTER_STEP_1]
    res = run(cmd, timeout=300)
    assert res.returncode == 9, res.stdout[-2000:] + res.stderr[-3000:]
    assert re.search(r"prorl: step 2: model\.\S+ holds NaN or infinite values", res.stderr), (
        res.stderr[-3000:]
    )
    assert complete_steps(out / "checkpoints") == [1]
    assert not (out / "checkpoints" / "final").exists()
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
