"""Asynchronous RL's wire (prorl/async_rl/wire.py) and the batch channel (transport.BatchSender /
take): a 64 MiB slice over a real gloo pair group and a real TCPStore, signed headers refused when
forged, replayed, pickled or tampered with, the payload checked against its schema, the run secret.
The attacks against a real 1 + 1 run are tests/preset/test_async_attacks.py."""

import datetime
import multiprocessing
import os
import pickle
import stat

import pytest
import torch
import torch.distributed as dist
from async_fakes import SECRET, LoopChannel, Store

from prorl.async_rl import transport, wire
from prorl.async_rl.remote import check_batch

MIB = 2**20


def _big_slice(groups=32, n=8, tokens=4096):
    """A slice of `groups` groups of n responses of `tokens` tokens: 16 bytes a token on the wire
    (an int64 id and a float64 log-prob)."""
    out = []
    for i in range(groups):
        base = i * n * tokens
        out.append(
            {
                "example_index": i,
                "prompt_ids": list(range(i, i + 50)),
                "responses": [list(range(base + r, base + r + tokens)) for r in range(n)],
                "sampler_logps": [[-(r + 1) / 8.0] * tokens for r in range(n)],
                "truncated": [r % 2 == 0 for r in range(n)],
                "raw": [float(r % 2) for r in range(n)],
                "verified": [True] * n,
                "shaped": [float(r % 2) - 0.5 for r in range(n)],
                "old_logps": None,
                "version": 3,
                "uid": f"4/0/{i}",
            }
        )
    return {"groups": out, "version": 3, "checksum": 1.25, "engine_rms": None}


def _rollout_side(port: int, groups: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=60))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("pair/", store), 0, 2, datetime.timedelta(60))
    sender = transport.BatchSender(store, wire.PairChannel(pg, 1), SECRET)
    sender.send("batch/4/0/0", _big_slice(groups))
    sender.queue.join()  # sent (a send waits for the trainer)
    store.wait(["taken"])


@pytest.mark.slow
def test_a_64_mib_slice_crosses_a_real_gloo_pair_and_the_store_holds_a_ticket_only():
    """The store refuses values over 8 MiB (torch's libuv TCPStore): the groups travel over the
    pair group, the store holds a signed ticket of a few hundred bytes."""
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, datetime.timedelta(60), wait_for_workers=False
    )
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=_rollout_side, args=(store.port, 128), daemon=True)
    child.start()
    try:
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pair/", store), 1, 2, datetime.timedelta(60))
        key = "batch/4/0/0"
        transport.wait_ready(store, key, 60.0, "the big slice")
        assert len(store.get(key)) < 1024
        message = transport.take(store, wire.PairChannel(pg, 0), SECRET, key, 60.0, "slice")
        assert not store.check([key])
        store.set("taken", "1")
        child.join(60)
    finally:
        child.kill()
        child.join()
    sent = _big_slice(128)
    tokens = sum(len(r) for g in sent["groups"] for r in g["responses"])
    assert tokens * 16 >= 64 * MIB
    assert message == sent  # every token id, log-prob, flag and score as sent
    groups = check_batch(message, 128, 8, key)
    assert [g.uid for g in groups] == [f"4/0/{i}" for i in range(128)]


def test_encode_keeps_every_value_and_type():
    obj = {
        "a": [1, 2, 3],
        "b": [0.5, -1e-300, float("inf")],
        "c": [True, False],
        0: (3, [7, 8], None),
        "s": "x",
        "m": [1, 0.5, "y", []],
        "n": [[], [[1]]],
    }
    tree, tensors = wire.encode(obj)
    assert [t.dtype for t in tensors] == [torch.int64, torch.float64, torch.uint8]
    back = wire.decode(tree, tensors)
    assert back == {**obj, 0: [3, [7, 8], None]}  # a tuple comes back a list
    assert [type(v) for v in back["m"]] == [int, float, str, list]


def _message(key="batch/4/0/0", secret=SECRET, obj=None):
    channel = LoopChannel()
    wire.send(channel, secret, key, obj if obj is not None else {"groups": [], "x": [1, 2]})
    return channel


@pytest.mark.tally("attacks")
def test_a_header_signed_without_the_run_secret_is_refused():
    channel = _message(secret=b"a guess at the secret, 32 bytes!")
    with pytest.raises(wire.Refused, match="batch/4/0/0: not signed with the run's secret"):
        wire.recv(channel, SECRET, "batch/4/0/0")


@pytest.mark.tally("attacks")
def test_a_signed_message_replayed_under_another_key_is_refused():
    channel = _message(key="batch/3/0/0")  # step 3's genuine batch, offered as step 4's
    with pytest.raises(wire.Refused, match="batch/4/0/0: a replay of the run's own 'batch/3/0/0'"):
        wire.recv(channel, SECRET, "batch/4/0/0")
    store = Store()
    store.set("push/5", wire.ticket(SECRET, "push/2"))
    with pytest.raises(wire.Refused, match="a replay"):
        wire.verify(SECRET, store.get("push/5"), "push/5")


class _Payload:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling it creates the file


@pytest.mark.tally("attacks")
def test_a_pickle_in_the_store_or_on_the_channel_is_never_loaded(tmp_path):
    marker = tmp_path / "ran"
    evil = pickle.dumps({"groups": _Payload(str(marker))})
    with pytest.raises(wire.Refused, match="push/0: not signed .*a pickle"):
        wire.verify(SECRET, evil, "push/0")
    channel = LoopChannel()  # the same bytes as a header on the channel
    channel.send(torch.tensor([len(evil)], dtype=torch.int64))
    channel.send(torch.frombuffer(bytearray(evil), dtype=torch.uint8))
    with pytest.raises(wire.Refused, match="not signed"):
        wire.recv(channel, SECRET, "push/0")
    assert not marker.exists()


@pytest.mark.tally("attacks")
def test_a_payload_changed_after_signing_is_refused():
    channel = _message(obj={"x": [1, 2, 3]})
    channel.sent[2] = torch.tensor([1, 2, 4])  # the int64 payload, one token changed
    with pytest.raises(wire.Refused, match="does not match its signed digest"):
        wire.recv(channel, SECRET, "batch/4/0/0")


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "change, words",
    [
        (lambda h: h.update(specs=[["int64", 2], ["float64", 0]]), "no payload list"),
        (lambda h: h.update(specs=[["object", 2], ["float64", 0], ["uint8", 0]]), "malformed"),
        (lambda h: h.update(specs=[["int64", -1], ["float64", 0], ["uint8", 0]]), "malformed"),
        (lambda h: h.update(specs=[["float64", 2], ["int64", 0], ["uint8", 0]]), "payload 0"),
        (lambda h: h.update(tree={"I": [1, 5]}), "out of the payload's bounds"),
        (lambda h: h.update(tree={"Q": 1}), "unknown node"),
    ],
)
def test_a_signed_header_that_breaks_the_schema_is_refused(change, words):
    """Signed with the secret (a rollout rank's bug, not an attacker): still checked before use."""
    header = {"key": "k", "tree": {"I": [0, 2]}}
    header["specs"] = [["int64", 2], ["float64", 0], ["uint8", 0]]
    change(header)
    payload = [
        torch.zeros(count, dtype=wire.DTYPES[dtype])
        for dtype, count in header["specs"][:3]
        if dtype in wire.DTYPES and count >= 0
    ]
    signed = wire.sign(SECRET, {**header, "sha256": wire.digest(payload)})
    channel = LoopChannel()
    channel.send(torch.tensor([len(signed)], dtype=torch.int64))
    channel.send(torch.frombuffer(bytearray(signed), dtype=torch.uint8))
    for t in payload:
        channel.send(t)
    with pytest.raises(wire.Refused, match=words):
        wire.recv(channel, SECRET, "k")


@pytest.mark.tally("bad_inputs")
def test_a_header_length_out_of_bounds_is_refused():
    channel = LoopChannel()
    channel.send(torch.tensor([2**40], dtype=torch.int64))
    with pytest.raises(wire.Refused, match="a header of 1099511627776 bytes"):
        wire.recv(channel, SECRET, "batch/0/0/0")


def _group(**change):
    g = {
        "example_index": 1,
        "prompt_ids": [3, 4],
        "responses": [[5, 6], [7]],
        "sampler_logps": [[-0.5, -0.25], [-1.0]],
        "truncated": [False, True],
        "raw": [1.0, 0.0],
        "verified": [True, False],
        "shaped": None,
        "old_logps": None,
        "version": 2,
        "uid": "2/0/0",
    }
    return {**g, **change}


@pytest.mark.tally("bad_inputs")
@pytest.mark.parametrize(
    "group, words",
    [
        (_group(responses=[[5, 6]]), "responses"),  # 1 response, n = 2
        (_group(sampler_logps=[[-0.5], [-1.0]]), "log-probs/tokens"),
        (_group(responses=[[5, -6], [7]]), "responses"),  # a negative token id
        (_group(truncated=[0, 1]), "truncated"),
        (_group(raw=["1", 0.0]), "raw"),
        (_group(verified=[1, 0]), "verified"),
        (_group(version=-1), "version"),
        (_group(uid=7), "uid"),
        (_group(old_logps=[[-0.5]]), "old_logps"),  # no pi_old travels
        ({**_group(), "extra": 1}, "fields"),
    ],
)
def test_a_batch_that_breaks_the_group_schema_is_refused(group, words):
    message = {"groups": [group], "version": 2, "checksum": 1.0, "engine_rms": None}
    assert len(check_batch({**message, "groups": [_group()]}, 1, 2, "k")) == 1
    with pytest.raises(wire.Refused, match=f"k: group 0: .*{words}|k: group 0: {words}"):
        check_batch(message, 1, 2, "k")
    with pytest.raises(wire.Refused, match="more than 1 groups"):
        check_batch({**message, "groups": [_group(), _group()]}, 1, 2, "k")


def test_the_run_secret_is_a_0600_file_the_store_names_by_fingerprint_only(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.delenv(wire.SECRET_ENV, raising=False)
    store = Store()
    key = wire.run_secret(store, str(tmp_path), rank=0)
    path = tmp_path / wire.SECRET_FILE
    assert len(key) == 32 and path.read_bytes() == key
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert store.get("secret") == hashlib.sha256(key).hexdigest().encode()
    assert key not in b"".join(store.data.values())
    assert wire.run_secret(store, str(tmp_path), rank=1) == key
    os.chmod(path, 0o644)
    with pytest.raises(wire.Refused, match="must be a 0600 file"):
        wire.run_secret(store, str(tmp_path), rank=1, timeout_s=0.2)
    os.chmod(path, 0o600)
    path.write_bytes(b"another run's secret, 32 bytes!!")
    with pytest.raises(wire.Refused, match="matching the one rank 0 published"):
        wire.run_secret(store, str(tmp_path), rank=1, timeout_s=0.2)
