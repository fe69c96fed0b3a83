"""pycoll's Store interface over the c10d store torch hands the backend, so that the backend
rendezvouses through it (no second port)."""
from __future__ import annotations

import datetime
from typing import Optional, Sequence

import torch.distributed as dist

from ..bootstrap.store import Store
from ..errors import TimeoutError


class C10dStore(Store):
    """pycoll's Store interface over a torch c10d store (the one torch gives the backend)."""

    def __init__(self, store: "dist.Store", timeout: float) -> None:
        self._store, self.timeout = store, timeout

    def _wait(self, keys: Sequence[str], timeout: Optional[float]) -> None:
        t = self.timeout if timeout is None else timeout
        try:
            self._store.wait(list(keys), datetime.timedelta(seconds=max(t, 0.001)))
        except RuntimeError as e:  # c10d's DistStoreError: a timeout (or a lost store)
            missing = [k for k in keys if not self.check([k])]
            raise TimeoutError(f"store keys still missing after {t:g} s: {missing} ({e})") from None

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, bytes(value))

    def get(self, key: str, timeout: Optional[float] = None) -> bytes:
        self._wait([key], timeout)
        return bytes(self._store.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._store.add(key, int(amount)))

    def check(self, keys: Sequence[str]) -> bool:
        return bool(self._store.check(list(keys)))

    def wait(self, keys: Sequence[str], timeout: Optional[float] = None) -> None:
        self._wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(key))
