"""The order in which ``pytest -n 3 --dist loadfile`` (.ci/run) hands out test files.

xdist's own order is by number of tests per file, most first: the files of a few
slow tests (Spark jobs, model seeds, failovers) came last, and one of them still
running at the end kept the other process idle. Here the heaviest unit goes
first (longest-processing-time first), by :data:`SECONDS` measured per file; a
file not listed counts :data:`PER_TEST` seconds a test. The files of
:data:`ONE_UNIT_PER_TEST` hold no module-scoped fixture and each test is a
minute's job: their tests are handed out one by one, so both processes share
them. The folders of :data:`ONE_UNIT_PER_FOLDER` go whole to one process: their
session-scoped fixtures are started once, not once in each process (for
tests/pipeline a SparkSession, whose cold JVM makes the first jobs slow, and
the workload's Tansu, Redis and devicemq). Every other file stays whole in one
process (its module-scoped fixtures are set up once).

The numbers: a whole run's seconds per file (setup + call + teardown of its
tests summed; 15 min on 2 cores, nothing else running), the files above 6 s;
only their order and their size against one another matter. A file that grows
slow belongs here.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

PER_TEST = 0.05

ONE_UNIT_PER_TEST = frozenset({"tests/model/test_model.py"})

ONE_UNIT_PER_FOLDER = ("tests/pipeline/",)

SECONDS: dict[str, float] = {
    "tests/pipeline/test_stream.py": 193,
    "tests/model/test_model.py": 131,
    "tests/faults/test_promises.py": 106,
    "tests/faults/test_redis_sentinel.py": 83,
    "tests/integration/test_device_persistence.py": 72,
    "tests/e2e/test_security_attacks.py": 62,
    "tests/e2e/test_admin_console.py": 51,
    "tests/e2e/test_application_sessions.py": 49,
    "tests/e2e/test_host_restart.py": 42,
    "tests/integration/test_services.py": 42,
    "tests/e2e/test_external_auth.py": 39,
    "tests/loadtest/test_smoke.py": 38,
    "tests/unit/test_codec_roundtrip.py": 38,
    "tests/cluster/test_on_redis_cluster.py": 37,
    "tests/faults/test_broker_restart.py": 37,
    "tests/pipeline/test_class_archive.py": 34,
    "tests/pipeline/test_audit_by_partition.py": 33,
    "tests/integration/test_redis_store.py": 31,
    "tests/faults/test_integrations.py": 28,
    "tests/loadtest/test_ab_run.py": 25,
    "tests/faults/test_rebalance.py": 24,
    "tests/faults/test_backend_outages.py": 24,
    "tests/integration/test_consumer_after_a_kafka_restart.py": 24,
    "tests/e2e/test_conformance_v5.py": 22,
    "tests/cluster/test_shared_state.py": 22,
    "tests/cluster/test_workers.py": 22,
    "tests/faults/test_kafka_security.py": 21,
    "tests/cluster/test_replicas.py": 20,
    "tests/faults/test_expiry.py": 20,
    "tests/e2e/test_embedded_kafka_compaction.py": 20,
    "tests/faults/test_readiness.py": 20,
    "tests/pipeline/test_audit.py": 17,
    "tests/faults/test_ecq_restart.py": 17,
    "tests/faults/test_redis_security.py": 17,
    "tests/e2e/test_bad_input.py": 17,
    "tests/integration/test_consumer_rejoin.py": 16,
    "tests/faults/test_qos2_publisher_crash.py": 15,
    "tests/faults/test_disk_full.py": 14,
    "tests/loadtest/test_fleet.py": 13,
    "tests/pipeline/test_decoding.py": 12,
    "tests/pipeline/test_traffic.py": 11,
    "tests/cluster/test_owners_across_replicas.py": 10,
    "tests/e2e/test_group_queue.py": 10,
    "tests/e2e/test_sys_topics.py": 10,
    "tests/cluster/test_loadtest_by_replica.py": 9,
    "tests/deploy/test_compose_broker.py": 9,
    "tests/deploy/test_prometheus.py": 9,
    "tests/cluster/test_group_queue_replicas.py": 9,
    "tests/e2e/test_ecq.py": 9,
    "tests/cluster/test_admin_replicas.py": 8,
    "tests/deploy/test_readme_demo.py": 8,
    "tests/e2e/test_broker_settings.py": 8,
    "tests/e2e/test_queue_limits.py": 8,
    "tests/faults/test_group_queue_kill.py": 8,
    "tests/faults/test_client_vanish.py": 8,
    "tests/e2e/test_admin_api.py": 7,
    "tests/integration/test_kafka_path.py": 7,
    "tests/cluster/test_shared_port.py": 7,
    "tests/integration/test_consumer_offset_holes.py": 6,
    "tests/cluster/test_acl_across_replicas.py": 6,
}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _folder(file: str) -> str | None:
    """The folder of :data:`ONE_UNIT_PER_FOLDER` that holds ``file``, if any."""
    return next((f for f in ONE_UNIT_PER_FOLDER if file.startswith(f)), None)


class HeaviestFirst(LoadFileScheduling):
    """``--dist loadfile``, the heaviest remaining unit handed out first."""

    def _split_scope(self, nodeid: str) -> str:
        file = _file(nodeid)
        return nodeid if file in ONE_UNIT_PER_TEST else _folder(file) or file

    def _cost(self, scope: str) -> float:
        file = _file(scope)
        tests = len(self.workqueue[scope])
        if scope in ONE_UNIT_PER_FOLDER:
            files = {_file(nodeid) for nodeid in self.workqueue[scope]}
            listed = sum(SECONDS.get(f, 0.0) for f in files)
            return listed + PER_TEST * sum(
                1 for nodeid in self.workqueue[scope] if _file(nodeid) not in SECONDS
            )
        if file not in SECONDS:
            return PER_TEST * tests
        if file in ONE_UNIT_PER_TEST:
            in_file = sum(1 for nodeid in self.collection or () if _file(nodeid) == file)
            return SECONDS[file] / max(in_file, 1)
        return SECONDS[file]

    def _assign_work_unit(self, node: Any) -> None:
        heaviest = max(self.workqueue, key=self._cost)
        self.workqueue.move_to_end(heaviest, last=False)  # the next one taken
        super()._assign_work_unit(node)
