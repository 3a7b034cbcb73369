"""Open a report page in headless Chromium (the system's, driven by Playwright): console errors,
time to render, expanding sections, screenshots. Used by the browser test and to measure pages:

    python -m verify.commands.html.browser out/index.html --screenshot out/page.png

Needs the Debian package ``chromium`` (``/usr/bin/chromium``, or ``$AP_CHROMIUM``) and the
Python package ``playwright`` (``pip install -e '.[browser]'``). Playwright's own browser
download is never used: it cannot be fetched on machines without general network access.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PageCheck", "chromium_path", "open_page", "unavailable_reason"]

LAUNCH_ARGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)


def chromium_path() -> str | None:
    env = os.environ.get("AP_CHROMIUM")
    if env:
        return env if os.path.exists(env) else None
    for name in ("/usr/bin/chromium", "/usr/bin/chromium-browser"):
        if os.path.exists(name):
            return name
    return shutil.which("chromium")


def unavailable_reason() -> str | None:
    """Why a page cannot be opened here (None when it can)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed (pip install -e '.[browser]')"
    if chromium_path() is None:
        env = os.environ.get("AP_CHROMIUM")
        if env:
            return f"AP_CHROMIUM={env} does not exist"
        return "no Chromium: install the Debian package (apt-get install -y chromium) or set AP_CHROMIUM"
    return None


@dataclass
class PageCheck:
    """What opening a page showed. ``render_ms``: from navigation start until two animation
    frames after the load event (the page parsed, laid out and painted), as the page's own
    clock measures it; ``wall_ms``: the same from Python, including the browser's IPC."""

    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    render_ms: float = 0.0
    wall_ms: float = 0.0
    expanded: dict[str, int] = field(default_factory=dict)  # details kind -> opened and filled
    screenshots: list[Path] = field(default_factory=list)
    probed: object = None  # what ``probe`` evaluated to once the page was painted

    @property
    def errors(self) -> list[str]:
        return self.console_errors + self.page_errors


_FRAMES = "() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(() => r(performance.now()))))"


def open_page(
    path: str | Path,
    *,
    screenshot: str | Path | None = None,
    expand: tuple[str, ...] = (),
    element_shots: dict[str, str | Path] | None = None,
    probe: str | None = None,
    width: int = 1200,
    timeout_ms: int = 60_000,
) -> PageCheck:
    """Load ``path``, wait until painted, evaluate the JavaScript expression ``probe`` (its
    value in ``PageCheck.probed``), open the first ``<details>`` of each class in ``expand``
    (e.g. ``"graph"``, ``"diff-prev"``) and check its lazy content appeared, then take a
    full-page screenshot and one per CSS selector in ``element_shots``."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot open {path} in a browser: {reason}")
    from playwright.sync_api import sync_playwright

    url = Path(path).resolve().as_uri()
    check = PageCheck()
    profile = tempfile.mkdtemp(prefix="ap-chromium-")
    try:
        with sync_playwright() as p:
            ctx = p.chromium.launch_persistent_context(
                profile,
                executable_path=chromium_path(),
                headless=True,
                args=list(LAUNCH_ARGS),
                viewport={"width": width, "height": 900},
            )
            try:
                page = ctx.new_page()
                page.set_default_timeout(timeout_ms)
                page.on("console", lambda m: check.console_errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda e: check.page_errors.append(str(e)))
                t0 = time.perf_counter()
                page.goto(url, wait_until="load")
                check.render_ms = float(page.evaluate(_FRAMES))
                check.wall_ms = (time.perf_counter() - t0) * 1e3
                if probe is not None:
                    check.probed = page.evaluate(f"() => ({probe})")
                for kind in expand:
                    check.expanded[kind] = _expand_first(page, kind)
                if screenshot is not None:
                    page.screenshot(path=str(screenshot), full_page=True)
                    check.screenshots.append(Path(screenshot))
                for selector, out in (element_shots or {}).items():
                    loc = page.locator(selector).first
                    loc.scroll_into_view_if_needed()
                    loc.screenshot(path=str(out))
                    check.screenshots.append(Path(out))
            finally:
                ctx.close()
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    return check


def _expand_first(page, kind: str) -> int:
    """Open the first ``details.<kind>``; the number of lines/rows its lazy content shows."""
    sel = f"details.{kind}"
    if page.locator(sel).count() == 0:
        return -1
    page.locator(f"{sel} > summary").first.click()
    page.wait_for_function(f"() => document.querySelector('{sel}').dataset.filled === '1'")
    return int(page.evaluate(
        f"""() => {{ const d = document.querySelector('{sel}');
            const pre = d.querySelector('pre');
            if (pre) return pre.textContent.split('\\n').length;
            return d.querySelectorAll('table.diff tr').length; }}"""
    ))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m verify.commands.html.browser", description=__doc__.split("\n\n")[0])
    ap.add_argument("page")
    ap.add_argument("--screenshot", default=None)
    ap.add_argument("--repeat", type=int, default=1, help="loads (fresh browser each); prints each")
    args = ap.parse_args(argv)
    reason = unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}")
        return 2
    size = Path(args.page).stat().st_size
    for k in range(args.repeat):
        c = open_page(args.page, screenshot=args.screenshot if k == 0 else None, expand=("graph",))
        print(f"{args.page} ({size / 2**20:.1f} MiB): rendered in {c.render_ms:.0f} ms "
              f"(wall {c.wall_ms:.0f} ms); console errors {len(c.errors)}; first graph opened "
              f"with {c.expanded.get('graph')} lines")
        for e in c.errors:
            print("  error:", e)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
