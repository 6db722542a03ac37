"""devicemq pipeline: PySpark jobs over the Kafka topics (audit, traffic) and their
Kafka data source. Needs the ``pipeline`` extra (pyspark, pyarrow, matplotlib) and Java 17.
"""
