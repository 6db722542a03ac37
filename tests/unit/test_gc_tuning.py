"""app/serve.py's tune_gc: the thresholds a serving broker collects garbage with."""

from __future__ import annotations

import gc

from app.serve import GC_THRESHOLDS, tune_gc


def test_a_serving_broker_collects_young_objects_rarely() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)  # CPython's defaults
        tune_gc()
        assert gc.get_threshold() == GC_THRESHOLDS
        assert GC_THRESHOLDS[0] >= 10_000  # a message dies young, not in gen 2
    finally:
        gc.set_threshold(*before)
