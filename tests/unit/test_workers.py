"""How ``devicemq run --workers`` reads its setting and shapes each worker's settings."""

from __future__ import annotations

import dataclasses
import os

import pytest

from app.workers import check_workers, worker_count, worker_settings
from broker.config import ConfigError, MetricsSettings, PersistenceSettings, Settings


def _with_workers(text: str) -> Settings:
    return dataclasses.replace(Settings(), workers=text)


def test_auto_is_one_worker_per_core_this_process_may_use() -> None:
    assert worker_count(_with_workers("auto")) == len(os.sched_getaffinity(0))
    assert worker_count(_with_workers(" AUTO ")) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize("text", ["0", "-1", "257", "two", ""])
def test_a_bad_count_names_the_setting(text: str) -> None:
    with pytest.raises(ConfigError, match="workers"):
        worker_count(_with_workers(text))


def test_several_workers_need_persistence_and_room_for_their_metrics_ports() -> None:
    no_persistence = dataclasses.replace(Settings(), persistence=PersistenceSettings(enabled=False))
    check_workers(no_persistence, 1)
    with pytest.raises(ConfigError, match="enable persistence"):
        check_workers(no_persistence, 2)
    high = dataclasses.replace(Settings(), metrics=MetricsSettings(enabled=True, port=65535))
    with pytest.raises(ConfigError, match=r"metrics\.port"):
        check_workers(high, 2)


def test_each_worker_is_a_replica_sharing_the_ports_with_its_own_name_and_metrics() -> None:
    settings = dataclasses.replace(
        Settings(), workers="3", metrics=MetricsSettings(enabled=True, port=9000)
    )
    endpoints = ("redis://127.0.0.1:1/0", "127.0.0.1:2")
    made = [worker_settings(settings, endpoints, i) for i in range(3)]
    assert [w.metrics.port for w in made] == [9000, 9001, 9002]
    assert len({w.cluster.node_id for w in made}) == 3
    for w in made:
        assert w.cluster.enabled and w.cluster.share_ports
        assert (w.persistence.redis_url, w.persistence.kafka_bootstrap) == endpoints
        assert w.workers == "1"  # a worker does not start workers of its own
    # A restarted worker keeps its name: the cluster sees the same replica come back.
    assert worker_settings(settings, endpoints, 1).cluster.node_id == made[1].cluster.node_id
