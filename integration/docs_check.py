"""Screenshots of the documentation site in a real browser: ``tox -e docs-check``.

Builds the site, serves it on 127.0.0.1, and has headless Chromium (Debian's ``chromium``,
installed with apt-get when missing, as nginx is for the integration tests) take a screenshot
of the main pages at desktop width (1280 x 900, what is above the fold) and at phone width
(390 x 844). The PNGs go to ``--out`` (default ``docs-check/``) for a person to look at; the
properties a test can check without a browser (line widths, copy text, search, defaults) are
in tests/test_docs_site.py.

Not part of ``tox``'s default run: it needs a browser and takes a minute.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from system_deps import find_executable, install

ROOT = Path(__file__).resolve().parents[1]
PAGES = (
    "",
    "getting-started/",
    "storage/",
    "caching/",
    "performance/",
    "distributed/",
    "migrating/",
    "api/",
)
SIZES = {"desktop": (1280, 900), "phone": (390, 844)}


def browser() -> str:
    found = find_executable("chromium")
    if found is None:
        if install(["chromium"]) != 0:
            raise SystemExit("docs-check needs Chromium (apt-get install chromium)")
        found = find_executable("chromium")
    assert found is not None
    return found


def build(site: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(site)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def serve(site: Path) -> http.server.ThreadingHTTPServer:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def screenshot(chromium: str, url: str, size: tuple[int, int], out: Path) -> None:
    width, height = size
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            f"--window-size={width},{height}",
            f"--screenshot={out}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    if not out.is_file() or out.stat().st_size == 0:
        raise SystemExit(f"no screenshot of {url}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs-check")
    args = parser.parse_args()
    chromium = browser()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        build(site)
        server = serve(site)
        base = f"http://127.0.0.1:{server.server_address[1]}/"
        try:
            for page in PAGES:
                for label, size in SIZES.items():
                    name = (page.strip("/") or "home") + f"-{label}.png"
                    screenshot(chromium, base + page, size, args.out / name)
                    print(args.out / name)
        finally:
            server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
