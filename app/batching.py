"""Image queries from concurrent callers answered in batches: one embedding call for all that queued up.

The app's searches (each Gradio event in its own worker thread) and the JSON API's requests submit
to one Batcher per search service; a worker thread takes whatever has queued up, up to max_batch
queries, and answers them with one call of the one search path, so that concurrent users share
the encoder's call instead of queueing for it one by one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future

from index.search import ImageQuery, Query, QueryResult
from retrieval.errors import Failure

# answer(images, queries) -> one result per query, in order (the service's search on its current index)
Answer = Callable[[Sequence[ImageQuery | Failure], Sequence[Query]], list[QueryResult]]
_STOP = None  # put on the queue to end the worker


class Batcher:
    """A queue of (image, query, future) and the worker thread that answers them in batches (started on first use)."""

    def __init__(self, answer: Answer, max_batch: int) -> None:
        self.answer = answer
        self.max_batch = max(1, max_batch)
        self.waiting: queue.Queue[tuple[ImageQuery | Failure, Query, Future] | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._starting = threading.Lock()

    def submit(self, image: ImageQuery | Failure, query: Query) -> Future:
        """A future of the query's QueryResult (or of the exception that its whole batch met)."""
        with self._starting:
            if self._worker is None:
                self._worker = threading.Thread(target=self._loop, name="search-batcher", daemon=True)
                self._worker.start()
        future: Future = Future()
        self.waiting.put((image, query, future))
        return future

    def close(self) -> None:
        """Ends the worker once the queries before it are answered."""
        if self._worker is not None:
            self.waiting.put(_STOP)

    def _loop(self) -> None:
        while (first := self.waiting.get()) is not _STOP:
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    following = self.waiting.get_nowait()
                except queue.Empty:
                    break
                if following is _STOP:
                    self.waiting.put(_STOP)  # answered after this batch
                    break
                batch.append(following)
            try:
                found = self.answer([image for image, _, _ in batch], [query for _, query, _ in batch])
                for (_, _, future), result in zip(batch, found):
                    future.set_result(result)
            except Exception as error:  # handed to each caller, which words it; the worker lives on
                for _, _, future in batch:
                    future.set_exception(error)
