"""A page as a browser shows it: headless Chromium (Debian's ``chromium``) loads an HTML file and gives back its DOM
after loading, each <img> marked with the width its picture decoded to (0: a picture the browser could not show).

The test skips when Chromium is absent, unless ``RR_REQUIRE_CHROMIUM`` is set (``.ci/run`` installs Chromium and
sets it): in CI a missing browser fails the check instead of skipping it."""
from __future__ import annotations

import os
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

REQUIRE_ENV = "RR_REQUIRE_CHROMIUM"
#: Injected into a copy of the page, never into the page itself (which has no script): after the load event
#: every picture has decoded or failed, and its naturalWidth says which.
MARK_IMAGES = ('<script>window.addEventListener("load",()=>{for(const i of document.images)'
               'i.setAttribute("data-natural-width",String(i.naturalWidth))})</script>')


def chromium() -> str:
    """The Chromium binary, or skip (fail under RR_REQUIRE_CHROMIUM) with the reason."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        reason = "headless Chromium is not installed (apt-get install chromium; .ci/run installs it)"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{reason}, and {REQUIRE_ENV} is set")
        pytest.skip(reason)
    return found


def rendered_dom(page: str, workdir: str) -> str:
    """The DOM of ``page`` once Chromium has loaded it (images marked with data-natural-width)."""
    binary = chromium()
    with open(page, encoding="utf-8") as f:
        text = f.read()
    assert text.count("</body>") == 1, "a page without one </body>"
    marked = os.path.join(workdir, "marked-" + os.path.basename(page))
    with open(marked, "w", encoding="utf-8") as f:
        f.write(text.replace("</body>", MARK_IMAGES + "</body>"))
    # --virtual-time-budget: the DOM is dumped once the page is idle (its load event run), not at first paint
    res = subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000",
                          f"--user-data-dir={os.path.join(workdir, 'chromium-profile')}", "--dump-dom",
                          "file://" + os.path.abspath(marked)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "<body" in res.stdout, res.stderr[-2000:]
    return res.stdout


class Dom(HTMLParser):
    """What a user sees of a rendered page: its visible text, and per <img> its class, alt and decoded width."""

    def __init__(self, dom: str):
        super().__init__()
        self.images: list[dict] = []
        self.text_parts: list[str] = []
        self._skip = 0
        self.feed(dom)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ("style", "script", "title"):
            self._skip += 1
        if tag == "img":
            self.images.append({"class": a.get("class"), "alt": a.get("alt"),
                                "width": int(a.get("data-natural-width", -1))})

    def handle_endtag(self, tag):
        if tag in ("style", "script", "title"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text_parts.append(data)

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.text_parts).split())
