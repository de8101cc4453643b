# The README's two commands are `make demo` and `make test`; everything else is here too.
PY ?= .venv/bin/python
PIP ?= .venv/bin/pip

.PHONY: install install-run demo serve worker test lint bench bench-quick

.venv/bin/python:
	python3 -m venv .venv

# What running needs: the server (its distribution includes the client package it shares
# the pure rules with).
install-run: .venv/bin/python
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e . -e ./governance_client

# What the tests need too: the test tools, and the client with every framework its
# integrations and examples are tested against (the extra `all`).
install: install-run
	$(PIP) install -q -e './governance_client[all]' -e '.[test]'

demo: install-run
	$(PY) manage.py migrate --noinput -v0
	$(PY) manage.py demo

serve:
	$(PY) manage.py serve

worker:
	.venv/bin/celery -A governance worker -Q default,killswitch --concurrency 2 -l info

test: install
	$(PY) -m pytest

lint:
	.venv/bin/ruff check .
	.venv/bin/lint-imports --no-cache

bench: install
	$(PY) -m bench

bench-quick: install
	$(PY) -m bench --quick
