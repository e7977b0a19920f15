"""Kafka plumbing: client options and builders, the batched sink, lenient reads."""
