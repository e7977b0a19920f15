"""The running service: composition root and lifecycle, health endpoints, workers."""
