"""The chat page as Chainlit serves it, less what it would ask of other sites.

Chainlit's page links KaTeX's stylesheet from a CDN and opens connections to Google's font servers: offline,
each load writes net::ERR_NAME_NOT_RESOLVED in the browser's console, and online it tells those sites who
opens the chat. The page needs neither: public/style.css shows formulas as MathML, which the browser draws
itself, and public/theme.json names no fonts. `install()` leaves those links out of the page's HTML.
(chainlit_en-US.md, a link to chainlit.md, is the readme Chainlit looks for in an English browser.)
"""

from __future__ import annotations

import re

import chainlit.server

OTHER_SITES = ("cdn.jsdelivr.net", "fonts.googleapis.com", "fonts.gstatic.com")
LINK_TO_OTHER_SITE = re.compile(r'\s*<link\b[^>]*\bhref="https://(?:' + "|".join(map(re.escape, OTHER_SITES))
                                + r')[/"][^>]*>')


def without_other_sites(html: str) -> str:
    """The page's HTML without its <link> elements to OTHER_SITES."""
    return LINK_TO_OTHER_SITE.sub("", html)


def install() -> None:
    """Serve Chainlit's page without its links to other sites (its catch-all route writes the page with
    chainlit.server.get_html_template, looked up at each request)."""
    template = chainlit.server.get_html_template
    if getattr(template, "without_other_sites", False):  # installed already (a reload by `chainlit run -w`)
        return

    def page_html(root_path):
        return without_other_sites(template(root_path))

    page_html.without_other_sites = True
    chainlit.server.get_html_template = page_html
