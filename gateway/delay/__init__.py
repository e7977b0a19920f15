"""Scheduled delivery and coalescing windows: the delay tiers' loop and its router."""
