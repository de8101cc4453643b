import os

import django
from django.core.handlers.wsgi import WSGIHandler

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "governance.settings")
django.setup(set_prefix=False)  # as get_wsgi_application(), with the project's request class

from .handlers import TextCharsetWSGIRequest  # noqa: E402


class Handler(WSGIHandler):
    # A declared charset that decodes no text is ignored rather than a 500 before any
    # middleware (governance/handlers.py).
    request_class = TextCharsetWSGIRequest


application = Handler()
