"""A bench-only Django application with no middleware: the floor the real check is compared
with (issue 17). Its own settings module, URLconf and WSGI entry point; served by granian with
the same arguments as `manage.py serve`, against the same PostgreSQL database."""
