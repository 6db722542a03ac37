"""How ``devicemq run --workers`` reads its setting and shapes each worker's settings."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import time

import pytest

from app.workers import (
    LISTENING,
    STABLE,
    Supervisor,
    check_workers,
    node_name,
    worker_count,
    worker_settings,
)
from broker.config import (
    ApplicationSettings,
    ConfigError,
    MetricsSettings,
    PersistenceSettings,
    Settings,
)


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


def test_several_workers_serve_application_sessions() -> None:
    """Each worker is a cluster replica, and replicas serve APPLICATION sessions (one
    at a time each, docs/application-sessions.md): not refused any more."""
    apps = dataclasses.replace(
        Settings(),
        persistence=dataclasses.replace(Settings().persistence, enabled=True),
        application=ApplicationSettings(client_ids=("^backend-",)),
    )
    check_workers(apps, 1)
    check_workers(apps, 2)


def test_each_worker_is_a_replica_sharing_the_ports_with_its_own_metrics() -> None:
    settings = dataclasses.replace(
        Settings(), workers="3", metrics=MetricsSettings(enabled=True, port=9000)
    )
    endpoints = ("redis://127.0.0.1:1/0", "127.0.0.1:2")
    made = [worker_settings(settings, endpoints, i, node_name(settings, i, 0)) for i in range(3)]
    assert [w.metrics.port for w in made] == [9000, 9001, 9002]
    assert len({w.cluster.node_id for w in made}) == 3
    for w in made:
        assert w.cluster.enabled and w.cluster.share_ports
        assert (w.persistence.redis_url, w.persistence.kafka_bootstrap) == endpoints
        assert w.workers == "1"  # a worker does not start workers of its own


def test_a_restarted_worker_gets_a_new_name() -> None:
    """The others see the dead one's heartbeat expire and drop its sessions; the same
    name back within the heartbeat's TTL would hide that it died (a review finding)."""
    settings = Settings()
    assert node_name(settings, 1, 0) != node_name(settings, 1, 1)
    cluster = dataclasses.replace(settings.cluster, node_id="n")
    named = dataclasses.replace(settings, cluster=cluster)
    assert node_name(named, 1, 2) == "n-w1-2"


class _Exited:
    """What the supervisor reads of a worker process that has exited."""

    pid = 4242
    exitcode = 1


def test_a_worker_that_keeps_crashing_after_it_listens_is_restarted_ever_later() -> None:
    """Backoff doubles while a worker dies within STABLE seconds of its start, even
    when it got as far as listening (a review finding: LISTENING reset it)."""
    supervisor = Supervisor(Settings(), 1, ("redis://127.0.0.1:1/0", "127.0.0.1:2"))
    worker = supervisor.workers[0]
    delays = []
    for _ in range(7):
        ours, theirs = multiprocessing.Pipe()
        theirs.send((LISTENING, None))  # it listened, then died
        theirs.close()
        worker.conn, worker.listening = ours, False
        worker.process = _Exited()  # type: ignore[assignment]
        worker.started = time.monotonic() - 5
        supervisor._check(worker)
        assert worker.listening and worker.conn is None
        assert worker.restart_at is not None
        delays.append(round(worker.restart_at - time.monotonic()))
    assert delays == [1, 2, 4, 8, 16, 30, 30]
    worker.process, worker.started = _Exited(), time.monotonic() - STABLE  # type: ignore[assignment]
    supervisor._check(worker)
    assert worker.restart_at is not None
    assert round(worker.restart_at - time.monotonic()) == 1  # it had run a while: from 1 s again
