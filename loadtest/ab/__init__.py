"""``python -m loadtest.ab``: one revision against another (or Mosquitto), side by side.

- :mod:`loadtest.ab.build`: a revision checked out once into a cache, with a
  venv that imports it first;
- :mod:`loadtest.ab.brokers`: a fresh broker of a tree (or a Mosquitto) per
  run, and the CPU of its processes;
- :mod:`loadtest.ab.plan`: the scenarios and the order of the runs;
- :mod:`loadtest.ab.summary`: medians, ratios and the table;
- :mod:`loadtest.ab.cli`: the command.
"""
