"""Stand-ins for asynchronous RL's transport tests (tests/prorl/test_async_*.py): the TCP store's
set/check/get as a dict, and a push process group whose broadcasts wait until released."""

import threading


class Store:
    """The store's set/check/get as a dict (transport.put / take)."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def delete_key(self, key):
        del self.data[key]


class BlockingGroup:
    """A push group whose broadcasts wait until `release` is set (a rollout rank still
    generating)."""

    def __init__(self):

        self.release, self.sent = threading.Event(), []

    def broadcast(self, tensors, opts):
        group = self

        class Work:
            def wait(self):
                group.release.wait(10)
                group.sent.append(tensors[0].clone())

        return Work()
