"""The search app on a real index: the service, every API endpoint through gradio_client, bad uploads,
the files it serves, authentication, batching of concurrent queries, and add/remove."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import gradio as gr
import numpy as np
import pytest
from PIL import Image

from app.handlers import metrics_rows, parse_ids
from app.server import IDLE_POLL_SECONDS, Server, launch, loopback, parse_auth
from app.service import SearchService, project_2d
from index.build import build_index
from index.disk import writer_lock
from retrieval.data import load_collection
from retrieval.errors import RetrievalError
from retrieval.evaluation import TRAINED
from retrieval.runs import RunDir
from tests.conftest import write_bad_files


@pytest.fixture(scope="module")
def app_run(demo_run: RunDir, tmp_path_factory: pytest.TempPathFactory) -> RunDir:
    """A copy of the demo run, so that adding and removing here leaves the shared run alone."""
    root = tmp_path_factory.mktemp("app") / "run"
    shutil.copytree(demo_run.root, root)
    return RunDir(root)


@pytest.fixture(scope="module")
def service(app_run: RunDir) -> Iterator[SearchService]:
    service = SearchService(app_run, allow_write=True)
    yield service
    service.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def client(service: SearchService) -> Iterator[object]:
    from gradio_client import Client

    port = free_port()
    demo = launch(service, port=port, max_upload="1MB", block=False)
    try:
        yield Client(f"http://127.0.0.1:{port}/", verbose=False)
    finally:
        demo.close()


def write_odd_images(folder: Path) -> dict[str, Path]:
    """Readable but unusual images: animated GIF, 16-bit grayscale PNG, CMYK JPEG."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"animated": folder / "animated.gif", "sixteen_bit": folder / "deep.png", "cmyk": folder / "print.jpg"}
    frames = [Image.new("RGB", (48, 48), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(paths["animated"], save_all=True, append_images=frames[1:], duration=100, loop=0)
    Image.fromarray((np.arange(48 * 48, dtype=np.uint16).reshape(48, 48) * 20)).save(paths["sixteen_bit"])
    Image.new("CMYK", (48, 48), (0, 120, 200, 10)).save(paths["cmyk"])
    return paths


def write_bomb(path: Path) -> Path:
    """A 10,000 x 10,000 pixel PNG (100 megapixels) that compresses to a few kilobytes."""
    Image.new("1", (10_000, 10_000)).save(path)
    return path


# the service


def test_search_leaves_the_query_out_and_marks_hits(service: SearchService, tmp_path: Path) -> None:
    item_id, item = next(iter(service.items.items()))
    copy = tmp_path / "upload.png"  # the app sees a copy of a picked gallery image
    copy.write_bytes(item.path.read_bytes())
    result = service.search(copy, k=5, query_label=item.label)
    assert len(result.hits) == 5 and item_id not in [hit.id for hit in result.hits]
    assert [hit.score for hit in result.hits] == sorted((hit.score for hit in result.hits), reverse=True)
    assert f"label **{item.label}**" in result.summary and " ms" in result.summary
    by_id = service.search_item(item_id, k=5)
    assert [hit.id for hit in by_id.hits] == [hit.id for hit in result.hits]  # same neighbours from the stored vector


def test_a_query_label_no_gallery_item_has_marks_nothing_and_names_the_closest(service: SearchService, tmp_path: Path) -> None:
    """A typo in the query label marked all ten hits 'miss' with '0/10 hits, first hit at rank none'."""
    item = next(iter(service.items.values()))
    typo = item.label[:-1] + "#"
    result = service.search(item.path, k=5, query_label=typo)
    assert len(result.hits) == 5 and result.label == "" and "hits" not in result.summary.split("(")[0]
    assert f"no gallery item has the label '{typo}', so hits are not marked; closest: {item.label}" in result.summary
    first = service.search(item.path, k=1).hits[0].label
    missed = next(label for label in sorted({item.label for item in service.items.values()}) if label != first)
    known = service.search(item.path, k=1, query_label=missed)  # a gallery label the one hit does not have
    assert known.label == missed and f"label **{missed}**: 0/1 hits (the query is gallery item " in known.summary


def test_a_batch_with_bad_images_fails_only_their_queries(service: SearchService, tmp_path: Path) -> None:
    bad = write_bad_files(tmp_path / "bad")
    good = next(iter(service.items.values())).path
    bomb = write_bomb(tmp_path / "bomb.png")
    paths = [good, bad["empty"], good, bad["truncated"], bad["text"], bomb, tmp_path / "missing.png"]
    results = service.search_images(paths, [3] * len(paths), [""] * len(paths), [None] * len(paths))
    assert [result.error for result in results] == [False, True, False, True, True, True, True]
    assert results[0].summary.startswith("3 results") and "a batch of 7 queries" in results[0].summary
    assert "empty file" in results[1].summary and "truncated" in results[3].summary
    assert "not a readable image" in results[4].summary and "10000x10000 pixels is over the limit" in results[5].summary
    assert "cannot be read" in results[6].summary


def test_unusual_images_are_searched(service: SearchService, tmp_path: Path) -> None:
    odd = write_odd_images(tmp_path)
    results = service.search_images(list(odd.values()), [2, 2, 2], ["", "", ""], [None] * 3)
    assert all(len(result.hits) == 2 for result in results)
    assert "animated: searched with its first frame" in results[0].summary
    with pytest.raises(RetrievalError, match=r"^3 images for 2 ks, 1 labels: give one of each per image$"):
        service.search_images(list(odd.values()), [2, 2], [""], [None] * 3)  # answered the shortest, dropped the rest


def test_browse_counts_and_thumbnails(service: SearchService) -> None:
    counts = dict(service.label_counts())
    assert sum(counts.values()) == len(service.items)
    label = max(counts, key=counts.get)  # type: ignore[arg-type]
    ids = service.browse(label)
    assert len(ids) == counts[label] and all(service.items[i].label == label for i in ids)
    assert {service.items[i].label for i in service.samples()} == set(counts)
    (thumbnail,) = service.thumbnails(ids[:1])
    assert thumbnail.is_relative_to(service.cache) and max(Image.open(thumbnail).size) <= 256


def test_evaluate_now_scores_the_index_items(service: SearchService, demo_run: RunDir) -> None:
    steps: list[str] = []
    evaluated = service.evaluate_now(lambda fraction, text: steps.append(text))
    evaluation, plots = evaluated.evaluation, evaluated.plots
    assert evaluation.metrics["num_queries"] + evaluation.metrics["num_skipped_queries"] == len(service.items)
    assert 0.0 <= evaluation.metrics["recall@1"] <= evaluation.metrics["recall@10"] <= 1.0
    assert [path.name for path in plots] == ["recall_at_k.png", "similarities.png", "class_recall.png", "worst_queries.png", "confusions.png", "diagnostics.png"]
    assert len(steps) == 2 and all(path.is_relative_to(service.cache) for path in plots)
    assert evaluation.metrics["recall@1 (exact search)"] == evaluation.metrics["recall@1"]  # a Flat index is exact
    assert evaluation.metrics["search"] == "Flat"
    assert TRAINED not in evaluation.metrics  # the gallery is the test classes: nothing to say


def test_evaluate_now_on_a_gallery_of_the_training_images_says_they_flatter_it(demo_run: RunDir, tmp_path: Path) -> None:
    """The Evaluate button's recall@1 on a gallery of the run's own training images read like any other."""
    from index.build import build_index
    from retrieval.data import load_collection
    from retrieval.embedders import OnnxEmbedder

    run = RunDir(tmp_path / "run")
    shutil.copytree(demo_run.root, run.root, ignore=shutil.ignore_patterns("index"))
    trained_on = load_collection(json.loads(run.model_card.read_text())["trained_on"])
    build_index(OnnxEmbedder.from_run(run), trained_on, run.index, progress=False)
    service = SearchService(run)
    try:
        evaluation = service.evaluate_now().evaluation
    finally:
        service.close()
    count = len(trained_on.items)
    assert evaluation.metrics[TRAINED] == count
    assert [TRAINED, f"{count:,}: these figures flatter the model"] in metrics_rows(evaluation.metrics)


def test_embedding_map_picks_the_point_clicked(service: SearchService) -> None:
    embedding_map = service.embedding_map("pca")
    assert embedding_map.image.is_file() and len(embedding_map.ids) == len(service.items)
    width, height = Image.open(embedding_map.image).size
    assert ((0 <= embedding_map.pixels) & (embedding_map.pixels <= [width, height])).all()
    for row in (0, len(embedding_map.ids) // 2):
        x, y = embedding_map.pixels[row]
        picked = embedding_map.pick(x + 1, y - 1)
        assert picked is not None and np.allclose(embedding_map.pixels[list(embedding_map.ids).index(picked)], (x, y), atol=3)
    assert embedding_map.pick(-100, -100) is None
    assert service.embedding_map("pca") is embedding_map  # drawn once per index version
    points = project_2d(np.random.default_rng(0).normal(size=(40, 8)).astype(np.float32), "tsne")
    assert points.shape == (40, 2) and np.isfinite(points).all()
    with pytest.raises(RetrievalError, match="umap"):
        project_2d(points, "umap")


def test_add_and_remove_are_persisted_and_seen_by_the_next_search(app_run: RunDir, tmp_path: Path) -> None:
    read_only = SearchService(app_run)
    with pytest.raises(RetrievalError, match="--allow-write"):
        read_only.add_images([tmp_path / "x.png"], "x")
    service = SearchService(app_run, allow_write=True)
    new = tmp_path / "new.png"
    Image.new("RGB", (64, 64), (10, 200, 30)).save(new)
    existing = next(iter(service.items.values())).path
    bad = write_bad_files(tmp_path / "bad")
    result = service.add_images([new, existing, bad["truncated"], new], "../../escape")
    ids, skipped = result.ids, result.skipped
    assert len(ids) == 1 and [s.path.name for s in skipped] == [existing.name, "truncated.png", "new.png"]
    added = service.items[ids[0]]
    assert added.label == "../../escape" and added.path.parent.parent == app_run.root / "uploads"  # a label cannot lead out of uploads/
    assert ids[0] not in [hit.id for hit in service.search(new, k=3).hits]  # the query's own bytes are left out
    assert ids[0] in [hit.id for hit in read_only.search(existing, k=len(read_only.items)).hits]  # another reader reloads the new version
    assert ids[0] in SearchService(app_run).items  # persisted
    assert service.remove_items(ids) == 1
    assert ids[0] not in read_only.items and not added.path.exists()
    with pytest.raises(RetrievalError, match="no item with id 999999"):
        service.remove_items([999999])
    count = len(service.items)  # one file or id not in a list: "34" removed items 3 and 4, a path added nothing
    for given, said in [("34", "ids: '34' is text, not a list of item ids; give whole numbers, e.g. [3, 4]"), (3, "ids: a list of item ids, not one id; write [3]"), ([2.5], "ids: 2.5 is not an item id; give whole numbers (the id column of search)")]:
        with pytest.raises(RetrievalError) as refused:
            service.remove_items(given)  # type: ignore[arg-type]
        assert str(refused.value) == said
    with pytest.raises(RetrievalError) as refused:
        service.add_images(str(new), "x")  # type: ignore[arg-type]
    assert str(refused.value) == f"paths: a list of image files, not one file; write [{str(new)!r}]"
    assert len(SearchService(app_run).items) == count


def test_add_and_remove_from_python_take_the_opened_index_its_run_and_text_paths(app_run: RunDir, tmp_path: Path) -> None:
    """add_images(open_index(run), ...) failed in "expected str, bytes or os.PathLike object, not GalleryIndex", uploads
    given as text in "unsupported operand type(s) for /", and a label None in "'NoneType' object has no attribute
    'strip'"."""
    from index import Added, add_images, open_index, remove_items
    from retrieval.embedders import OnnxEmbedder

    embedder = OnnxEmbedder.from_run(app_run)
    new = tmp_path / "magenta.png"
    Image.new("RGB", (64, 64), (200, 10, 130)).save(new)
    count = len(open_index(app_run))
    added = add_images(open_index(app_run), embedder, [new], "magenta", str(tmp_path / "uploads"))
    assert isinstance(added, Added) and len(added.ids) == 1 and not added.skipped and len(list((tmp_path / "uploads" / "magenta").iterdir())) == 1
    with pytest.raises(RetrievalError) as refused:
        add_images(app_run, embedder, [new], None, tmp_path / "uploads")  # type: ignore[arg-type]
    assert str(refused.value) == 'label: None is not text; give the images\' label, or "" for none'
    with pytest.raises(RetrievalError, match="^index: 5 is a int; give the index's folder, its run's RunDir or"):
        remove_items(5, embedder, added.ids)  # type: ignore[arg-type]
    assert remove_items(open_index(app_run), embedder, added.ids, str(tmp_path / "uploads")) == 1
    service = SearchService(app_run)
    with pytest.raises(RetrievalError, match=r"^ids: 'abc' is not an item id; give whole numbers"):
        service.search_item("abc")  # type: ignore[arg-type]  # it failed in int()
    service.close()
    assert len(open_index(app_run)) == count and not any((tmp_path / "uploads").rglob("*.png"))


def test_an_index_job_and_the_app_take_turns(app_run: RunDir, service: SearchService, tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from index.disk import writer_lock; import time\nwith writer_lock(__import__('pathlib').Path({str(service.index_dir)!r})):\n    print('held', flush=True); time.sleep(30)"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(RetrievalError, match="another writer"):
            with writer_lock(service.index_dir, timeout=0.3):
                pass
    finally:
        holder.kill()
        holder.wait()
    folder = tmp_path / "more" / "green"
    folder.mkdir(parents=True)
    Image.new("RGB", (64, 64), (20, 180, 20)).save(folder / "a.png")
    before = len(service.items)
    build_index(service.embedder, load_collection(tmp_path / "more"), service.index_dir, progress=False)  # a `retrieval index` job meanwhile
    assert len(service.items) == before + 1  # the app reloads the new version by itself
    service.remove_items([max(service.items)])


# the served app


def test_every_endpoint_answers(client: object, service: SearchService) -> None:
    from gradio_client import handle_file

    item_id, item = next(iter(service.items.items()))
    gallery, summary = client.predict(handle_file(str(item.path)), 4, item.label, 0, api_name="/search")  # type: ignore[attr-defined]
    assert len(gallery) == 4 and "4 results" in summary and gallery[0]["caption"].split(" · ")[0] in ("HIT", "miss")
    gallery, _ = client.predict(handle_file(str(item.path)), 5, item.label, 0, True, api_name="/search")  # type: ignore[attr-defined]
    assert gallery and all(entry["caption"].startswith("HIT") for entry in gallery)  # only items of the query's label
    gallery, summary = client.predict(item_id, 3, 0, api_name="/search_id")  # type: ignore[attr-defined]
    assert len(gallery) == 3 and summary.startswith(f"item {item_id}")
    with pytest.raises(Exception, match="no item with id 999999"):
        client.predict(999999, 3, 0, api_name="/search_id")  # type: ignore[attr-defined]
    table = client.predict(api_name="/labels")  # type: ignore[attr-defined]
    assert sum(count for _, count in table["data"]) == len(service.items)
    assert len(client.predict(item.label, api_name="/browse")) == dict(service.label_counts())[item.label]  # type: ignore[attr-defined]
    metrics, plots = client.predict(api_name="/evaluate")  # type: ignore[attr-defined]
    assert "recall@1" in {row[0] for row in metrics["data"]} and len(plots) == 6
    assert Path(client.predict("pca", api_name="/embedding_map")).stat().st_size > 0  # type: ignore[attr-defined]
    assert metrics_rows(None)[0][0] == "(no metrics yet)"


def test_bad_uploads_get_a_message_and_the_server_keeps_serving(client: object, service: SearchService, tmp_path: Path) -> None:
    from gradio_client import handle_file

    bad = write_bad_files(tmp_path / "bad")
    messages = {
        "empty": "empty file",
        "truncated": "image file is truncated",
        "text": "not a readable image",
    }
    for name, message in messages.items():
        gallery, summary = client.predict(handle_file(str(bad[name])), 4, "", 0, api_name="/search")  # type: ignore[attr-defined]
        assert gallery == [] and message in summary, (name, summary)
    gallery, summary = client.predict(handle_file(str(write_bomb(tmp_path / "bomb.png"))), 4, "", 0, api_name="/search")  # type: ignore[attr-defined]
    assert gallery == [] and "10000x10000 pixels is over the limit" in summary
    for name, path in write_odd_images(tmp_path / "odd").items():
        gallery, summary = client.predict(handle_file(str(path)), 2, "", 0, api_name="/search")  # type: ignore[attr-defined]
        assert len(gallery) == 2, (name, summary)
    huge = tmp_path / "huge.png"
    huge.write_bytes(np.random.default_rng(0).bytes(2 * 1024 * 1024))  # over the 1 MB limit of this app
    with pytest.raises(Exception, match="(?i)file.*(large|size)"):
        client.predict(handle_file(str(huge)), 4, "", 0, api_name="/search")  # type: ignore[attr-defined]
    gallery, _ = client.predict(handle_file(str(next(iter(service.items.values())).path)), 3, "", 0, api_name="/search")  # type: ignore[attr-defined]
    assert len(gallery) == 3  # still serving


def test_concurrent_queries_are_batched(client: object, service: SearchService) -> None:
    from gradio_client import handle_file

    paths = [item.path for item in list(service.items.values())[:16]]
    jobs = [client.submit(handle_file(str(path)), 3, "", 0, api_name="/search") for path in paths]  # type: ignore[attr-defined]
    answers = [job.result(timeout=120) for job in jobs]
    assert all(len(gallery) == 3 for gallery, _ in answers)
    assert any("a batch of" in summary for _, summary in answers)


def test_only_the_apps_own_files_are_served(client: object, service: SearchService, app_run: RunDir) -> None:
    from gradio_client import Client, handle_file

    item = next(iter(service.items.values()))
    base = client.src.rstrip("/")  # type: ignore[attr-defined]
    gallery, _ = Client(base, verbose=False, download_files=False).predict(handle_file(str(item.path)), 2, "", 0, api_name="/search")  # the server's paths

    def status(path: str) -> int:
        try:
            with urllib.request.urlopen(f"{base}/gradio_api/file={path}") as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code

    assert status(gallery[0]["image"]["path"]) == 200 and status(str(service.thumbnails([next(iter(service.items))])[0])) == 200
    other_app = Path(tempfile.gettempdir()) / "gradio" / "another-app" / f"upload-{os.getpid()}.txt"  # Gradio's shared folder
    other_app.parent.mkdir(parents=True, exist_ok=True)
    other_app.write_text("another Gradio app's upload")
    try:
        refused = ["/etc/passwd", str(item.path), str(app_run.model), str(service.index_dir / "items.sqlite"), f"{service.cache}/../../etc/passwd", "README.md", "%2e%2e/%2e%2e/etc/passwd", str(other_app)]
        assert {path: status(path) for path in refused} == {path: 403 for path in refused}
    finally:
        other_app.unlink()


def test_an_idle_server_looks_for_new_events_every_10_ms(service: SearchService) -> None:
    """Gradio's queue looked for new events every millisecond while it had none: a thousand wake-ups a second, 3-4 %
    of a core for a server nobody was using (bench/app_load.py --idle)."""
    import inspect

    from gradio.queueing import Queue

    assert "self.sleep_when_free" in inspect.getsource(Queue.start_processing)  # the setting Gradio's loop reads
    server = launch(service, port=free_port(), block=False)
    try:
        assert mounted_blocks(server)._queue.sleep_when_free == IDLE_POLL_SECONDS == 0.01
    finally:
        server.close()


def mounted_blocks(server: Server) -> gr.Blocks:
    """The Gradio app a server serves."""
    (mounted,) = [route.app for route in server.server.config.app.routes if hasattr(route.app, "get_blocks")]
    return mounted.get_blocks()


def call_search_route(url: str, image: Path) -> list:
    """What curl does with the app's /search: upload the file, start a call (no session), read its event stream."""
    import httpx

    uploaded = httpx.post(f"{url}gradio_api/upload", files={"files": ("query.png", image.read_bytes(), "image/png")})
    data = [{"path": uploaded.json()[0], "meta": {"_type": "gradio.FileData"}}, 3, "", 0, False]
    event = httpx.post(f"{url}gradio_api/call/search", json={"data": data}).json()["event_id"]
    stream = httpx.get(f"{url}gradio_api/call/search/{event}", timeout=60).text
    return json.loads(stream.split("event: complete", 1)[1].split("data:", 1)[1].strip().splitlines()[0])


def test_calls_without_a_session_do_not_pile_up_in_memory(service: SearchService, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call of the Gradio route without a session (curl, a script's POST) opened a session that Gradio kept,
    about 160 KiB of component settings each, up to 10,000 sessions: 1.9 GB more for a server that scripts query.
    The server keeps the sessions used last; a browser's or a client's session pushed out starts afresh."""
    from gradio_client import Client, handle_file

    import app.components

    assert app.components.SESSIONS_KEPT == 1_000
    monkeypatch.setattr(app.components, "SESSIONS_KEPT", 3)
    port = free_port()
    server = launch(service, port=port, block=False)
    try:
        url, image = f"http://127.0.0.1:{port}/", next(iter(service.items.values())).path
        client = Client(url, verbose=False)  # a session of its own, like a browser's
        assert len(client.predict(handle_file(str(image)), 3, "", 0, api_name="/search")[0]) == 3
        for _ in range(6):
            assert len(call_search_route(url, image)[0]) == 3
        assert len(mounted_blocks(server).state_holder.session_data) == 3  # Gradio kept all 7
        assert len(client.predict(handle_file(str(image)), 3, "", 0, api_name="/search")[0]) == 3  # pushed out, works
    finally:
        server.close()


def test_authentication_and_binding(service: SearchService, monkeypatch: pytest.MonkeyPatch) -> None:
    from gradio_client import Client

    assert loopback("127.0.0.1") and loopback("localhost") and loopback("::1") and not loopback("0.0.0.0")
    with pytest.raises(RetrievalError, match="--auth"):
        launch(service, host="0.0.0.0", port=free_port(), block=False)
    with pytest.raises(RetrievalError, match="user:password"):
        parse_auth("nopassword")
    with pytest.raises(RetrievalError, match="--auth is empty"):  # it served without a password
        parse_auth("")
    monkeypatch.setenv("RETRIEVAL_AUTH", "ann:secret")
    assert parse_auth(None) == ("ann", "secret")
    port = free_port()
    demo = launch(service, port=port, block=False)
    try:
        with pytest.raises(Exception):
            Client(f"http://127.0.0.1:{port}/", verbose=False).predict(api_name="/labels")
        table = Client(f"http://127.0.0.1:{port}/", auth=("ann", "secret"), verbose=False).predict(api_name="/labels")
        assert table["data"]
    finally:
        demo.close()
    assert parse_ids("3, 7 12") == [3, 7, 12]
    with pytest.raises(RetrievalError, match="ids"):
        parse_ids("three")


def test_add_and_remove_through_the_api(client: object, service: SearchService, tmp_path: Path) -> None:
    from gradio_client import handle_file

    paths = [tmp_path / "red.png", tmp_path / "blue.png"]
    for path, colour in zip(paths, ((220, 20, 20), (20, 20, 220))):
        Image.new("RGB", (64, 64), colour).save(path)
    before = len(service.items)
    message, table = client.predict([handle_file(str(path)) for path in paths], "swatch", api_name="/add")  # type: ignore[attr-defined]
    assert message.startswith("added 2 images") and ["swatch", 2] in table["data"] and len(service.items) == before + 2
    new_ids = sorted(service.items)[-2:]
    message, table = client.predict(", ".join(map(str, new_ids)), api_name="/remove")  # type: ignore[attr-defined]
    assert message == "removed 2 items" and len(service.items) == before
    with pytest.raises(Exception, match="give item ids"):
        client.predict("all of them", api_name="/remove")  # type: ignore[attr-defined]


def test_a_service_given_a_threshold_no_similarity_can_have_or_a_rerank_as_text_is_refused(app_run: RunDir) -> None:
    """SearchService(run, threshold=5) served every hit as no match (and "0.5" failed at the first search)."""
    for threshold in (5, "0.5"):
        with pytest.raises(RetrievalError, match="give a cosine similarity between -1 and 1"):
            SearchService(app_run, threshold=threshold)  # type: ignore[arg-type]
    with pytest.raises(RetrievalError, match=r"rerank='qe': give a Rerank, e.g. retrieval.rerank.parse_rerank\('qe'\)"):
        SearchService(app_run, rerank="qe")  # type: ignore[arg-type]  # no attribute 'describe', at the first search


def test_hits_whose_files_are_gone_are_said_and_shown_again_once_back(service: SearchService, tmp_path: Path) -> None:
    """A gallery moved after indexing showed grey tiles without a word, and the grey tile was kept as the image's
    thumbnail: a file moved back stayed grey until the server restarted."""
    from app.handlers import Handlers

    paths = [tmp_path / "a.png", tmp_path / "b.png"]
    for path, shade in zip(paths, (10, 14)):
        Image.new("RGB", (64, 64), (shade, 200, shade)).save(path)
    ids = service.add_images(paths, "moved").ids
    try:
        copies = {item_id: service.items[item_id].path for item_id in ids}
        away = {item_id: path.rename(tmp_path / f"away-{item_id}.png") for item_id, path in copies.items()}
        summary = Handlers(service).search_id(ids[0], 3, None)[1]
        assert f"1 hit shown grey: its file cannot be read (e.g. {copies[ids[1]]}); moved or deleted since it was" in summary
        assert "index their folder again with `--sync`" in summary
        away[ids[1]].rename(copies[ids[1]])  # moved back
        tile = service.thumbnails([ids[1]])[0]
        assert tile.name != "lost.jpg" and Image.open(tile).getpixel((5, 5))[1] > 150
        assert "shown grey" not in Handlers(service).search_id(ids[0], 3, None)[1]
    finally:
        away[ids[0]].rename(copies[ids[0]])
        service.remove_items(ids)


def test_a_read_only_app_has_no_write_endpoints(app_run: RunDir) -> None:
    from gradio_client import Client

    service = SearchService(app_run)
    port = free_port()
    demo = launch(service, port=port, block=False)
    try:
        endpoints = Client(f"http://127.0.0.1:{port}/", verbose=False).view_api(return_format="dict", print_info=False)["named_endpoints"]
        assert set(endpoints) == {"/search", "/search_id", "/labels", "/browse", "/evaluate", "/embedding_map", "/audit"}  # /audit only reads
        returned = {name: [part["label"] for part in endpoint["returns"]] for name, endpoint in endpoints.items()}
        assert returned["/search"][1] == returned["/search_id"][1] == returned["/audit"][1] == "summary" and returned["/embedding_map"] == ["map"]
        assert all(label for labels in returned.values() for label in labels)  # gradio_client named unlabelled ones value_14
    finally:
        demo.close()
        service.close()


def test_service_threads_are_thread_safe_for_readers(service: SearchService) -> None:
    item_id = next(iter(service.items))
    failures: list[BaseException] = []

    def read() -> None:
        try:
            for _ in range(20):
                assert len(service.search_item(item_id, 3).hits) == 3
        except BaseException as error:  # noqa: BLE001 - collected for the main thread
            failures.append(error)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_freed_memory_is_handed_back_periodically(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.memory as memory

    calls: list[int] = []
    three, never = threading.Event(), threading.Event()

    class FakeLibc:
        def malloc_trim(self, pad: int) -> int:
            calls.append(pad)
            if len(calls) == 3:
                three.set()
                never.wait()  # parks the test's thread for good
            return 1

    memory._trimming.cache_clear()
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: FakeLibc())
    thread = memory.release_memory_periodically(0.01)
    assert thread is not None and thread.daemon and memory.release_memory_periodically(0.01) is thread  # one per process
    assert three.wait(5)
    assert calls == [0, 0, 0]


def test_the_memory_release_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    import app.memory as memory

    memory._trimming.cache_clear()
    monkeypatch.setenv("RETRIEVAL_TRIM_SECONDS", "0")
    assert memory.release_memory_periodically() is None
    monkeypatch.setenv("RETRIEVAL_TRIM_SECONDS", "often")
    with pytest.raises(RetrievalError, match="RETRIEVAL_TRIM_SECONDS='often'"):
        memory.release_memory_periodically()


def test_a_client_that_stays_connected_does_not_hold_the_server_open(service: SearchService) -> None:
    """A browser tab or a gradio_client keeps an event stream open that never ends by itself: Ctrl+C waited the whole
    10 s of the server thread's join for it, and then left the thread serving."""
    from gradio_client import Client

    port = free_port()
    server = launch(service, port=port, block=False)
    client = Client(f"http://127.0.0.1:{port}/", verbose=False)
    try:
        server.close()
        assert not server.thread.is_alive()
    finally:
        client.close()


def test_a_stopped_server_leaves_no_cache_folder(app_run: RunDir, icons_root: Path, tmp_path: Path) -> None:
    """SIGTERM (systemd, docker stop) ends `retrieval serve` like Ctrl+C: its thumbnails folder is removed, and so is
    Gradio's folder with the uploaded query images and its copies of the results (kept in /tmp/gradio for good)."""
    from gradio_client import Client, handle_file

    port = free_port()
    retrieval = str(Path(sys.executable).with_name("retrieval"))
    environment = {key: value for key, value in os.environ.items() if key != "GRADIO_TEMP_DIR"} | {"TMPDIR": str(tmp_path)}
    server = subprocess.Popen([retrieval, "serve", str(app_run.root), "--port", str(port)], env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("retrieval-app-*")) or not answers(f"http://127.0.0.1:{port}/"):
            assert server.poll() is None and time.monotonic() < deadline, server.stderr.read() if server.stderr else ""
            time.sleep(0.5)
        query = next((icons_root / "test").rglob("*.png"))
        results, _ = Client(f"http://127.0.0.1:{port}/", verbose=False, download_files=False).predict(handle_file(str(query)), 3, "", 0, api_name="/search")
        assert len(results) == 3 and [folder.name[:17] for folder in tmp_path.glob("retrieval-gradio-*")] == ["retrieval-gradio-"]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        stderr = server.stderr.read() if server.stderr else ""
        assert "Traceback" not in stderr and "ERROR" not in stderr, stderr  # the client's open stream dropped quietly
    finally:
        server.kill()
    assert not list(tmp_path.glob("retrieval-app-*")) and not list(tmp_path.glob("retrieval-gradio-*"))
    assert [path for path in tmp_path.rglob("*") if path.suffix in (".png", ".jpg", ".jpeg", ".webp")] == []
    assert not (tmp_path / "gradio").exists()  # Gradio's shared folder: its vibe_edit_history was made at every start


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2):
            return True
    except OSError:
        return False


def test_text_in_the_summary_is_shown_whole() -> None:
    """A label or message with <...> lost it in the app's Markdown (read as an HTML tag)."""
    from app.service import worded
    from index.search import QueryResult
    from index.types import Hit
    from retrieval.errors import ErrorKind, Failure

    hits = [Hit(1, "/g/a.png", "<cat>", 0.9, ""), Hit(2, "/g/b.png", "dog", 0.8, "")]
    shown = worded(QueryResult(hits, notes=["a <note> & more"]), "<cat>", frozenset({"<cat>", "dog"}))
    assert "label **&lt;cat&gt;**: 1/2 hits" in shown.summary and "(a &lt;note&gt; &amp; more)" in shown.summary
    failed = worded(QueryResult(error=Failure(ErrorKind.INVALID, "put images in ROOT/<label>/<image>")), "")
    assert failed.summary == "⚠️ put images in ROOT/&lt;label&gt;/&lt;image&gt;"
