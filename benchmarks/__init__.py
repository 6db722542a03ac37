"""Micro-benchmarks, capacity and attack benchmarks and the soak run of devicemq.

Run from a clone of the repository (``python -m benchmarks.codec_bench`` and so
on); the wheel and the image do not ship this package (pyproject.toml's package
list leaves it out): some of these start the test suite's servers
(tests/kafka_fixtures.py, tests/integration/redis_servers.py,
tests/auth_service.py). ``devicemq loadtest`` is the shipped load tool
(loadtest/); BENCHMARKS.md records what these measured.
"""
