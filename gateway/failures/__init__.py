"""The failure loop: release and retry commands from the Spark job, dead letters."""
