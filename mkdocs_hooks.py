"""MkDocs hooks for the documentation site (mkdocs.yml, ``hooks:``).

docs/SETTINGS.md is generated from the settings in code and is not edited by hand. Its introduction still
links the README's section "Secured Kafka clusters", which now lives in docs/CONNECTING.md; a link out of
docs/ is a dead link on the site (and a warning, so an error, under ``mkdocs build --strict``). Until the
generated text links the page itself, the link is pointed at that page while the site is built; the file is
left as it is. Delete this hook once docs/SETTINGS.md no longer holds ``../README.md#``.
"""

from __future__ import annotations

from typing import Any

# README sections that moved into docs/, as links from docs/ pages: the README link -> the page that holds it.
MOVED = {
    "../README.md#secured-kafka-clusters": "CONNECTING.md#secured-kafka-clusters",
}


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if page.file.src_uri != "SETTINGS.md":
        return markdown
    for old, new in MOVED.items():
        markdown = markdown.replace(f"]({old})", f"]({new})")
    return markdown
