"""Stand-ins for asynchronous RL's transport tests (tests/prorl/test_async_*.py): the TCP store's
set/check/get as a dict (bytes in, bytes out, as torch's TCPStore), a point-to-point channel as a
queue, and a push process group whose broadcasts wait until released."""

import collections
import threading

SECRET = bytes(range(32))  # the run secret of the stand-in runs


class Store:
    """The store's set/check/get as a dict (values as bytes, like TCPStore)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        del self.data[key]


class LoopChannel:
    """wire's channel to a peer, as a queue: `send` keeps a copy, `recv` fills the next one in
    (its shape and dtype must match, as gloo's)."""

    def __init__(self):
        self.sent = collections.deque()

    def send(self, t):
        self.sent.append(t.clone())

    def recv(self, t):
        got = self.sent.popleft()
        assert got.dtype == t.dtype and got.shape == t.shape, (got.dtype, got.shape, t.shape)
        t.copy_(got)


class BlockingGroup:
    """A push group whose broadcasts wait until `release` is set (a rollout rank still
    generating); every broadcast tensor is kept in `sent`."""

    def __init__(self):
        self.release, self.sent = threading.Event(), []

    def broadcast(self, tensors, opts):
        group = self

        class Work:
            def wait(self):
                group.release.wait(10)
                group.sent.append(tensors[0].clone())

        return Work()


class ReplayGroup:
    """A rollout's push group that replays what a BlockingGroup sent (the root's broadcasts)."""

    def __init__(self, sent):
        self.sent = collections.deque(sent)

    def broadcast(self, tensors, opts):
        got = self.sent.popleft()
        assert got.dtype == tensors[0].dtype and got.shape == tensors[0].shape
        tensors[0].copy_(got)

        class Work:
            def wait(self):
                pass

        return Work()
