"""The app in a real browser: Debian's Chromium, driven headless by Playwright, uploads a query image and
finds the expected neighbour among the results; a screenshot is kept in test-artifacts/."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from app.server import launch
from app.service import SearchService
from retrieval.runs import RunDir
from tests.test_app import free_port
from tests.test_audit import audit_run  # noqa: F401  (a fixture)

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


def whole_images(page: object, gallery: str) -> bool:
    """Whether every tile of the gallery shows its image whole, its caption below it, inside the gallery's width and
    below the gallery's name (drawn over its top-left corner)."""
    return page.locator(f"{gallery} .thumbnail-item").evaluate_all(  # type: ignore[attr-defined]
        """nodes => nodes.every(node => {
            const image = node.querySelector('img').getBoundingClientRect();
            const caption = node.querySelector('.caption-label').getBoundingClientRect();
            const tile = node.getBoundingClientRect();
            const grid = node.closest('.grid-wrap').getBoundingClientRect();
            const name = node.closest('.block').querySelector('[data-testid="block-label"]');
            const named = name ? tile.top >= name.getBoundingClientRect().bottom - 1 : true;
            return caption.top >= image.bottom - 1 && image.top >= tile.top && tile.right <= grid.right + 1 && named;
        })"""
    )


def drawn(page: object, picture: object) -> dict:
    """The map picture's box once its image has loaded and the layout has stopped moving (a click aimed before lands elsewhere)."""
    from playwright.sync_api import expect

    expect(picture).to_be_visible(timeout=60_000)  # type: ignore[arg-type]
    picture.evaluate("image => image.decode ? image.decode() : null")  # type: ignore[attr-defined]
    box, previous = picture.bounding_box(), None  # type: ignore[attr-defined]
    while box != previous:
        page.wait_for_timeout(300)  # type: ignore[attr-defined]
        box, previous = picture.bounding_box(), box  # type: ignore[attr-defined]
    return box


@contextmanager
def opened(url: str) -> Iterator[object]:
    """A page of headless Chromium (Debian's, driven by Playwright) showing url; the browser closed after."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            yield page
        finally:
            browser.close()


def system_fonts(page: object, selector: str) -> list[str]:
    """The fonts of the system, not served by the app, that Chromium drew the first selected element's text in."""
    session = page.context.new_cdp_session(page)  # type: ignore[attr-defined]
    session.send("DOM.enable")
    session.send("CSS.enable")
    root = session.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    node = session.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
    fonts = session.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
    return [font["familyName"] for font in fonts if not font["isCustomFont"]]


def watch_progress(page: object, box: str) -> None:
    """Records in window.progressShown each time Gradio's progress overlay shows over the box (it dims it)."""
    page.evaluate(  # type: ignore[attr-defined]
        """box => { window.progressShown = []; const node = document.querySelector(box);
            new MutationObserver(() => { const wrap = node.querySelector('.wrap');
                if (wrap && !wrap.classList.contains('hide')) window.progressShown.push(wrap.className); })
            .observe(node, {attributes: true, subtree: true, childList: true}); }""",
        box,
    )


def test_a_query_uploaded_in_the_browser_shows_its_nearest_neighbour(page_url: tuple[str, SearchService], tmp_path: Path) -> None:
    from playwright.sync_api import expect

    url, service = page_url
    item_id, item = next(iter(service.items.items()))
    query = tmp_path / "query.png"  # the gallery image with one pixel changed: its nearest neighbour is the original
    image = Image.open(item.path).convert("RGB")
    image.putpixel((0, 0), (255, 0, 255))
    image.save(query)
    expected = service.search(query, k=1).hits[0]
    assert expected.id == item_id
    ARTIFACTS.mkdir(exist_ok=True)
    (tmp_path / "notes.png").write_text("not a picture")
    with opened(url) as page:
        page.locator("#query input[type=file]").set_input_files(str(tmp_path / "notes.png"))
        page.locator("#search").click()
        expect(page.locator("#summary")).to_contain_text("notes.png: not a readable image", timeout=60_000)
        expect(page.locator("#query img")).to_have_count(0)  # the query box showed a broken image beside the message
        page.locator("#query input[type=file]").set_input_files(str(query))
        watch_progress(page, "#query")
        page.locator("#search").click()
        first = page.locator("#results .thumbnail-item").first
        expect(first).to_have_attribute("title", f"{Path(item.path).name} · id {item_id}", timeout=60_000)  # on hover
        expect(page.locator("#summary")).to_contain_text("results in")
        page.wait_for_timeout(500)  # the step after the search (clear_unreadable) has run
        assert page.evaluate("window.progressShown") == [], "the query box dimmed while its search ran"
        page.screenshot(path=str(ARTIFACTS / "app-search.png"), full_page=True)
        second = page.locator("#results .thumbnail-item").nth(1).get_attribute("title") or ""
        page.locator("#results .thumbnail-item").nth(1).click()  # searching with a result: its label is known
        expect(page.locator("#summary")).to_contain_text(f"label {service.items[int(second.rsplit('id ', 1)[1])].label}", timeout=60_000)
        page.get_by_role("tab", name="Embedding map").click()
        page.get_by_role("button", name="Draw the map").click()
        picture = page.locator("#map img")
        box = drawn(page, picture)
        embedding_map = service.embedding_map("pca")
        natural = picture.evaluate("image => [image.naturalWidth, image.naturalHeight]")
        gaps = np.linalg.norm(embedding_map.pixels[:, None] - embedding_map.pixels[None], axis=-1) + np.eye(len(embedding_map.ids)) * 1e9
        loneliest = int(gaps.min(axis=1).argmax())  # a point no other lies close to: the click cannot pick a neighbour
        x, y = embedding_map.pixels[loneliest]
        picture.click(position={"x": x * box["width"] / natural[0], "y": y * box["height"] / natural[1]})
        picked = service.items[int(embedding_map.ids[loneliest])]
        expect(page.locator("#summary")).to_contain_text(f"label {picked.label}", timeout=60_000)
        page.screenshot(path=str(ARTIFACTS / "app-map-pick.png"), full_page=True)


def test_the_first_hour_in_the_browser(page_url: tuple[str, SearchService], tmp_path: Path) -> None:
    """The label picked before an upload is kept; hits and misses are framed; captions wrap; Browse opens on a label
    and a row of its table browses that label; plots are shown whole; the map highlights a label and names a point."""
    from playwright.sync_api import expect

    url, service = page_url
    item_id, item = next(iter(service.items.items()))
    query = tmp_path / "query.png"
    Image.open(item.path).convert("RGB").save(query)
    ARTIFACTS.mkdir(exist_ok=True)
    with opened(url) as page:
        page.get_by_label("Query label (optional: marks hits and misses)").fill(item.label)
        page.keyboard.press("Enter")
        page.locator("#query input[type=file]").set_input_files(str(query))
        page.locator("#search").click()
        expect(page.locator("#summary")).to_contain_text(f"label {item.label}", timeout=60_000)  # kept across the upload
        marked = page.locator("#results .thumbnail-item.result-hit, #results .thumbnail-item.result-miss")
        expect(marked).to_have_count(10, timeout=10_000)
        caption = page.locator("#results .caption-label").first
        assert caption.evaluate("node => getComputedStyle(node).whiteSpace") == "normal"
        assert caption.evaluate("node => node.scrollWidth <= node.clientWidth + 1")  # the whole caption is shown
        assert whole_images(page, "#results")  # each image above its caption, none covered or cut
        page.screenshot(path=str(ARTIFACTS / "app-upload-keeps-label.png"), full_page=True)
        page.locator("#results .thumbnail-item").nth(2).click()
        expect(page.locator("#summary")).to_contain_text("results in", timeout=60_000)
        page.wait_for_timeout(1500)
        rings = page.locator("#results .thumbnail-item.selected").evaluate_all("nodes => nodes.map(node => getComputedStyle(node).getPropertyValue('--ring-color').trim())")
        assert all(ring == "transparent" for ring in rings), rings
        page.mouse.move(0, 0)  # the pointer off the tiles: nothing of the click is left on the new results
        faded = page.locator("#results .thumbnail-item").evaluate_all("nodes => nodes.filter(node => node.classList.contains('selected') || getComputedStyle(node.querySelector('img')).opacity < 1 || getComputedStyle(node.querySelector('.caption-label')).opacity < 1).length")
        assert faded == 0
        page.get_by_role("tab", name="Browse").click()
        first_label, second_label = [label for label, _ in service.label_counts()][:2]  # the table's order
        expect(page.locator("#browsed .caption-label").first).to_contain_text(first_label, timeout=30_000)  # not empty on opening
        header = page.locator("#labels th").nth(1)
        assert header.evaluate("node => node.scrollWidth <= node.clientWidth + 1")  # "items" is not cut off
        page.locator("#labels").get_by_text(second_label, exact=True).last.click()
        expect(page.locator("#browsed .caption-label").first).to_contain_text(second_label, timeout=30_000)
        page.screenshot(path=str(ARTIFACTS / "app-browse.png"), full_page=True)
        page.get_by_role("tab", name="Metrics").click()
        expect(page.locator("#run-plots img").first).to_be_visible(timeout=30_000)
        fits = page.locator("#run-plots img").evaluate_all("nodes => nodes.map(node => getComputedStyle(node).objectFit)")
        assert fits and all(fit == "contain" for fit in fits), fits
        page.screenshot(path=str(ARTIFACTS / "app-metrics.png"), full_page=True)
        _map_names_a_point(page, service, item_id, item.label)


def _map_names_a_point(page: object, service: SearchService, item_id: int, label: str) -> None:
    """The map, drawn with label highlighted, names the point under the pointer (the item's own)."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Embedding map").click()
    page.get_by_role("button", name="Draw the map").click()
    picture = page.locator("#map img")
    expect(picture).to_be_visible(timeout=60_000)
    page.get_by_label("Highlight a label (type to find it)").fill(label)
    page.keyboard.press("Enter")
    page.wait_for_timeout(3000)
    shown = service.embedding_map("pca", label)
    natural = picture.evaluate("image => [image.naturalWidth, image.naturalHeight]")
    box = picture.bounding_box()
    position = list(shown.ids).index(item_id)
    x, y = shown.pixels[position]
    page.mouse.move(box["x"] + x * box["width"] / natural[0], box["y"] + y * box["height"] / natural[1])
    tooltip = page.locator("#map-tooltip")
    expect(tooltip).to_be_visible(timeout=10_000)
    expect(tooltip).to_contain_text(" · ")
    page.screenshot(path=str(ARTIFACTS / "app-map-hover.png"), full_page=True)


def test_tiles_at_two_widths_a_missed_map_click_and_the_docs_offline(page_url: tuple[str, SearchService], tmp_path: Path) -> None:
    """Issue-27 trial in the browser: the result grid fits 1400 and 420 px with whole images and short captions; a click
    between the map's points leaves a quiet note and no error anywhere; /docs renders with nothing fetched from outside."""
    from playwright.sync_api import expect, sync_playwright

    url, service = page_url
    item = next(iter(service.items.values()))
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            for width in (1400, 420):
                page = browser.new_page(viewport={"width": width, "height": 900})
                page.goto(url)
                page.locator("#query input[type=file]").set_input_files(str(item.path))
                page.locator("#search").click()
                expect(page.locator("#summary")).to_contain_text("results in", timeout=60_000)
                expect(page.locator("#results .thumbnail-item")).to_have_count(10, timeout=10_000)
                assert whole_images(page, "#results") and whole_images(page, "#picker")
                captions = page.locator("#results .caption-label").all_inner_texts()
                assert all(len(caption) <= 60 and "id " not in caption for caption in captions), captions
                page.screenshot(path=str(ARTIFACTS / f"app-results-{width}.png"), full_page=True)
                if width == 420:
                    page.get_by_role("tab", name="Browse").click()
                    expect(page.locator("#browsed .thumbnail-item").first).to_be_visible(timeout=30_000)
                    assert whole_images(page, "#browsed")
                    page.screenshot(path=str(ARTIFACTS / "app-browse-420.png"), full_page=True)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto(url)
            page.get_by_role("tab", name="Embedding map").click()
            page.get_by_role("button", name="Draw the map").click()
            picture = page.locator("#map img")
            box = drawn(page, picture)
            page.mouse.click(box["x"] + 2, box["y"] + 2)  # the figure's corner: no point there
            expect(page.get_by_text("No gallery item there")).to_be_visible(timeout=10_000)
            page.get_by_role("tab", name="Search").click()
            page.wait_for_timeout(1000)
            assert page.locator(".toast-body.error, .error").count() == 0  # no red toast, no error badge
            page.screenshot(path=str(ARTIFACTS / "app-map-missed.png"), full_page=True)
            docs = browser.new_page()
            outside: list[str] = []
            docs.route("**/*", lambda route: (outside.append(route.request.url), route.abort()) if not route.request.url.startswith(url.rstrip("/")) else route.continue_())
            docs.goto(f"{url}docs")
            expect(docs.get_by_text("/api/v1/search").first).to_be_visible(timeout=30_000)
            docs.screenshot(path=str(ARTIFACTS / "api-docs-offline.png"), full_page=True)
            assert outside == [], outside
        finally:
            browser.close()


HEADER_LINES = """headers => headers.map(header => {
    const range = document.createRange();
    range.selectNodeContents([...header.querySelectorAll("*")].find(node => node.children.length === 0
        && node.textContent.trim() && node.textContent.trim() !== "\u22ee") || header);
    return new Set([...range.getClientRects()].map(rect => Math.round(rect.top))).size;
})"""  # the lines each table header's text takes


def test_the_metrics_tab_opens_a_class_and_a_confused_pair_with_their_queries_and_first_hits(page_url: tuple[str, SearchService]) -> None:
    from playwright.sync_api import expect

    url, service = page_url
    name, metrics = next(iter(service.metric_sets.items()))  # the set the tab opens on
    row = metrics["classes"][0]
    hits = [hit for hit in metrics["first_hits"] if hit["label"] == row["label"]]
    ARTIFACTS.mkdir(exist_ok=True)
    with opened(url) as page:
        page.get_by_role("tab", name="Metrics").click()
        pair = metrics["confusions"][0] if metrics["confusions"] else None
        if pair is not None:
            expect(page.locator("#confusions")).to_contain_text(pair["confused_with"], timeout=60_000)
        for table in ("#confusions", "#classes"):  # "queries" and "recall@1" were broken over two lines
            headers = page.locator(f"{table} th")
            assert headers.evaluate_all(HEADER_LINES) == [1] * headers.count()
        page.locator("#classes").get_by_text(row["label"], exact=True).last.click()
        tiles = page.locator("#class-view .thumbnail-item")
        expect(tiles).to_have_count(len(hits) + sum(hit["hit"] is not None for hit in hits), timeout=60_000)
        expect(tiles.first).to_contain_text("query")
        page.screenshot(path=str(ARTIFACTS / "app-metrics-class.png"), full_page=True)
        assert pair is not None, "a 2-epoch model confuses some of its 8 test classes"
        page.locator("#confusions [data-testid=cell-0-0]").click()
        expect(page.get_by_text(f"{pair['count']} of its {pair['queries']} quer")).to_be_visible(timeout=60_000)
        expect(tiles).to_have_count(2 * pair["count"], timeout=60_000)
        expect(tiles.nth(1)).to_contain_text("miss · ")
        columns = page.locator("#class-view .grid-container").evaluate("grid => getComputedStyle(grid).gridTemplateColumns.split(' ').length")
        assert columns % 2 == 0, f"{columns} columns split a query from its hit at the end of a row"
        page.screenshot(path=str(ARTIFACTS / "app-metrics-confused.png"), full_page=True)


def test_the_audit_tab_shows_a_suspect_beside_its_suggested_label_and_accepts_it(
    audit_run: tuple[RunDir, object],
) -> None:
    """Issue-28 trial: audit the gallery's labels, open the first suspect (its image, then the closest images of the
    label suggested), accept the suggestion; the decision lands in RUN/labels.csv and the suspect leaves the list."""
    from playwright.sync_api import expect

    from app.audit import AuditHandlers, labels_csv

    missing = browser_missing()
    if missing and os.environ.get("CI"):
        pytest.fail(f"the browser test must run in CI: {missing}")
    if missing:
        pytest.skip(missing)
    run, _ = audit_run
    service = SearchService(run, allow_write=True)
    port = free_port()
    demo = launch(service, port=port, block=False)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        with opened(f"http://127.0.0.1:{port}/") as page:
            page.get_by_role("tab", name="Audit").click()
            page.get_by_role("button", name="Audit the gallery's labels").click()
            table = page.locator("#suspects")
            expect(table).to_contain_text("suggested", timeout=60_000)
            expect(page.get_by_text(re.compile("suspected wrong labels? of"))).to_be_visible(timeout=60_000)
            expect(page.locator("#accept")).to_be_disabled()  # nothing opened: it answered "Error" in every output
            name = Path(AuditHandlers(service).audit()[1][0]["file"]).name  # the most suspect image: the first row
            table.get_by_text(name, exact=True).last.click()
            tiles = page.locator("#suspect-view .thumbnail-item")
            expect(tiles.first).to_contain_text("labeled", timeout=30_000)
            assert tiles.count() >= 2  # the image, then the suggested label's closest images
            assert whole_images(page, "#suspect-view")  # not cropped, captions below, the first row below the name
            expect(page.locator("#suspect-line")).to_contain_text("suggest")
            page.screenshot(path=str(ARTIFACTS / "app-audit.png"), full_page=True)
            for bold in ("h1", "#accept", "#keep"):  # drawn at weight 600
                assert system_fonts(page, bold) == [], bold  # every letter in the app's font, none in a fallback
            page.locator("#accept").click()
            expect(page.locator("#decision")).to_contain_text("1 decision in", timeout=30_000)
            assert name in labels_csv(service).read_text()
            expect(page.locator("#accept")).to_be_disabled()  # the decided suspect is closed
            expect(page.locator("#keep")).to_be_disabled()
            page.get_by_role("tab", name="Browse").click()  # a careless removal: the labels table stays
            labels = page.locator("#labels")
            first_label = next(label for label, _ in service.label_counts() if label)
            expect(labels).to_contain_text(first_label)
            page.get_by_label("Ids to remove (from the captions)").fill("the red ones")
            page.get_by_role("button", name="Remove from the index").click()
            expect(page.get_by_text("not done:")).to_be_visible(timeout=30_000)
            expect(page.get_by_text("give item ids as numbers")).to_be_visible()
            expect(labels).to_contain_text(first_label)  # it read "Error" until the next change
            page.screenshot(path=str(ARTIFACTS / "app-remove-refused.png"), full_page=True)
            page.screenshot(path=str(ARTIFACTS / "app-audit-accepted.png"), full_page=True)
    finally:
        demo.close()
        service.close()
