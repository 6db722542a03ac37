"""The order in which ``pytest -n 2 --dist loadfile`` (.ci/run) hands out test files.

xdist's own order is by number of tests per file, most first: the files of a few
slow tests (Spark jobs, model seeds, failovers) came last, and one of them still
running at the end kept the other process idle. Here the heaviest unit goes
first (longest-processing-time first), by :data:`SECONDS` measured per file; a
file not listed counts :data:`PER_TEST` seconds a test. The files of
:data:`ONE_UNIT_PER_TEST` hold no module-scoped fixture and each test is a
minute's job: their tests are handed out one by one, so both processes share
them. Every other file stays whole in one process (its module-scoped fixtures
are set up once).

The numbers: a whole run (``--durations=0``, setup + call + teardown summed per
file) on a busy 2-core machine, about 2.5 times CI's; only their order and their
size against one another matter. A file that grows slow belongs here.
"""

from __future__ import annotations

from typing import Any

from xdist.scheduler import LoadFileScheduling

PER_TEST = 0.2

ONE_UNIT_PER_TEST = frozenset({"tests/model/test_model.py", "tests/pipeline/test_stream.py"})

SECONDS: dict[str, float] = {
    "tests/pipeline/test_stream.py": 689,
    "tests/model/test_model.py": 332,
    "tests/cluster/test_workers.py": 197,
    "tests/faults/test_promises.py": 177,
    "tests/pipeline/test_audit_by_partition.py": 173,
    "tests/pipeline/test_audit.py": 162,
    "tests/faults/test_redis_sentinel.py": 158,
    "tests/e2e/test_application_sessions.py": 152,
    "tests/pipeline/test_decoding.py": 138,
    "tests/e2e/test_security_attacks.py": 127,
    "tests/pipeline/test_class_archive.py": 122,
    "tests/loadtest/test_smoke.py": 120,
    "tests/cluster/test_on_redis_cluster.py": 103,
    "tests/faults/test_kafka_security.py": 97,
    "tests/cluster/test_shared_state.py": 89,
    "tests/e2e/test_embedded_kafka_compaction.py": 85,
    "tests/e2e/test_host_restart.py": 84,
    "tests/faults/test_rebalance.py": 82,
    "tests/faults/test_integrations.py": 80,
    "tests/integration/test_device_persistence.py": 72,
    "tests/cluster/test_replicas.py": 71,
    "tests/unit/test_codec_roundtrip.py": 69,
    "tests/e2e/test_external_auth.py": 67,
    "tests/faults/test_readiness.py": 66,
    "tests/e2e/test_admin_console.py": 62,
    "tests/faults/test_broker_restart.py": 61,
    "tests/faults/test_backend_outages.py": 59,
    "tests/integration/test_redis_store.py": 55,
    "tests/loadtest/test_ab_run.py": 55,
    "tests/e2e/test_group_queue.py": 47,
    "tests/integration/test_services.py": 46,
    "tests/pipeline/test_traffic.py": 45,
    "tests/e2e/test_conformance_v5.py": 41,
    "tests/faults/test_redis_security.py": 40,
    "tests/cluster/test_owners_across_replicas.py": 38,
    "tests/deploy/test_image_build.py": 37,
    "tests/e2e/test_queue_limits.py": 35,
    "tests/deploy/test_readme_demo.py": 35,
    "tests/faults/test_ecq_restart.py": 33,
    "tests/e2e/test_bad_input.py": 32,
    "tests/faults/test_expiry.py": 30,
    "tests/e2e/test_security_auth.py": 30,
    "tests/e2e/test_session_rewind.py": 30,
    "tests/faults/test_qos2_publisher_crash.py": 30,
    "tests/cluster/test_admin_replicas.py": 29,
    "tests/unit/test_import_direction.py": 29,
    "tests/faults/test_disk_full.py": 29,
    "tests/faults/test_packet_ids.py": 28,
    "tests/loadtest/test_fleet.py": 26,
    "tests/e2e/test_admin_api.py": 26,
    "tests/pipeline/test_report_charts.py": 26,
    "tests/cluster/test_loadtest_by_replica.py": 24,
    "tests/e2e/test_broker_settings.py": 24,
    "tests/deploy/test_prometheus.py": 23,
    "tests/integration/test_consumer_after_a_kafka_restart.py": 21,
    "tests/faults/test_offline_replay.py": 21,
    "tests/e2e/test_ecq.py": 19,
    "tests/faults/test_client_vanish.py": 17,
    "tests/integration/test_consumer_rejoin.py": 17,
}


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


class HeaviestFirst(LoadFileScheduling):
    """``--dist loadfile``, the heaviest remaining unit handed out first."""

    def _split_scope(self, nodeid: str) -> str:
        return nodeid if _file(nodeid) in ONE_UNIT_PER_TEST else _file(nodeid)

    def _cost(self, scope: str) -> float:
        file = _file(scope)
        tests = len(self.workqueue[scope])
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
