"""A least-recently-used cache bounded by entries and by total weight.

The chains of a deep model, their replay terms and replays are large (a 100,000-layer chain holds
six tuples of 100,000 ints), and `ckplan plan` returns to each of a few thousand of them: an
entry count alone bounds neither memory nor hits, so each entry is weighed (in chain stages).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class BoundedCache:
    """At most `max_entries` entries whose weights sum to at most `max_weight` (the newest entry
    is kept whatever its weight); the least recently used go first."""

    def __init__(self, max_entries: int, max_weight: int) -> None:
        self.max_entries, self.max_weight = max_entries, max_weight
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._weight = 0

    def get(self, key: Hashable) -> Any | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: Hashable, value: Any, weight: int) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._weight -= old[1]
        self._entries[key] = (value, weight)
        self._weight += weight
        while len(self._entries) > 1 and (
            len(self._entries) > self.max_entries or self._weight > self.max_weight
        ):
            self._weight -= self._entries.popitem(last=False)[1][1]

    def clear(self) -> None:
        self._entries.clear()
        self._weight = 0

    def __len__(self) -> int:
        return len(self._entries)
