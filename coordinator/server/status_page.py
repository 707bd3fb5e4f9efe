"""The coordinator's live status page, served at ``GET /``.

One self-contained HTML document made of ``static/status.html``, ``status.css`` and
``status.js`` (package data), the stylesheet and the script inlined where the HTML links them:
nothing is fetched from anywhere but the coordinator itself (the :data:`CSP` header forbids it),
so it works on a network with no way out. The script polls ``GET /api/status`` — the same
snapshot ``somatize status`` shows, see :meth:`coordinator.server.app.Coordinator.status` —
every second and redraws the workers and jobs tables; a job's row opens its view (``#job=ID``
in the address, :mod:`~coordinator.server.status_api`: its events, error, loss curve and cancel
button). Every value from a worker or a job (ids, tags, error messages) goes into the page as
text (``textContent``), never as markup. Long values wrap: nothing scrolls sideways on a screen
1,400 pixels wide.

A browser that was asked for a password by the page's ``401`` (HTTP Basic, the client token as
password) sends the same credentials with its ``fetch`` calls: same origin, same realm.
"""

from __future__ import annotations

from importlib import resources

CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
"""The page's Content-Security-Policy: its own inline style and script, requests to its origin."""

STYLESHEET_LINK = '<link rel="stylesheet" href="status.css">'
"""Where ``status.html`` links its stylesheet: replaced by the stylesheet itself."""
SCRIPT_LINK = '<script src="status.js"></script>'
"""Where ``status.html`` loads its script: replaced by the script itself."""
SUFFIXES = ("html", "css", "js")
"""The page's files in ``static/``: ``status.html``, ``status.css``, ``status.js``."""


def _page() -> str:
    """``static/status.html`` with its stylesheet and script inlined (see the module docstring).

    Raises:
        ValueError: the HTML does not link each of them exactly once.
    """
    static = resources.files("coordinator.server").joinpath("static")
    html, css, js = (static.joinpath(f"status.{ext}").read_text("utf-8") for ext in SUFFIXES)
    for link in (STYLESHEET_LINK, SCRIPT_LINK):
        if html.count(link) != 1:
            raise ValueError(f"static/status.html must hold {link} exactly once")
    html = html.replace(STYLESHEET_LINK, f"<style>\n{css}</style>")
    return html.replace(SCRIPT_LINK, f"<script>\n{js}</script>")


PAGE = _page()
"""The status page, as ``GET /`` serves it."""

__all__ = ["CSP", "PAGE"]
