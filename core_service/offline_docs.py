"""/docs (Swagger UI) and /redoc served with assets shipped in the installed packages, so the API
pages work on a cluster with no route to a CDN: the Swagger UI and ReDoc bundles come from the
`fastapi-offline` package (MIT), nothing is fetched from outside the Core."""

from __future__ import annotations

from pathlib import Path

import fastapi_offline
from fastapi import APIRouter, HTTPException
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.responses import FileResponse, HTMLResponse

VENDOR_DIR = Path(fastapi_offline.__file__).parent / "static"
VENDOR_FILES = {
    "swagger-ui-bundle.js": "text/javascript",
    "swagger-ui.css": "text/css",
    "redoc.standalone.js": "text/javascript",
    "favicon.png": "image/png",
}
VENDOR_PREFIX = "/ui/vendor"


def offline_docs_router(title: str, openapi_url: str = "/openapi.json") -> APIRouter:
    """The app must be built with docs_url=None and redoc_url=None (these replace them)."""
    router = APIRouter(include_in_schema=False)

    @router.get(VENDOR_PREFIX + "/{name}")
    def vendor_asset(name: str) -> FileResponse:
        media_type = VENDOR_FILES.get(name)
        if media_type is None:
            raise HTTPException(404, detail=f"no asset {name!r}")
        return FileResponse(
            VENDOR_DIR / name, media_type=media_type, headers={"Cache-Control": "max-age=86400"}
        )

    @router.get("/docs")
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=openapi_url,
            title=f"{title} - API",
            swagger_js_url=f"{VENDOR_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{VENDOR_PREFIX}/swagger-ui.css",
            swagger_favicon_url=f"{VENDOR_PREFIX}/favicon.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
            # The default validator is a public web service: the badge would call it.
            swagger_ui_parameters={"validatorUrl": None},
        )

    @router.get("/docs/oauth2-redirect")
    def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @router.get("/redoc")
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=openapi_url,
            title=f"{title} - API",
            redoc_js_url=f"{VENDOR_PREFIX}/redoc.standalone.js",
            redoc_favicon_url=f"{VENDOR_PREFIX}/favicon.png",
            with_google_fonts=False,
        )

    return router
