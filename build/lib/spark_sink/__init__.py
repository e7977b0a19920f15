"""The Spark half of the dedup pipeline: reads the gateway's clean topic, drops
crash-window duplicates, runs a pluggable handler per micro-batch, writes the
successes to Parquet exactly once and publishes one release command per failure.

Entry points: `python -m spark_sink --config FILE` and `spark_sink.job.run_until_idle`.
"""
