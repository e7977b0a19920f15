"""The raw loop: fetch raw records, vote, forward, commit after the broker's ack."""
