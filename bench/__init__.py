"""The benchmark that ships with the product: `python -m bench` (`make bench`).

It drives the production stack (PostgreSQL, Redis, `manage.py serve` with its worker
processes) with simulated agents and reports throughput, latency, errors and the audit
invariant (decision rows written = decisions returned), beside two baselines measured on the
same server in the same run. See docs/performance.md.
"""
