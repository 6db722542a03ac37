"""``devicemq loadtest``: the shipped load tool (also ``python -m loadtest``).

cli.py parses the scenarios; scenarios.py, runner.py, worker.py, client.py and
report.py run ``p2p``, ``fan-in``, ``fan-out`` and ``fleet`` (storm.py its
reconnect storm); ecq.py and group_queue.py the queue scenarios, on what
queue_load.py gives both; ab/ compares two revisions with these scenarios.
Nothing here imports the tests; the micro-benchmarks live in benchmarks/,
which the wheel does not ship.
"""
