"""The /kv page in a real headless browser (Debian's chromium + chromium-driver, driven by selenium).

A known workload is frozen mid-flight (the engine's steps are held back while the page looks): two
requests share a four-block prefix, one starts with a pinned KV pack, a finished request left its
blocks cached. The page's grid is read back pixel by pixel and must show exactly the pool's count
of blocks in each state, the shared prefix in the shared colour; hovering a shared block names both
owners; the chart gains points as the stream runs and follows the pool once the requests finish.
Set KVPAGER_KV_SCREENSHOTS=DIR to keep the desktop and phone screenshots (docs/images/ holds them).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from engine_helpers import tiny_llama_config
from kv_map_checks import serve_in_thread

from kvpager.api.server.app import ServerSettings, build_app
from kvpager.core.sampling_params import SamplingParams
from kvpager.engine.async_engine import AsyncEngine
from kvpager.engine.engine import Engine

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parent.parent

KEY = "sk-page-test"
NUM_BLOCKS = 48
SHARED = list(range(10, 26))  # four full blocks
PINNED = list(range(200, 208))  # two full blocks, loaded as a KV pack
DONE = list(range(300, 320))  # a finished request: its full blocks stay cached
STATES = ("free", "cached", "owned", "shared", "pinned")


class HeldEngine:
    """The engine, with `step()` held back while `held` is set (so a workload can be looked at mid-flight)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.held = threading.Event()
        self.held.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def step(self) -> list[Any]:
        if self.held.is_set():
            time.sleep(0.02)  # the loop thread keeps polling; do not spin
            return []
        return self._engine.step()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def pool_states(engine: Engine) -> list[str]:
    """Each block's state, from the pool itself (the page must draw exactly this)."""
    pool = engine.kv_manager.block_pool
    states = []
    for block_id in range(pool.num_blocks):
        if pool.num_pins(block_id):
            states.append("pinned")
        elif pool.ref_cnt(block_id) >= 2:
            states.append("shared")
        elif pool.ref_cnt(block_id):
            states.append("owned")
        else:
            states.append("cached" if pool.block_hash(block_id) is not None else "free")
    return states


def _load_headless_chromium() -> ModuleType:
    """scripts/headless_chromium.py, shared with scripts/kv_page_screenshots.py."""
    spec = importlib.util.spec_from_file_location("headless_chromium", REPO_ROOT / "scripts" / "headless_chromium.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


chromium = _load_headless_chromium()


def find_browser() -> tuple[str, str]:
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (pip install -e '.[test]')")
    found = chromium.find()
    if found is None:
        print(f"SKIP: {chromium.MISSING}")
        pytest.skip(chromium.MISSING)
    return found


@pytest.fixture(scope="module")
def frozen(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, HeldEngine]]:
    pack = tmp_path_factory.mktemp("pack") / "pinned.kvpack"
    pack.write_bytes(Engine(tiny_llama_config(llama_checkpoint, 8)).export_kv(PINNED))
    engine = Engine(tiny_llama_config(llama_checkpoint, NUM_BLOCKS, kv_packs=(str(pack),)))
    engine.add_request("done", DONE, params(4))
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("a", SHARED + [40, 41], params(40))
    engine.add_request("b", SHARED + [50], params(40))
    engine.add_request("p", PINNED + [60], params(40))
    for _ in range(3):
        engine.step()
    held = HeldEngine(engine)
    app = build_app(AsyncEngine(held), ServerSettings(api_key=KEY))
    try:
        with serve_in_thread(app) as url:
            yield url, held
    finally:
        held.held.clear()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    profile = tmp_path_factory.mktemp("chromium-profile")
    driver = chromium.start(*find_browser(), profile, "--window-size=1280,1100")
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check: Callable[[], Any], what: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


# The colour drawn in each block's cell (sampled 1.5 px inside its corner, clear of any ref-count digit)
# and the palette the page draws with, both read back from the canvas.
READ_CELLS = """
const g = kvView.grid, ctx = g.canvas.getContext('2d'), dpr = window.devicePixelRatio || 1;
const probe = document.createElement('canvas').getContext('2d', {willReadFrequently: true});
const rgb = (name) => { probe.clearRect(0, 0, 1, 1); probe.fillStyle = getComputedStyle(document.documentElement)
  .getPropertyValue('--' + name).trim(); probe.fillRect(0, 0, 1, 1); return Array.from(probe.getImageData(0, 0, 1, 1).data).slice(0, 3); };
const palette = Object.fromEntries(['free', 'cached', 'owned', 'shared', 'pinned'].map((s) => [s, rgb(s)]));
const cells = g.ids.map((id, i) => {
  const x = Math.floor(((i % g.cols) * g.size + 1.5) * dpr), y = Math.floor((Math.floor(i / g.cols) * g.size + 1.5) * dpr);
  return [id, Array.from(ctx.getImageData(x, y, 1, 1).data).slice(0, 3)];
});
return [palette, cells];
"""


def drawn_states(browser: Any) -> dict[int, str]:
    palette, cells = browser.execute_script(READ_CELLS)

    def nearest(rgb: list[int]) -> str:
        return min(palette, key=lambda s: sum((a - b) ** 2 for a, b in zip(palette[s], rgb, strict=True)))

    return {int(block_id): nearest(rgb) for block_id, rgb in cells}


def screenshot(browser: Any, path: Path, width: int, height: int, dark: bool, mobile: bool) -> None:
    chromium.emulate(browser, width, height, dark, mobile)
    updates = browser.execute_script("return kvView.updates")
    wait_for(lambda: browser.execute_script("return kvView.updates") > updates + 1, "a re-render at the new size")
    time.sleep(0.3)
    path.write_bytes(chromium.full_page_png(browser, width))
    out_dir = os.environ.get("KVPAGER_KV_SCREENSHOTS")
    if out_dir:
        shutil.copy(path, Path(out_dir) / path.name)


def test_page_draws_the_pool_shares_the_prefix_and_charts_live(
    frozen: tuple[str, HeldEngine], browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    url, held = frozen
    engine = held._engine
    want = pool_states(engine)
    table_a = engine.kv_manager.block_ids("a")  # type: ignore[arg-type]
    table_b = engine.kv_manager.block_ids("b")  # type: ignore[arg-type]
    assert table_a[:4] == table_b[:4]
    assert {want.count(s) for s in ("cached", "shared", "pinned", "owned")} >= {4, 2}, want

    browser.get(f"{url}/kv?interval=0.5")
    login = browser.find_element(By.ID, "login")
    wait_for(login.is_displayed, "the login form")
    browser.find_element(By.ID, "login-key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()
    wait_for(lambda: browser.execute_script("return kvView.updates >= 2"), "the first snapshots")
    assert not login.is_displayed()

    legend = {s: int(browser.find_element(By.ID, f"n-{s}").text) for s in STATES}
    owned_total = want.count("owned") + want.count("shared")
    assert legend == {**{s: want.count(s) for s in STATES}, "owned": owned_total}
    drawn = drawn_states(browser)
    assert [drawn[i] for i in range(NUM_BLOCKS)] == want  # every cell in its state's colour
    assert [drawn[i] for i in table_a[:4]] == ["shared"] * 4  # the shared prefix is drawn as shared
    rows = browser.execute_script("return kvView.rows.map((r) => r.ids)")
    assert [list(r[:4]) for r in rows[:2]] == [list(table_a[:4])] * 2  # and both request rows show it

    grid = browser.find_element(By.ID, "grid")
    index = browser.execute_script(f"return kvView.grid.ids.indexOf({table_a[0]})")
    cols, size = browser.execute_script("return [kvView.grid.cols, kvView.grid.size]")
    dx = (index % cols) * size + size // 2 - grid.size["width"] // 2
    dy = (index // cols) * size + size // 2 - grid.size["height"] // 2
    ActionChains(browser).move_to_element_with_offset(grid, dx, dy).perform()
    tip = browser.find_element(By.ID, "tip")
    wait_for(tip.is_displayed, "the hover details")
    block_hash = engine.kv_manager.block_pool.block_hash(table_a[0])
    assert block_hash is not None
    text = tip.text
    assert block_hash.hex()[:16] in text and "owners a, b" in text and "shared" in text
    assert engine.tokenizer.decode(SHARED[:4]).strip() in text

    screenshot(browser, tmp_path / "kv-page-desktop.png", 1280, 900, dark=False, mobile=False)
    screenshot(browser, tmp_path / "kv-page-phone.png", 390, 844, dark=True, mobile=True)
    assert browser.execute_script("return document.documentElement.scrollWidth") <= 390  # no sideways scroll

    points = int(browser.find_element(By.ID, "chart-usage").get_attribute("data-points"))
    wait_for(
        lambda: int(browser.find_element(By.ID, "chart-usage").get_attribute("data-points")) > points,
        "the usage chart to gain points",
    )
    held.held.clear()  # let the requests run to the end: the page must follow
    wait_for(lambda: browser.find_element(By.ID, "n-owned").text == "0", "the owned count to drop to 0")
    usage = browser.execute_script("return kvView.history[kvView.history.length - 1].usage")
    assert usage == pytest.approx(2 / NUM_BLOCKS)  # only the pinned pack is left
    wait_for(lambda: drawn_states(browser) == dict(enumerate(pool_states(engine))), "the grid to match the idle pool")
