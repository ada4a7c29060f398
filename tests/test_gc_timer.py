import gc

from forgelab.runtime.gc_timer import gc_stats


def test_gc_timer_counts_collections_and_their_time():
    before = gc_stats()
    junk = [[i] for i in range(200_000)]  # something for a full collection to scan
    gc.collect()
    after = gc_stats()
    del junk
    assert after["gc_collections"] >= before["gc_collections"] + 1
    assert after["gc_pause_s"] > before["gc_pause_s"]
    assert after["gc_max_pause_s"] <= after["gc_pause_s"]
