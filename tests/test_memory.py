"""Process memory policy of the data path (parser.memory)."""

from __future__ import annotations

import gc
import weakref

from mirrorckpt.parser import memory


class _Node:
    pass


def test_freezing_start_up_keeps_its_objects_and_still_collects_later_cycles():
    before = _Node()
    before.me = before  # a cycle alive at freeze time
    gc.unfreeze()
    try:
        frozen = memory.freeze_startup_heap()
        assert frozen > 1000 and gc.get_freeze_count() == frozen
        # A full pass no longer walks start-up's objects ...
        assert all(o is not before for o in gc.get_objects(generation=2))
        # ... and a cycle made afterwards is still found and freed.
        later = _Node()
        later.me = later
        ref = weakref.ref(later)
        del later
        gc.collect()
        assert ref() is None
        assert before.me is before
    finally:
        gc.unfreeze()
