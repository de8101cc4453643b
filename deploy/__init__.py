"""Deployment material: systemd units, the proxy and pooler configurations, and the multi-node
test stack (deploy/stack.py) that starts them on one machine (docs/deploy.md)."""
