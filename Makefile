# The README's two commands are `make demo` and `make test`; everything else is here too.
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip

.PHONY: install install-run demo serve worker test lint bench bench-quick

# No bytecode at install time (PIP_NO_COMPILE, also read by the pip that venv and the build
# environments run): Python compiles (and keeps) what is actually imported, on first import,
# rather than every file of every package, most never imported by the server. It halved the
# venv step of a fresh `make demo` (README: "From a fresh clone").
.venv/bin/python:
	PIP_NO_COMPILE=1 python3 -m venv .venv

# What running needs: the server (its distribution includes the client package it shares
# the pure rules with), and the client package itself, editable, because the checkout's
# governance_client/ folder would otherwise hide the server's editable copy of it.
# The venv's own pip is recent enough; `install` upgrades it.
# Each install leaves a stamp in .venv and runs again only when a pyproject.toml is newer:
# `make test` then starts at once, and two `make test` at the same time (CI runs the two
# stacks side by side) never run pip in one venv together. `rm .venv/.installed*` forces it.
install-run: .venv/.installed-run
install: .venv/.installed

.venv/.installed-run: pyproject.toml governance_client/pyproject.toml | .venv/bin/python
	PIP_NO_COMPILE=1 $(PIP) install -q -e . -e ./governance_client
	touch $@

# What the tests need too: the test tools, and the client with every framework its
# integrations and examples are tested against (the extra `all`).
.venv/.installed: .venv/.installed-run
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e './governance_client[all]' -e '.[test]'
	touch $@

# `demo` migrates the database itself (one start of Django instead of two).
demo: install-run
	$(PY) manage.py demo

serve:
	$(PY) manage.py serve

# Three workers (docs/reliability.md, "Worker pools"): the kill switch's fan-out on a pool of
# its own, which backtests, bulk work and webhook receivers never occupy; the webhook
# deliveries on another; the rest on the third. Deployments run the three commands as three
# services. Ctrl-C (or a TERM to the shell) stops them all; each finishes the task at hand.
worker:
	trap 'trap - INT TERM; kill 0' INT TERM; \
	.venv/bin/celery -A governance worker -Q killswitch -n killswitch@%h --concurrency 2 -l info & \
	.venv/bin/celery -A governance worker -Q webhooks -n webhooks@%h --concurrency 2 -l info & \
	.venv/bin/celery -A governance worker -Q default,bulk -n bulk@%h --concurrency 2 -l info & \
	wait

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

lint:
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-cache

bench: install
	$(PY) -m bench

bench-quick: install
	$(PY) -m bench --quick
