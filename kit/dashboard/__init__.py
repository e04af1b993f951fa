"""The coordinator's web dashboard: the page and its JSON API (torch-free).

    routes.py    register_dashboard(peer, collector, title=..., run_info=...): GET /, /api/metrics,
                 /api/leaderboard on the coordinator peer's port
    page.html    the page: plain HTML, inline CSS and vanilla JS (no CDN), polls the JSON API

The numbers come from ``kit.metrics``; ``/api/run`` is registered by the coordinator.
"""

from kit.dashboard.routes import load_page, register_dashboard

__all__ = ["load_page", "register_dashboard"]
