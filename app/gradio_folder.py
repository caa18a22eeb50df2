"""Gradio's folder for uploads and its copies of the images it shows: one of this process's own, removed when it
exits. Without Gradio, so that `retrieval serve` can set it before Gradio is imported: Gradio reads the folder
then for some of its paths (it made /tmp/gradio/vibe_edit_history at every start otherwise)."""

from __future__ import annotations

import functools
import os
import tempfile

GRADIO_FOLDER = "GRADIO_TEMP_DIR"  # the variable Gradio reads


def use_own_gradio_folder() -> None:
    """Has Gradio keep uploads and its copies of the images it shows in a folder of this process's own, removed
    when the process exits (its servers with it); GRADIO_TEMP_DIR, where it is set, is left as it is.

    Gradio's default is the shared /tmp/gradio, never emptied: every query image uploaded and a copy of every image
    shown stayed there after the server had stopped (359 files after five searches of a 176-label gallery)."""
    if not os.environ.get(GRADIO_FOLDER):
        os.environ[GRADIO_FOLDER] = _own_folder().name


@functools.cache
def _own_folder() -> tempfile.TemporaryDirectory:
    """This process's Gradio folder, made once and kept (removed at exit, by its finalizer)."""
    return tempfile.TemporaryDirectory(prefix="retrieval-gradio-", ignore_cleanup_errors=True)
