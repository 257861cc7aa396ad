"""Read the built site as a reader would: headless Chromium, offline, at 1280 and 1920 px wide.

    python tools/check_site.py [--site site] [--widths 1280 1920] [--screenshots build/screenshots]
    python tools/check_site.py --self-test      # a broken page must trip every check

The site is served on 127.0.0.1; every request to any other host is failed by the browser and
reported. Starting from the home page, every page it links to (and they link to) is loaded at each
width and must pass:

- the page answers HTTP 200, and so does every file it loads; every image has loaded;
- no console error and no uncaught exception;
- no request leaves the machine;
- every tab of every tab set shows its own block when clicked (a real mouse click);
- math is rendered: no raw ``\\(``, ``\\[`` or ``$$`` in the visible text, a <math> in every formula;
- no code line is broken: a code block shows as many lines as its text has (a long line scrolls
  inside its box), and no block is cut (content wider than a box that does not scroll);
- no table is wider than the text column, and none squeezes a column: a cell with a sentence in it
  is at least 120 px wide;
- no figure is shown below 60% of its pixel width unless it is a link to the full-size file;
- every figure keeps the promise its file carries: walkthrough/chapter.py's ``save_figure``
  writes into each PNG the narrowest width at which its smallest text is still 10 px high
  (``MIN_WIDTH_KEY``), and the figure must be shown at least that wide (a PNG without the
  record fails: its text size is unknown).

A display formula wider than the text column scrolls inside its own box; it is printed as a note,
not a failure.

Chromium is driven through the DevTools protocol over a pipe (--remote-debugging-pipe: JSON
messages separated by NUL bytes on file descriptors 3 and 4), so nothing but the browser and the
standard library is needed. Screenshots of the home page and three chapters are written to
--screenshots (git-ignored). Exit status 0 when every page passes at every width.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import functools
import http.server
import json
import os
import queue
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from urllib.parse import unquote, urldefrag, urlsplit

LOCAL_HOSTS = {"127.0.0.1"}
LOCAL_SCHEMES = {"data", "blob", "about", "chrome", "devtools"}
SHRUNK_FIGURE = 0.6  # a figure shown below this fraction of its pixel width needs a full-size link
SQUEEZED_CELL_PX = 120  # a table cell holding a sentence is at least this wide
SENTENCE_CHARS = 40  # ... where a sentence is this many characters or more
COMMAND_TIMEOUT_S = 30
PAGE_TIMEOUT_S = 20
SCREENSHOT_PAGES = ("", "03_mla/", "11_ddtree_loop/", "12_generation/")  # home page and three chapters
SCREENSHOT_MAX_HEIGHT = 2400
MIN_WIDTH_KEY = "min-display-width"  # a PNG text chunk written by walkthrough/chapter.py's save_figure


class BrowserError(RuntimeError):
    pass


# ---------------------------------------------------------------------------------------------
# the browser: Chromium over the DevTools pipe
# ---------------------------------------------------------------------------------------------


class Chromium:
    """One headless Chromium, one page; commands block until answered, events queue up.

    Requests the page makes are paused by the Fetch domain and answered on the reader thread:
    127.0.0.1 goes on, anything else fails and is recorded in ``self.escaped``.
    """

    def __init__(self, binary: str):
        self.profile = tempfile.mkdtemp(prefix="check_site_chromium_")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def child_fds() -> None:  # the browser reads commands on fd 3 and answers on fd 4
            read_end = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10)
            write_end = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        args = [
            binary,
            "--headless=new",
            "--remote-debugging-pipe",
            "--no-sandbox",  # CI runs as root
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--disable-default-apps",
            "--mute-audio",
            "--hide-scrollbars",
            # belt and braces for the browser's own traffic: no name resolves but the loopback address
            "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
            f"--user-data-dir={self.profile}",
            "about:blank",
        ]
        self.process = subprocess.Popen(
            args,
            pass_fds=(3, 4),
            preexec_fn=child_fds,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._write_lock = threading.Lock()
        self._next_id = 0
        self._waiting: dict[int, queue.Queue] = {}
        self.events: queue.Queue = queue.Queue()
        self.escaped: list[str] = []
        self.session: str | None = None
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    # -- protocol plumbing ---------------------------------------------------------------------

    def _post(self, method: str, params: dict | None, session: str | None) -> queue.Queue:
        with self._write_lock:
            self._next_id += 1
            message = {"id": self._next_id, "method": method, "params": params or {}}
            if session:
                message["sessionId"] = session
            answer: queue.Queue = queue.Queue(maxsize=1)
            self._waiting[self._next_id] = answer
            os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        return answer

    def call(self, method: str, params: dict | None = None, browser_level: bool = False) -> dict:
        answer = self._post(method, params, None if browser_level else self.session)
        try:
            message = answer.get(timeout=COMMAND_TIMEOUT_S)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer from Chromium in {COMMAND_TIMEOUT_S} s") from None
        if "error" in message:
            raise BrowserError(f"{method}: {message['error'].get('message')}")
        return message.get("result", {})

    def _read_loop(self) -> None:
        buffer = b""
        while True:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                self.events.put({"method": "Browser.closed"})
                return
            buffer += chunk
            *messages, buffer = buffer.split(b"\0")
            for raw in messages:
                self._dispatch(json.loads(raw))

    def _dispatch(self, message: dict) -> None:
        if "id" in message:
            answer = self._waiting.pop(message["id"], None)
            if answer is not None:
                answer.put(message)
        elif message.get("method") == "Fetch.requestPaused":
            self._answer_request(message)
        else:
            self.events.put(message)

    def _answer_request(self, message: dict) -> None:
        params = message["params"]
        url = params["request"]["url"]
        parts = urlsplit(url)
        if parts.scheme in LOCAL_SCHEMES or parts.hostname in LOCAL_HOSTS:
            self._post("Fetch.continueRequest", {"requestId": params["requestId"]}, message.get("sessionId"))
        else:
            self.escaped.append(url)
            self._post(
                "Fetch.failRequest",
                {"requestId": params["requestId"], "errorReason": "BlockedByClient"},
                message.get("sessionId"),
            )

    # -- a page --------------------------------------------------------------------------------

    def open_page(self) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, browser_level=True)
        attached = self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, browser_level=True
        )
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable")
        self.call("Fetch.enable", {"patterns": [{"urlPattern": "*", "requestStage": "Request"}]})

    def set_width(self, width: int, height: int = 900) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    def drain_events(self) -> list[dict]:
        drained = []
        while True:
            try:
                drained.append(self.events.get_nowait())
            except queue.Empty:
                return drained

    def navigate(self, url: str) -> list[dict]:
        """Load url; returns the protocol events seen until the page and its images have loaded."""
        self.drain_events()
        self.call("Page.navigate", {"url": url})
        seen = []
        deadline = time.monotonic() + PAGE_TIMEOUT_S
        while True:
            try:
                event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise BrowserError(f"{url}: no load event in {PAGE_TIMEOUT_S} s") from None
            seen.append(event)
            if event.get("method") == "Page.loadEventFired":
                break
            if event.get("method") == "Browser.closed":
                raise BrowserError("Chromium exited")
        self.evaluate(SETTLE_JS)  # fonts, lazy images, one animation frame
        time.sleep(0.2)  # late console messages and requests
        return seen + self.drain_events()

    def evaluate(self, expression: str):
        result = self.call(
            "Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True}
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            description = details.get("exception", {}).get("description", details)
            raise BrowserError(f"page script failed: {description}")
        return result["result"].get("value")

    def click(self, x: float, y: float) -> None:
        for kind in ("mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent", {"type": kind, "x": x, "y": y, "button": "left", "clickCount": 1}
            )

    def screenshot(self, path: Path) -> None:
        height = min(self.evaluate("document.documentElement.scrollHeight"), SCREENSHOT_MAX_HEIGHT)
        width = self.evaluate("document.documentElement.clientWidth")
        shot = self.call(
            "Page.captureScreenshot",
            {
                "format": "png",
                "captureBeyondViewport": True,
                "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
            },
        )
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        try:
            self._post("Browser.close", None, None)
            self.process.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# what is checked inside the page
# ---------------------------------------------------------------------------------------------

SETTLE_JS = """
(async () => {
  for (const img of document.images) img.loading = "eager";
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  await document.fonts.ready;
  await Promise.all([...document.images].map(img => img.complete ? null :
    new Promise(done => { img.onload = img.onerror = done; setTimeout(done, 5000); })));
  await new Promise(done => requestAnimationFrame(() => requestAnimationFrame(done)));
})()
"""

# Every check that reads the laid-out page; returns a list of problems (strings).
INSPECT_JS = """
(() => {
  const problems = [];
  const content = document.querySelector("article") || document.body;
  const shown = el => el.getClientRects().length > 0;
  const where = el => (el.textContent || "").trim().replace(/\\s+/g, " ").slice(0, 60);
  document.querySelectorAll("details").forEach(d => { d.open = true; });

  for (const img of document.images) {
    if (!img.complete || img.naturalWidth === 0) problems.push(`image not loaded: ${img.src}`);
  }
  for (const img of content.querySelectorAll("img")) {
    if (!shown(img) || img.naturalWidth === 0) continue;
    const ratio = img.getBoundingClientRect().width / img.naturalWidth;
    if (ratio >= SHRUNK) continue;
    const link = img.closest("a[href]");
    const full = link && new URL(link.href).pathname === new URL(img.currentSrc || img.src).pathname;
    if (!full) problems.push(`figure shown at ${Math.round(100 * ratio)}% of its ${img.naturalWidth} px ` +
                             `without a link to full size: ${img.getAttribute("src")}`);
  }
  problems.push(...codeProblems(content));

  const clone = content.cloneNode(true);
  clone.querySelectorAll("pre, code, script, style, math, mjx-container").forEach(el => el.remove());
  const raw = (clone.textContent.match(/.{0,30}(\\\\\\(|\\\\\\[|\\$\\$).{0,30}/g) || []);
  for (const hit of raw) problems.push(`raw TeX in the text: ${hit.trim()}`);
  for (const formula of content.querySelectorAll(".arithmatex")) {
    const math = formula.querySelector("mjx-container, math");
    if (!math) problems.push(`formula not rendered: ${where(formula)}`);
    else if (shown(formula) && math.getBoundingClientRect().width === 0)
      problems.push(`formula rendered with no width: ${where(formula)}`);
    else if (formula.querySelector("mjx-merror, merror"))
      problems.push(`formula has a TeX error: ${where(formula)}`);
    else if (shown(formula) && formula.tagName === "DIV") {
      const drawn = Math.round((formula.querySelector("mjx-math") || math).getBoundingClientRect().width);
      const tex = where(formula.querySelector("mjx-assistive-mml") || formula);
      if (drawn > formula.clientWidth + 1)
        problems.push(`NOTE display formula wider than the column (it scrolls): ${drawn} px ` +
                      `in ${formula.clientWidth} px: ${tex}`);
    }
  }

  for (const table of content.querySelectorAll("table")) {
    if (!shown(table)) continue;
    const width = Math.round(table.getBoundingClientRect().width);
    if (width > content.clientWidth + 1)
      problems.push(`table wider than the text column (${width} px in ${content.clientWidth} px): ` +
                    where(table.rows[0] || table));
  }
  for (const cell of content.querySelectorAll("td, th")) {
    if (!shown(cell)) continue;
    const text = cell.textContent.trim();
    const width = Math.round(cell.getBoundingClientRect().width);
    if (text.length >= SENTENCE && width < SQUEEZED)
      problems.push(`table column squeezed to ${width} px: ${where(cell)}`);
  }
  return problems;
})()
"""
INSPECT_JS = (
    INSPECT_JS.replace("SHRUNK", str(SHRUNK_FIGURE))
    .replace("SENTENCE", str(SENTENCE_CHARS))
    .replace("SQUEEZED", str(SQUEEZED_CELL_PX))
)

# codeProblems(root): code blocks under root that break a line or cut it (shared by the tab check).
# A block breaks a line when it is taller than a copy of itself laid out with white-space: pre (each
# line of its text on one line of the screen); it is cut when its content is wider than a box that
# does not scroll.
CODE_JS = """
window.codeProblems = root => {
  const problems = [];
  const longest = text => text.split("\\n").reduce((a, b) => (b.length > a.length ? b : a), "").trim();
  for (const block of root.querySelectorAll("pre > code, pre")) {
    if (block.getClientRects().length === 0) continue;
    if (block.scrollWidth > block.clientWidth + 1 &&
        !["auto", "scroll"].includes(getComputedStyle(block).overflowX))
      problems.push(`code block cut (${block.scrollWidth} px of content in ${block.clientWidth} px): ` +
                    longest(block.textContent).slice(0, 60));
  }
  for (const pre of root.querySelectorAll("pre")) {
    if (pre.getClientRects().length === 0) continue;
    const unbroken = pre.cloneNode(true);
    for (const element of [unbroken, ...unbroken.querySelectorAll("*")]) element.style.whiteSpace = "pre";
    Object.assign(unbroken.style, {position: "absolute", visibility: "hidden", width: "max-content",
                                   left: "0", top: "0"});
    pre.after(unbroken);
    const height = pre.getBoundingClientRect().height;
    const natural = unbroken.getBoundingClientRect().height;
    unbroken.remove();
    if (height > natural + 1) {
      const lines = pre.textContent.replace(/\\n$/, "").split("\\n").length;
      problems.push(`code line broken (${lines} lines of text take the height of about ` +
                    `${Math.round(lines * height / natural)}): ${longest(pre.textContent).slice(0, 60)}`);
    }
  }
  return [...new Set(problems)];
};
"""


# The tab labels of every tab set: [set index, tab index, label text].
TAB_LABELS_JS = """
[...document.querySelectorAll(".tabbed-set")].flatMap((set, s) =>
  [...set.querySelectorAll(":scope > .tabbed-labels > label")]
    .map((label, t) => [s, t, label.textContent.trim()]))
"""

# Bring one label into view and return the middle of its box, for a real mouse click.
TAB_POSITION_JS = """
(() => {
  const label = document.querySelectorAll(".tabbed-set")[%d]
    .querySelectorAll(":scope > .tabbed-labels > label")[%d];
  label.scrollIntoView({block: "center", inline: "center"});
  const box = label.getBoundingClientRect();
  return [box.left + box.width / 2, box.top + box.height / 2];
})()
"""

# After the click: is this tab the one shown, alone, and is its code uncut?
TAB_SHOWN_JS = """
(() => {
  const set = document.querySelectorAll(".tabbed-set")[%d];
  const blocks = [...set.querySelectorAll(":scope > .tabbed-content > .tabbed-block")];
  const visible = blocks.map(b => b.getClientRects().length > 0);
  const problems = [];
  if (!visible[%d] || visible.filter(Boolean).length !== 1)
    problems.push(`shows blocks ${visible.map((v, i) => v ? i : null).filter(v => v !== null)}`);
  problems.push(...codeProblems(blocks[%d]));
  return problems;
})()
"""


def check_tabs(browser: Chromium, site: Path) -> list[str]:
    problems = []
    for set_index, tab_index, label in browser.evaluate(TAB_LABELS_JS):
        x, y = browser.evaluate(TAB_POSITION_JS % (set_index, tab_index))
        browser.click(x, y)
        for problem in browser.evaluate(TAB_SHOWN_JS % (set_index, tab_index, tab_index)):
            problems.append(f"tab set {set_index + 1}, tab '{label}': {problem}")
        problems += figure_text_problems(browser, site)  # a figure in a tab is shown only now
    return problems


# The figures shown now: [path of the file on the site, displayed width in px].
SHOWN_FIGURES_JS = """
[...(document.querySelector("article") || document.body).querySelectorAll("img")]
  .filter(img => img.getClientRects().length > 0 && img.naturalWidth > 0)
  .map(img => [new URL(img.currentSrc || img.src).pathname, img.getBoundingClientRect().width])
"""


def png_text(path: Path) -> dict[str, str]:
    """The tEXt chunks of a PNG file (keyword -> text); empty for anything that is not a PNG."""
    data = path.read_bytes()
    if not data.startswith(b"\x89PNG\r\n\x1a\n"):
        return {}
    texts, offset = {}, 8
    while offset + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if kind == b"tEXt":
            keyword, _, text = data[offset + 8 : offset + 8 + length].partition(b"\0")
            texts[keyword.decode("latin-1")] = text.decode("latin-1")
        offset += 12 + length
    return texts


def figure_text_problems(browser: Chromium, site: Path) -> list[str]:
    """Every figure shown now is at least as wide as its file says its smallest text needs."""
    problems = []
    for pathname, width in browser.evaluate(SHOWN_FIGURES_JS):
        path = site / unquote(pathname).lstrip("/")
        if not path.is_file() or path.suffix != ".png":
            continue  # not loaded: reported as such; not a PNG: no figure of a chapter
        needed = png_text(path).get(MIN_WIDTH_KEY)
        if needed is None:
            problems.append(f"figure has no text-size record ({MIN_WIDTH_KEY}; save it with "
                            f"walkthrough/chapter.py's save_figure): {pathname}")
        elif width < float(needed) - 0.5:
            problems.append(f"figure text below 10 px: shown {width:.0f} px wide, its text needs "
                            f"{needed} px: {pathname}")
    return problems


def event_problems(events: list[dict], url: str, document: bool = True) -> list[str]:
    """HTTP status of the page (when ``document``: events from its load) and of its files, console
    errors and uncaught exceptions."""
    problems = []
    document_status = None
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Network.responseReceived":
            response = params["response"]
            if params.get("type") == "Document" and urldefrag(response["url"])[0] == url:
                document_status = response["status"]
            elif response["status"] >= 400:
                problems.append(f"HTTP {response['status']} for {response['url']}")
        elif method == "Runtime.consoleAPICalled" and params["type"] in ("error", "assert"):
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params["args"])
            problems.append(f"console error: {text[:200]}")
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            problems.append(f"uncaught exception: {str(text)[:200]}")
        elif method == "Log.entryAdded" and params["entry"]["level"] == "error":
            problems.append(f"console error: {params['entry']['text'][:200]}")
    if document and document_status is None:
        problems.insert(0, "page did not load (no HTTP response)")
    elif document and document_status != 200:
        problems.insert(0, f"page answered HTTP {document_status}")
    return problems


LINKS_JS = """
[...document.querySelectorAll("a[href]")].map(a => a.href)
"""


def page_links(browser: Chromium, base: str) -> list[str]:
    """Pages of this site that the loaded page links to (no fragments, no figure or text files)."""
    pages = []
    for href in browser.evaluate(LINKS_JS):
        url = urldefrag(href)[0]
        if url.startswith(base) and (url.endswith("/") or url.endswith(".html")):
            pages.append(url)
    return pages


# ---------------------------------------------------------------------------------------------
# serving the site, walking it
# ---------------------------------------------------------------------------------------------


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # the base class names it format
        pass


def serve(directory: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(directory))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


def check_page(browser: Chromium, url: str, site: Path, screenshot: Path | None = None) -> list[str]:
    escaped_before = len(browser.escaped)
    events = browser.navigate(url)
    if screenshot:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        browser.screenshot(screenshot)
    browser.evaluate(CODE_JS)
    problems = event_problems(events, url)
    problems += browser.evaluate(INSPECT_JS)
    problems += figure_text_problems(browser, site)
    problems += check_tabs(browser, site)
    time.sleep(0.1)
    problems += event_problems(browser.drain_events(), url, document=False)  # late messages
    problems += [f"request left the machine: {u}" for u in browser.escaped[escaped_before:]]
    return problems


def walk_site(site: Path, widths: list[int], screenshots: Path | None, binary: str) -> int:
    if not (site / "index.html").is_file():
        sys.exit(f"check_site: {site}/index.html not found: build the site first (mkdocs build)")
    browser = Chromium(binary)  # before the server thread: the browser is forked from one thread
    server, base = serve(site)
    failed = passed = 0
    try:
        browser.open_page()
        pages, queue_ = [base], [base]
        browser.set_width(widths[0])
        while queue_:  # every page reached from the home page
            browser.navigate(queue_.pop(0))
            for link in page_links(browser, base):
                if link not in pages:
                    pages.append(link)
                    queue_.append(link)
        print(f"{len(pages)} pages reached from the home page, checked at {widths} px")
        for width in widths:
            browser.set_width(width)
            for url in pages:
                page = url[len(base) :]
                name = page or "(home)"
                shot = None
                if screenshots and page in SCREENSHOT_PAGES:
                    shot = screenshots / f"{page.strip('/') or 'home'}_{width}.png"
                problems = check_page(browser, url, site, shot)
                notes = [p[len("NOTE ") :] for p in problems if p.startswith("NOTE ")]
                problems = [p for p in problems if not p.startswith("NOTE ")]
                failed += bool(problems)
                passed += not problems
                print(f"{'FAIL' if problems else 'ok  '} {width} px {name}")
                for problem in dict.fromkeys(problems):
                    print(f"     {problem}")
                for note in dict.fromkeys(notes):
                    print(f"     note: {note}")
    finally:
        browser.close()
        server.shutdown()
    if screenshots:
        print(f"screenshots in {screenshots}/")
    print(f"site: {passed} passed, {failed} failed")
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# self-test: a page with one of each defect must trip each check
# ---------------------------------------------------------------------------------------------

BROKEN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>broken</title></head><body>
<article style="width: 700px">
<p>Raw math: <span class="arithmatex">\\(x^2\\)</span></p>
<pre><code>%(long_line)s</code></pre>
<pre><code style="white-space: pre-wrap">short = 1\n%(long_line)s</code></pre>
<img src="wide.png" style="width: 200px">
<a href="small_text.png"><img src="small_text.png" style="width: 300px"></a>
<img src="missing.png">
<img src="http://example.invalid/remote.png">
<table><tr><td>a</td><td style="width: 10px">%(sentence)s</td></tr></table>
<table><tr><td style="white-space: nowrap">%(sentence)s %(sentence)s %(sentence)s</td></tr></table>
<div class="tabbed-set"><div class="tabbed-labels"><label>one</label><label>two</label></div>
<div class="tabbed-content"><div class="tabbed-block">first</div>
<div class="tabbed-block">second</div></div></div>
<a href="other.html">a page that does not exist</a>
</article>
<script>console.error("deliberate console error")</script>
</body></html>
"""

EXPECTED_IN_SELF_TEST = (
    "raw TeX in the text",
    "formula not rendered",
    "code block cut",
    "code line broken",
    "figure shown at",
    "figure has no text-size record",
    "figure text below 10 px",
    "image not loaded",
    "HTTP 404",
    "request left the machine",
    "table column squeezed",
    "table wider than the text column",
    "tab set 1, tab 'two'",
    "console error: deliberate",
    "page answered HTTP 404",
)


def write_png(path: Path, width: int, height: int, texts: dict[str, str] | None = None) -> None:
    """A plain grey PNG (zlib, no imaging library), with ``texts`` as tEXt chunks."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\0" + b"\x80" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    chunks = chunk(b"IHDR", header)
    for keyword, text in (texts or {}).items():
        chunks += chunk(b"tEXt", keyword.encode("latin-1") + b"\0" + text.encode("latin-1"))
    chunks += chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunks)


def self_test(binary: str) -> int:
    with tempfile.TemporaryDirectory(prefix="check_site_selftest_") as tmp:
        site = Path(tmp)
        defects = {"long_line": "x = " + "1 + " * 200 + "1", "sentence": "a sentence far too long " * 3}
        (site / "index.html").write_text(BROKEN_PAGE % defects)
        write_png(site / "wide.png", 1000, 20)  # no text-size record, shown at 20%
        write_png(site / "small_text.png", 800, 20, {MIN_WIDTH_KEY: "600"})  # shown 300 px wide
        browser = Chromium(binary)
        server, base = serve(site)
        try:
            browser.open_page()
            browser.set_width(1280)
            found = check_page(browser, base, site)
            found += check_page(browser, base + "other.html", site)
        finally:
            browser.close()
            server.shutdown()
    missed = [kind for kind in EXPECTED_IN_SELF_TEST if not any(kind in problem for problem in found)]
    for problem in found:
        print(f"     caught: {problem}")
    if missed:
        print(f"self-test FAILED: these checks did not fire on the broken page: {missed}")
        return 1
    print(f"self-test: all {len(EXPECTED_IN_SELF_TEST)} kinds of defect caught")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", type=Path, default=Path("site"), help="the built site (mkdocs build)")
    parser.add_argument("--widths", type=int, nargs="+", default=[1280, 1920], help="window widths in px")
    parser.add_argument(
        "--screenshots",
        type=lambda folder: Path(folder) if folder else None,
        default=Path("build/screenshots"),
        help="folder for screenshots of the home page and three chapters ('' for none)",
    )
    parser.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    parser.add_argument("--self-test", action="store_true", help="check that a broken page fails")
    args = parser.parse_args()
    if not shutil.which(args.chromium):
        sys.exit(f"check_site: no Chromium at --chromium {args.chromium} (apt-get install -y chromium)")
    if args.self_test:
        return self_test(args.chromium)
    return walk_site(args.site, args.widths, args.screenshots, args.chromium)


if __name__ == "__main__":
    sys.exit(main())
