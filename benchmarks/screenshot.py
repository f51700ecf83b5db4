"""The guide's picture of `gptforge serve`'s page, taken by the system's headless Chromium through Playwright.

    python benchmarks/screenshot.py PATH [--out docs/serve.png] [--prompt TEXT] [--width 1280] [--height 1000]

Serves PATH on a free port, types the prompt into the playground, waits for the streamed completion, and saves
the page (the top of it: curves and playground) as a PNG.
"""

from __future__ import annotations

import argparse
import shutil

from playwright.sync_api import sync_playwright

from serve import start_server  # benchmarks/serve.py, beside this script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--out", default="docs/serve.png")
    p.add_argument("--prompt", default="def fibonacci(n):")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1000)
    args = p.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium)")
    server, url = start_server(args.path, 1)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium)
            page = browser.new_page(viewport={"width": args.width, "height": args.height})
            page.goto(url)
            page.wait_for_selector("#chart-tps .u-legend", timeout=60_000)
            page.fill("#prompt", args.prompt)
            page.fill("#max-tokens", "48")
            page.fill("#temperature", "0.6")
            page.click("#generate")
            page.wait_for_function("document.getElementById('out-info').textContent.includes('finished')")
            page.screenshot(path=args.out)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
