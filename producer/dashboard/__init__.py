"""``mlxq dashboard``: the operator's pages (queues, workers, plots of the last hour, jobs and their
actions, batches, keys), served on its own or under the gateway at /dashboard. Server-rendered
(Starlette and Jinja2 templates) with a little plain JavaScript and uPlot, both shipped in the
package: the pages work offline. See docs/operations/dashboard.md."""

from ...shared.extras import DASHBOARD, require

require(__name__, "gateway", DASHBOARD)  # Starlette, uvicorn, Jinja2: the gateway's extra

from .app import Dashboard, create_dashboard

__all__ = ["Dashboard", "create_dashboard"]
