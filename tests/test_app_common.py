"""views/common.py's process-wide pieces that need no page run."""
from __future__ import annotations

import gc
import weakref


def test_a_freeze_after_a_load_lets_go_of_what_an_earlier_one_froze():
    """A pair evicted from the page cache since the last load (here a cycle, as a model's modules
    can hold) is collected at the next load, not kept frozen for good."""
    from views.common import freeze_long_lived

    class Node:
        pass

    evicted = Node()
    evicted.me = evicted  # a reference cycle: only the cyclic collector frees it
    gone = weakref.ref(evicted)
    try:
        freeze_long_lived()  # a load: the cycle is long-lived now
        assert gc.get_freeze_count() > 0
        del evicted
        gc.collect()
        assert gone() is not None  # frozen: full collections skip it
        freeze_long_lived()  # the next load
        assert gone() is None
    finally:
        gc.unfreeze()
