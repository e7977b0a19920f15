"""The benchmark: the gateway against a plain forwarder and the naive patent.

Run it with `make bench` (or `.venv/bin/python -m bench --help`); results go to
`bench/results/` and the table in `bench/RESULTS.md`.
"""
