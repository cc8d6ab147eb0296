"""The served-prefix route on the server's admin HTTP: what a failed streamed retrieve handed over.

``GET restore_window.SERVED_ROUTE`` answers, for a (request, worker instance), the chunks the
last retrieve handed over before it failed, or 404 when its last retrieve did not fail; the
worker's :mod:`kvpersist.serving.connector.worker.served_prefix` asks it to keep those blocks.
"""

from __future__ import annotations

from typing import Any

from ... import restore_window as rules
from .state import WindowState


def add_served_route(state: WindowState, app: Any) -> None:
    """Add the route to ``app`` (LMCache's FastAPI admin application)."""
    from fastapi.responses import JSONResponse

    def served_prefix(request_id: str, instance_id: int) -> JSONResponse:
        served = state.served.served(request_id, instance_id)
        if served is None:
            return JSONResponse({"error": f"no failed retrieve of request {request_id!r} by "
                                          f"instance {instance_id} is recorded"},
                                status_code=404)
        return JSONResponse({"request_id": request_id, "instance_id": instance_id,
                             "served_chunks": served})

    app.add_api_route(rules.SERVED_ROUTE, served_prefix, methods=["GET"])
