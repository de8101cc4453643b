"""Keeps every answer under /api/ JSON, including the ones Django makes before a view runs."""

from __future__ import annotations

from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse

from runs.api import error


class JsonApiErrorsMiddleware:
    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith("/api/"):
            return self.get_response(request)
        if request.method in {"POST", "PUT", "PATCH"}:
            limit = settings.CHECK_MAX_BODY_BYTES
            try:
                declared = int(request.headers.get("Content-Length") or 0)
            except ValueError:
                declared = 0
            try:
                too_big = declared > limit or len(request.body) > limit
            except RequestDataTooBig:
                too_big = True
            if too_big:
                return error(413, "payload_too_large", f"The body is over {limit // 1024} KiB.")
        response = self.get_response(request)
        content_type = response.get("Content-Type", "")
        if response.status_code >= 400 and not content_type.startswith("application/json"):
            codes = {404: "not_found", 405: "method_not_allowed", 403: "forbidden"}
            code = codes.get(response.status_code, "error")
            replacement = error(response.status_code, code, response.reason_phrase)
            if response.has_header("Allow"):
                replacement["Allow"] = response["Allow"]
            return replacement
        return response
