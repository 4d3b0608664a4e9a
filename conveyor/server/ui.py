"""The web page (playground + live engine view) and the engine-status endpoint it polls.

    GET /                    the page (static/index.html); off with --no-ui
    GET /ui/...              its CSS and JS, shipped in the package (no CDN, nothing fetched)
    GET /v1/engine/status    engine counters and the latest host / device spans, as JSON

The status endpoint reads only the engine's published stats snapshot and its bounded span
ring (AsyncEngine.stats / recent_spans), so polling it costs the engine loop nothing but
the GIL for the few hundred microseconds the JSON takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from conveyor.runtime.timeline import DEVICE_LANE, Span

if TYPE_CHECKING:
    from conveyor.server.state import ServerState

STATIC_DIR = Path(__file__).parent / "static"
RATE_WINDOW_S = 3.0
"""tokens_per_s counts the tokens sampled by steps that ended in this many last seconds."""
_LANES = {DEVICE_LANE: "device"}


def is_page_path(path: str) -> bool:
    """The page and its assets, served without an API key: they hold no secret (the page asks
    for the key and sends it with its API calls)."""
    return path == "/" or path.startswith("/ui/")


def mount_ui(app: FastAPI, state: ServerState, serve_page: bool) -> None:
    """The status endpoint always; the page and its assets when `serve_page` (not --no-ui)."""

    @app.get("/v1/engine/status")
    async def engine_status(
        since: float | None = Query(None, ge=0, description="only spans that ended after this engine time"),
        window: float = Query(5.0, gt=0, le=60, description="seconds of spans when `since` is left out"),
    ) -> JSONResponse:
        return JSONResponse(engine_status_body(state, since, window))  # plain JSON: skips jsonable_encoder

    if not serve_page:
        return

    # the page's URLs are relative to its <base>: the root, or --root-path's prefix, so that it works behind a proxy
    html = (
        (STATIC_DIR / "index.html").read_text().replace('<base href="/">', f'<base href="{state.options.root_path}/">')
    )

    @app.get("/", include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    app.mount("/ui", StaticFiles(directory=STATIC_DIR), name="ui")


def engine_status_body(state: ServerState, since: float | None, window_s: float) -> dict[str, Any]:
    engine = state.engine
    condition = (
        "dead" if engine.is_dead else "draining" if state.draining else "ready" if engine.is_ready else "loading"
    )
    body: dict[str, Any] = {
        "object": "engine.status",
        "state": condition,
        "model": state.options.model_name,
        "error": engine.error,
        "kernels": engine.info.kernels if engine.info is not None else None,
    }
    stats = engine.stats()
    now, spans = engine.recent_spans(since, window_s)
    sampled = sum(s.num_sampled for s in engine.recent_spans(now - RATE_WINDOW_S)[1] if s.lane == DEVICE_LANE)
    body["now"] = round(now, 6)
    body["tokens_per_s"] = round(sampled / RATE_WINDOW_S, 2)
    body["spans"] = [_span(s) for s in spans]
    if stats is None:
        body["stats"] = None
        return body
    body["stats"] = {
        "requests": {
            "running": stats.num_running,
            "waiting": stats.num_waiting,
            "preempted": stats.num_preempted_waiting,
            "in_server": engine.num_active,
        },
        "steps": stats.num_steps,
        "preemptions": stats.num_preemptions,
        "generated_tokens": stats.num_generated_tokens,
        "kv_blocks": {
            "total": stats.kv_blocks_total,
            "used": stats.kv_blocks_used,
            "free": stats.kv_blocks_free,
            "cached": stats.kv_blocks_cached,
        },
        "prefix_cache": {
            "hit_tokens": stats.prefix_hit_tokens,
            "query_tokens": stats.prefix_query_tokens,
            "hit_rate": round(stats.prefix_hit_rate, 4),
        },
        "async_batching": stats.async_batching,
        "device_idle_fraction": round(stats.device_idle_fraction, 4),
    }
    return body


def _span(s: Span) -> dict[str, Any]:
    return {
        "name": s.name,
        "lane": _LANES.get(s.lane, "host"),
        "start": round(s.start, 6),
        "end": round(s.end, 6),
        "step": s.step,
        "seqs": s.num_seqs,
        "tokens": s.num_tokens,
        "sampled": s.num_sampled,
        "steps": s.num_steps,
    }
