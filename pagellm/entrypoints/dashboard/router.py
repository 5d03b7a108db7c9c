"""The dashboard's routes: the page, its static files, its event stream and its small APIs.

With ``--api-key`` they need the key like the API (``pagellm.entrypoints.server_state.authorize``):
``Authorization: Bearer KEY``, or ``/dashboard?key=KEY`` once, which sets an HttpOnly cookie for the
page and its stream and redirects to drop the key from the address bar.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from pagellm.entrypoints.dashboard.hub import DashboardHub
from pagellm.entrypoints.errors import error_response
from pagellm.entrypoints.server_state import ServerState, authorize

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
}
COOKIE = "pagellm_dashboard_key"


def dashboard_router(hub: DashboardHub, server_state: ServerState) -> APIRouter:
    """The dashboard's routes over ``hub``; the API server includes them unless ``--no-dashboard``."""
    router = APIRouter(include_in_schema=False)

    def authorized(request: Request) -> bool:
        keys = (request.cookies.get(COOKIE), request.query_params.get("key"))
        return authorize(server_state, request.headers.get("authorization"), keys)

    def unauthorized() -> Response:
        return error_response("Unauthorized: a valid API key is required (Authorization: Bearer <key>, or open /dashboard?key=<key>)", 401)

    @router.get("/dashboard")
    async def dashboard_page(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        if "key" in request.query_params:  # keep the key out of the address bar and history
            response = RedirectResponse("/dashboard", status_code=303)
            response.set_cookie(COOKIE, request.query_params["key"], httponly=True, samesite="strict", path="/dashboard")
            return response
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html", headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/static/{name}")
    async def dashboard_static(name: str) -> Response:
        if name not in STATIC_FILES:  # static assets carry no data, so no key is needed for them
            return error_response(f"no such file: {name}", 404)
        return FileResponse(STATIC_DIR / name, media_type=STATIC_FILES[name])

    @router.get("/dashboard/events")
    async def dashboard_events(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        return StreamingResponse(
            hub.stream(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    @router.get("/dashboard/api/snapshot")
    async def dashboard_snapshot(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        return JSONResponse(await hub.snapshot())

    @router.get("/dashboard/api/cost")
    async def dashboard_cost(request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        return JSONResponse({"polls": hub.num_polls, "engine_s": hub.engine_s, "loop_s": hub.loop_s, "clients": len(hub.clients)})

    @router.get("/dashboard/api/block/{block_id}")
    async def dashboard_block(block_id: int, request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        return JSONResponse(await hub.describe_block(block_id))

    @router.get("/dashboard/api/slot/{slot_id}")
    async def dashboard_slot(slot_id: int, request: Request) -> Response:
        if not authorized(request):
            return unauthorized()
        try:
            return JSONResponse(await hub.describe_slot(slot_id))
        except ValueError as e:  # no such slot, or a model without recurrent state
            return error_response(str(e), 404)

    return router
