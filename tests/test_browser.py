"""The app in a real browser: Debian's Chromium, driven headless by Playwright, uploads a query image and
finds the expected neighbour among the results; a screenshot is kept in test-artifacts/."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.server import launch
from app.service import SearchService
from retrieval.runs import RunDir
from tests.test_app import free_port

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).parents[1] / "test-artifacts"
# the flags of a browser on a machine without network: no background connections, no sandbox as root
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def browser_missing() -> str | None:
    """Why the browser test cannot run here, or None; CI (CI set) installs Chromium, so there it must run."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install -e '.[test]')"
    if not Path(CHROMIUM).is_file():
        return f"{CHROMIUM} is missing (apt-get install chromium)"
    return None


@pytest.fixture
def page_url(demo_run: RunDir) -> Iterator[tuple[str, SearchService]]:
    missing = browser_missing()
    if missing and os.environ.get("CI"):
        pytest.fail(f"the browser test must run in CI: {missing}")
    if missing:
        pytest.skip(missing)
    service = SearchService(demo_run)
    port = free_port()
    demo = launch(service, port=port, block=False)
    try:
        yield f"http://127.0.0.1:{port}/", service
    finally:
        demo.close()
        service.close()


def test_a_query_uploaded_in_the_browser_shows_its_nearest_neighbour(page_url: tuple[str, SearchService], tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    url, service = page_url
    item_id, item = next(iter(service.items.items()))
    query = tmp_path / "query.png"  # the gallery image with one pixel changed: its nearest neighbour is the original
    image = Image.open(item.path).convert("RGB")
    image.putpixel((0, 0), (255, 0, 255))
    image.save(query)
    expected = service.search(query, k=1).hits[0]
    assert expected.id == item_id
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.locator("#query input[type=file]").set_input_files(str(query))
            page.locator("#search").click()
            first = page.locator("#results .caption-label").first
            expect(first).to_contain_text(f"id {item_id}", timeout=60_000)
            expect(first).to_contain_text(Path(item.path).name)
            expect(page.locator("#summary")).to_contain_text("results in")
            page.screenshot(path=str(ARTIFACTS / "app-search.png"), full_page=True)
            second = page.locator("#results .caption-label").nth(1).inner_text()
            page.locator("#results .thumbnail-item").nth(1).click()  # searching with a result: its label is known
            expect(page.locator("#summary")).to_contain_text(f"label {service.items[int(second.rsplit('id ', 1)[1])].label}", timeout=60_000)
            page.get_by_role("tab", name="Embedding map").click()
            page.get_by_role("button", name="Draw the map").click()
            picture = page.locator("#map img")
            expect(picture).to_be_visible(timeout=60_000)
            embedding_map = service.embedding_map("pca")
            natural = picture.evaluate("image => [image.naturalWidth, image.naturalHeight]")
            box = picture.bounding_box()
            gaps = np.linalg.norm(embedding_map.pixels[:, None] - embedding_map.pixels[None], axis=-1) + np.eye(len(embedding_map.ids)) * 1e9
            loneliest = int(gaps.min(axis=1).argmax())  # a point no other lies close to: the click cannot pick a neighbour
            x, y = embedding_map.pixels[loneliest]
            picture.click(position={"x": x * box["width"] / natural[0], "y": y * box["height"] / natural[1]})
            picked = service.items[int(embedding_map.ids[loneliest])]
            expect(page.locator("#summary")).to_contain_text(f"label {picked.label}", timeout=60_000)
            page.screenshot(path=str(ARTIFACTS / "app-map-pick.png"), full_page=True)
        finally:
            browser.close()
