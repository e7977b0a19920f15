"""Operator commands: inspect, release, redrive, pause/resume, rebuild."""
