"""Screenshots of the /kv page under a live workload (the images in docs/kv-map.md and the README).

Serves the bundled demo model with a small pool and a host tier, keeps a few clients sending
requests that share system prompts (so blocks are shared, cached, evicted and restored), opens the
page in Debian's headless chromium and saves a desktop (light) and a phone-width (dark) screenshot,
the desktop one with the mouse over a shared block.

    python scripts/kv_page_screenshots.py --out docs/images
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import headless_chromium  # scripts/headless_chromium.py (this script's folder is on sys.path)
import httpx
import uvicorn

from kvpager.api.server.app import ServerSettings, build_app
from kvpager.core.config import EngineConfig
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine

SYSTEM_PROMPTS = (
    "You are a careful assistant who answers questions about the history of the printing press in Europe. ",
    "You translate short English sentences into plain French, keeping the meaning and the tone of each one. ",
)
QUESTIONS = ("Who", "What", "When", "Where", "Why", "How")


def client_loop(url: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        prompt = rng.choice(SYSTEM_PROMPTS) + " ".join(rng.choice(QUESTIONS) for _ in range(rng.randint(3, 30)))
        body = {"prompt": prompt, "max_tokens": rng.randint(16, 64), "temperature": 0.8, "ignore_eos": True}
        try:
            httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
        except httpx.HTTPError:
            time.sleep(0.5)


def capture(driver: Any, path: Path, width: int, height: int, dark: bool, mobile: bool) -> None:
    headless_chromium.emulate(driver, width, height, dark, mobile)
    time.sleep(2.5)  # a few live updates at the new size
    # wait (a while at most) for a moment worth showing: several requests, a prefix shared by two
    busy = "const d = kvView.doc; return d.requests.length >= 3 && d.counts.shared >= 2;"
    deadline = time.monotonic() + 90
    while not driver.execute_script(busy) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not mobile:
        hover_shared_block(driver)
    path.write_bytes(headless_chromium.full_page_png(driver, width))
    print(f"wrote {path}")


def hover_shared_block(driver: Any) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    found = driver.execute_script(
        "const d = kvView.doc; for (const [k, r] of Object.entries(d.blocks.ref)) "
        "if (r >= 2 && d.blocks.state[+k] === 'o') return [+k, kvView.grid.cols, kvView.grid.size]; return null;"
    )
    if found is None:
        return
    block_id, cols, size = found
    grid = driver.find_element(By.ID, "grid")
    dx = (block_id % cols) * size + size // 2 - grid.size["width"] // 2
    dy = (block_id // cols) * size + size // 2 - grid.size["height"] // 2
    ActionChains(driver).move_to_element_with_offset(grid, dx, dy).perform()
    time.sleep(0.3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="docs/images", help="directory for kv-page-desktop.png and kv-page-phone.png")
    p.add_argument("--warmup", type=float, default=30.0, help="seconds of workload before the first screenshot")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--port", type=int, default=8766)
    args = p.parse_args()
    browser = headless_chromium.find()
    if browser is None:
        print(headless_chromium.MISSING, file=sys.stderr)
        return 2

    # 160 blocks of 16 tokens (the demo model's block is 64 KiB): a legible grid, and evictions to host RAM.
    config = EngineConfig(kv_cache_memory=160 * (64 << 10), host_kv_cache_memory=32 << 20, max_num_seqs=8, device="cpu")
    engine = Engine(config)
    url = f"http://127.0.0.1:{args.port}"
    server = uvicorn.Server(
        uvicorn.Config(build_app(AsyncEngine(engine), ServerSettings()), port=args.port, log_level="warning")
    )
    server_thread = threading.Thread(target=server.run, daemon=True)
    server_thread.start()
    while not server.started:
        time.sleep(0.1)
    stop = threading.Event()
    clients = [threading.Thread(target=client_loop, args=(url, stop, i), daemon=True) for i in range(args.clients)]
    for thread in clients:
        thread.start()
    with tempfile.TemporaryDirectory() as profile:
        driver = headless_chromium.start(*browser, profile)
        try:
            driver.get(f"{url}/kv?interval=0.5")
            time.sleep(args.warmup)
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            capture(driver, out / "kv-page-desktop.png", 1280, 900, dark=False, mobile=False)
            capture(driver, out / "kv-page-phone.png", 390, 844, dark=True, mobile=True)
        finally:
            driver.quit()
            stop.set()
            server.should_exit = True
            server_thread.join(60)  # the lifespan's shutdown must finish before the interpreter does
    return 0


if __name__ == "__main__":
    sys.exit(main())
