"""The bounded LRU cache behind the chain, replay-term and replay caches."""

from ckplan.cache import BoundedCache


def test_least_recently_used_goes_first_beyond_the_entries():
    cache = BoundedCache(max_entries=2, max_weight=100)
    cache.put("a", 1, 1)
    cache.put("b", 2, 1)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3, 1)
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (1, None, 3)


def test_weight_bounds_the_sum_and_the_newest_entry_stays():
    cache = BoundedCache(max_entries=10, max_weight=10)
    cache.put("a", 1, 6)
    cache.put("b", 2, 4)
    assert len(cache) == 2
    cache.put("c", 3, 1)  # 11 > 10: a goes
    assert (cache.get("a"), cache.get("b"), cache.get("c")) == (None, 2, 3)
    cache.put("huge", 4, 50)  # heavier than the bound alone: kept, the rest go
    assert len(cache) == 1 and cache.get("huge") == 4


def test_replacing_a_key_replaces_its_weight():
    cache = BoundedCache(max_entries=10, max_weight=10)
    cache.put("a", 1, 9)
    cache.put("a", 2, 1)
    cache.put("b", 3, 9)
    assert (cache.get("a"), cache.get("b")) == (2, 3)
    cache.clear()
    assert len(cache) == 0 and cache.get("a") is None
