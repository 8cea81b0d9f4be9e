"""Sub-word text for language models: a byte-level BPE tokenizer, packing and buckets.

Nothing here downloads anything. The corpus is the one :func:`pdjax.apps.data.bpe`
reads, CPython's bundled documentation (``pydoc_data.topics.topics``), taken here as
documents: one per topic, in sorted key order (79 documents, 465k characters on CPython
3.11). Whole documents are split into training and test sets with a seed
(:func:`split_documents`), so no test document shares text with a training one.

The tokenizer is a byte-level BPE trained with Hugging Face's ``tokenizers`` library
(an optional dependency: ``pip install 'pdjax[text]'``) on the **training documents
only**, so held-out text is unseen by the tokenizer as well as by the model; being
byte-level, it still encodes any text, test text included, and decodes it back exactly.
(tiktoken's encodings cannot serve here: its wheel ships none, it downloads them at
first use.)
Training is deterministic: the same texts and settings give the same tokenizer JSON,
byte for byte, in any process. Its identity is the SHA-256 of that JSON
(:attr:`BPETokenizer.fingerprint`), which a checkpoint can store and
:func:`check_tokenizer` compares. Trained tokenizers are cached on disk, keyed by a hash
of the texts and settings (:func:`train_tokenizer`).

Two ways to make examples:

* :func:`text_bpe` packs: documents are tokenised, joined with ``<|endoftext|>`` after
  each one, and cut into windows of ``seq_len + 1`` tokens at stride ``seq_len``
  (inputs the first ``seq_len``, targets the last ``seq_len``): no padding, a
  :class:`~pdjax.apps.data.dataset.Dataset` like :func:`pdjax.apps.data.bpe`'s.
* :func:`text_bpe_buckets` keeps documents apart: each document, framed by
  ``<|endoftext|>`` on both sides, is cut into pieces of at most the largest bucket's
  length and each piece padded up to the smallest bucket that holds it
  (:func:`bucket_examples`). Padded inputs hold ``<|pad|>``, padded targets
  :data:`IGNORE` (``-1``); batches hold one bucket each (:meth:`Buckets.batches`).

Loss convention for buckets: padding is always on the right, so in a causal model no
real position attends to a pad; a padded position's target is :data:`IGNORE` and must
carry zero weight. Average the token losses over the real targets of the whole batch,
``sum(loss * (targets >= 0)) / sum(targets >= 0)`` (not the mean of per-row means), so
every real token counts the same whichever bucket it landed in.

>>> ds = text_bpe(seq_len=32, vocab_size=300, cache=False)
>>> ds.name, ds.vocab_size, ds.train_x.shape[1], ds.train_x.dtype
('text-bpe', 300, 32, dtype('int32'))
>>> bool((ds.train_y[:, :-1] == ds.train_x[:, 1:]).all())
True
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import numbers
import os
import platform
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdjax._jsonio import read_regular, write_atomic
from pdjax.apps import data as data_lib
from pdjax.apps.data.dataset import Dataset, eval_batches, generator
from pdjax.errors import DataError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_BUCKETS",
    "DEFAULT_VOCAB_SIZE",
    "EOT",
    "IGNORE",
    "PAD",
    "SPECIAL_TOKENS",
    "BPETokenizer",
    "Bucket",
    "Buckets",
    "Document",
    "bucket_examples",
    "check_tokenizer",
    "decode",
    "default_cache_dir",
    "document_examples",
    "documents",
    "pack",
    "split_documents",
    "text_bpe",
    "text_bpe_buckets",
    "tokenizer_fingerprint",
    "train_tokenizer",
]

#: End of document: written after every document when packing, and before and after
#: each document in buckets. Token id 0.
EOT = "<|endoftext|>"
#: Padding of bucketed inputs (never a target). Token id 1.
PAD = "<|pad|>"
#: The special tokens, in id order.
SPECIAL_TOKENS = (EOT, PAD)
#: Target of a padded position in a bucket: weight it zero in the loss.
IGNORE = -1
#: The vocabulary size :func:`text_bpe` trains for by default.
DEFAULT_VOCAB_SIZE = 1024
#: Bucket lengths (positions per example) of :func:`text_bpe_buckets` by default.
DEFAULT_BUCKETS = (64, 128, 256, 512)

# The training recipe's version, part of every cache key: change it with the recipe
# (pre-tokenizer, trainer settings, special tokens) so no cached tokenizer outlives it.
_RECIPE = 1
_MIN_FREQUENCY = 2
_NUM_BYTES = 256
# A cache entry is read only up to this size: a megabyte, and a kilobyte an id (pdjax's
# entries hold about 30 bytes an id).
_ENTRY_BASE_BYTES = 1 << 20
_ENTRY_BYTES_PER_ID = 1 << 10


# -- the corpus -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of the corpus: a ``pydoc_data`` topic's key and text."""

    key: str
    text: str


def documents() -> tuple[Document, ...]:
    """The corpus: one :class:`Document` per ``pydoc_data.topics`` topic, by sorted key.

    Its content (and so its size) depends on the Python version.

    >>> docs = documents()
    >>> docs[0].key
    'assert'
    """
    from pydoc_data.topics import topics

    return tuple(Document(key, topics[key]) for key in sorted(topics))


def split_documents(
    docs: Sequence[Document], seed: int = 0, test_fraction: float = 0.1
) -> tuple[tuple[Document, ...], tuple[Document, ...]]:
    """Whole documents split into ``(train, test)``, chosen with ``seed``.

    The documents are visited in a permutation drawn from ``seed``; each joins the test
    set if it still fits in ``test_fraction`` of the corpus's characters (the first
    visited one joins in any case), so the test set holds at most about that share of
    the text whatever the documents' sizes (they range from 200 to 62k characters). Both
    sets keep the documents' given order, and every document is in exactly one.

    Raises:
      DataError: for a bad ``test_fraction`` or ``seed``, or fewer than 2 documents.
    """
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    if len(docs) < 2:
        raise DataError(f"a train/test split needs at least 2 documents, got {len(docs)}")
    budget = test_fraction * sum(len(d.text) for d in docs)
    taken = 0
    test: set[int] = set()
    for i in generator(seed).permutation(len(docs)).tolist():
        size = len(docs[i].text)
        if not test or taken + size <= budget:
            test.add(i)
            taken += size
    if len(test) == len(docs):  # only possible for tiny corpora: keep one to train on
        test.discard(max(test))
    train = tuple(d for i, d in enumerate(docs) if i not in test)
    return train, tuple(d for i, d in enumerate(docs) if i in test)


# -- the tokenizer ----------------------------------------------------------------------------


def _tokenizers() -> Any:
    try:
        import tokenizers
    except ImportError as e:
        raise DataError(
            "BPE text needs the tokenizers library (nothing is downloaded at run time); "
            "install it with: pip install 'pdjax[text]'"
        ) from e
    return tokenizers


def tokenizer_fingerprint(tokenizer_json: str) -> str:
    """A tokenizer's identity: ``"sha256:"`` and the hex SHA-256 of its JSON text."""
    return "sha256:" + hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class BPETokenizer:
    """A trained byte-level BPE tokenizer: its JSON (``tokenizers``' own format) and how
    it was obtained.

    Attributes:
      json: the tokenizer's JSON text, as ``tokenizers`` serialises it.
      origin: ``"trained"``, ``"cache"`` (read from the cache), or ``"retrained"`` (a
        cached file did not match its key or its fingerprint, and was replaced).
    """

    json: str
    origin: str = "trained"

    @functools.cached_property
    def fingerprint(self) -> str:
        """:func:`tokenizer_fingerprint` of :attr:`json`: store it with a checkpoint."""
        return tokenizer_fingerprint(self.json)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        """The ``tokenizers.Tokenizer``. Special-token strings inside the text are
        encoded as plain text: only pdjax inserts :data:`EOT` and :data:`PAD`."""
        tok: Tokenizer = _tokenizers().Tokenizer.from_str(self.json)
        tok.encode_special_tokens = True
        return tok

    @property
    def vocab_size(self) -> int:
        """Ids in the vocabulary (special tokens, the 256 bytes, and the merges)."""
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def eot_id(self) -> int:
        """The id of :data:`EOT`."""
        return self._special(EOT)

    @property
    def pad_id(self) -> int:
        """The id of :data:`PAD`."""
        return self._special(PAD)

    def _special(self, token: str) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise DataError(f"the tokenizer {self.fingerprint} has no {token!r} token")
        return int(tid)

    def encode(self, text: str) -> np.ndarray:
        """The int32 token ids of ``text`` (no special tokens added)."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """:meth:`encode` of each text, in order."""
        out = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in out]

    def decode(self, ids: np.ndarray | Sequence[int]) -> str:
        """The text of token ids; special tokens read as their strings, negative ids
        (:data:`IGNORE`) are left out. A window cut inside a multi-byte character shows
        ``"\\ufffd"`` there."""
        flat = [int(t) for t in np.asarray(ids).reshape(-1).tolist() if t >= 0]
        return str(self.tokenizer.decode(flat, skip_special_tokens=False))


def default_cache_dir() -> Path:
    """Where trained tokenizers are cached: ``$XDG_CACHE_HOME/pdjax/tokenizers``, or
    ``~/.cache/pdjax/tokenizers``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdjax" / "tokenizers"


def _cache_key(texts: Sequence[str], vocab_size: int, version: str) -> str:
    h = hashlib.sha256()
    settings = {
        "recipe": _RECIPE,
        "tokenizers": version,
        "vocab_size": vocab_size,
        "min_frequency": _MIN_FREQUENCY,
        "special_tokens": list(SPECIAL_TOKENS),
        "documents": len(texts),
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    for t in texts:  # length-prefixed, so different splits of one text hash differently
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _train(texts: Sequence[str], vocab_size: int) -> str:
    tk = _tokenizers()
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=_MIN_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(texts), trainer=trainer)
    return str(tok.to_str())


@functools.cache
def _recipe_json() -> dict[str, Any]:
    """The recipe's tokenizer before any merge (trained on no text): the settings every
    tokenizer of the recipe has, and its first ids, :data:`EOT`, :data:`PAD` and the
    256 bytes."""
    got: dict[str, Any] = json.loads(_train([""], len(SPECIAL_TOKENS) + _NUM_BYTES))
    return got


def _not_asked_for(tok_json: str, vocab_size: int) -> str | None:
    """Why the tokenizer JSON ``tok_json`` is not one the recipe trains for ``vocab_size``
    ids, or None if it is: every setting the recipe's (pre-tokenizer, decoder, special
    tokens, model options), ``vocab_size`` ids, the first being :data:`EOT`, :data:`PAD`
    and the 256 bytes at the recipe's ids, and the merge ``i`` making id ``258 + i`` from
    two tokens before it. (Which texts it was trained on cannot be seen without training
    again: that is the cache key's, and the fingerprint's.)"""
    try:
        got = json.loads(tok_json)
    except (ValueError, RecursionError):
        return "its tokenizer is not JSON"
    recipe = _recipe_json()
    if not isinstance(got, dict) or got.keys() != recipe.keys():
        return "it is not a tokenizer of pdjax's recipe"
    for field in recipe:
        if field != "model" and got[field] != recipe[field]:
            return f"its {field!r} is not the recipe's"
    model, want = got["model"], recipe["model"]
    if not isinstance(model, dict) or model.keys() != want.keys():
        return "its model is not the recipe's (a byte-level BPE)"
    for field in want:
        if field not in ("vocab", "merges") and model[field] != want[field]:
            return f"its model's {field!r} is not the recipe's"
    vocab, merges = model["vocab"], model["merges"]
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        return "its vocabulary or merges are not a mapping and a list"
    if len(vocab) != vocab_size:
        return f"it has {len(vocab)} ids, not the {vocab_size} asked for"
    base = want["vocab"]
    if any(vocab.get(token) != i for token, i in base.items()):
        return f"its first {len(base)} ids are not {EOT}, {PAD} and the 256 bytes"
    if len(merges) != vocab_size - len(base):
        return f"it has {len(merges)} merges for {vocab_size - len(base)} merged ids"
    token_of = {i: t for t, i in vocab.items() if isinstance(i, int) and not isinstance(i, bool)}
    if sorted(token_of) != list(range(vocab_size)):
        return f"its ids are not 0 to {vocab_size - 1}, each once"
    for i, merge in enumerate(merges):
        made = len(base) + i
        pair = merge.split(" ") if isinstance(merge, str) else merge
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(p, str) and vocab.get(p, made) < made for p in pair)
            and token_of[made] == pair[0] + pair[1]
        ):
            return f"its merge {i} does not make id {made} from two tokens before it"
    return None


def _read_cache(
    path: Path, key: str, vocab_size: int, version: str
) -> tuple[str | None, bool, str]:
    """What the cache entry at ``path`` holds: ``(tokenizer JSON, ours, why not)``.

    The JSON is returned (``why not`` empty) only for an entry that is the tokenizer asked
    for: a regular file (no link followed, no FIFO or device read, at most a size bound)
    whose JSON names ``key``, the recipe, ``vocab_size`` and ``version``, whose tokenizer
    still has the fingerprint it was written with, and is a tokenizer of the recipe for
    ``vocab_size`` ids (:func:`_not_asked_for`). ``ours``: the file is a pdjax entry for
    ``key`` (its JSON names the key and a recipe), which may be replaced."""
    limit = _ENTRY_BASE_BYTES + _ENTRY_BYTES_PER_ID * vocab_size
    try:
        raw = read_regular(path, "tokenizer cache entry", DataError, max_bytes=limit)
        entry = json.loads(raw.decode("utf-8"))
    except DataError as e:  # "cannot read ... <path>: <what is there>; <advice>"
        return None, False, str(e).split(f"{path}: ", 1)[-1].split("; ")[0]
    except (ValueError, RecursionError):  # UnicodeDecodeError, JSONDecodeError
        return None, False, "it is not JSON"
    if not isinstance(entry, dict) or entry.get("key") != key or "recipe" not in entry:
        return None, False, "it does not name this cache key"
    tok_json = entry.get("tokenizer")
    if not isinstance(tok_json, str) or entry.get("fingerprint") != tokenizer_fingerprint(tok_json):
        return None, True, "its tokenizer does not have the fingerprint written with it"
    for field, want in (("recipe", _RECIPE), ("vocab_size", vocab_size), ("tokenizers", version)):
        if entry.get(field) != want or type(entry.get(field)) is not type(want):
            return None, True, f"its {field} is not {want!r}"
    why = _not_asked_for(tok_json, vocab_size)
    if why is not None:
        return None, True, why
    try:
        _tokenizers().Tokenizer.from_str(tok_json)  # parses as a tokenizer too
    except Exception as e:  # tokenizers raises its own exception types
        return None, True, f"its tokenizer does not load ({e})"
    return tok_json, True, ""


def _write_cache(path: Path, entry: dict[str, Any]) -> None:
    """Writes ``entry`` to ``path`` atomically (:func:`pdjax._jsonio.write_atomic`: a
    temporary file, then a rename; never over a link, a FIFO or a device); a cache that
    cannot be written is skipped (the tokenizer is still returned)."""
    try:
        write_atomic(path, json.dumps(entry), what="tokenizer cache entry", error=DataError)
    except DataError:
        pass


def train_tokenizer(
    texts: Sequence[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache: bool = True,
) -> BPETokenizer:
    """A byte-level BPE tokenizer trained on ``texts``, or the cached one.

    The recipe: GPT-2's byte-level pre-tokenizer (its regular expression, no prefix
    space, no normalisation, so decoding gives the text back exactly), the 256 bytes as
    the initial alphabet (any text encodes), :data:`EOT` and :data:`PAD` as ids 0 and 1,
    and merges of pairs seen at least twice until ``vocab_size`` ids (fewer if the texts
    run out of such pairs). The result depends only on the texts, ``vocab_size`` and the
    ``tokenizers`` version, not on the process or its threads.

    With ``cache`` the tokenizer JSON is kept in ``cache_dir/bpe-<key>.json``, ``key``
    being a SHA-256 of the texts, the settings, the recipe and the ``tokenizers``
    version; a later call with the same inputs reads it instead of training. A cached
    file is used only if it is the tokenizer asked for: a regular file (a symbolic link
    there is not followed, a FIFO or a device not read, a file past a size bound not
    read) that names that key, the recipe, ``vocab_size`` and the ``tokenizers`` version,
    whose JSON has the fingerprint recorded with it, and whose tokenizer is one of the
    recipe with ``vocab_size`` ids (its settings, :data:`EOT` and :data:`PAD`, the 256
    bytes, merges that make its ids). Otherwise it is retrained, and the file replaced
    only if it is a pdjax entry for that key (stale or edited); a file that is not one
    (another program's, a link, a FIFO) is left untouched, with a warning saying why, and
    the tokenizer is not cached. A tokenizer with fewer ids than asked for (texts that ran
    out of pairs to merge) is not cached: that it is whole could not be checked. Files are
    written atomically, so concurrent processes see a whole file or none.

    Args:
      texts: the training texts (documents), in a fixed order.
      vocab_size: ids wanted, at least 258 (2 special tokens and 256 bytes).
      cache_dir: the cache folder (default :func:`default_cache_dir`).
      cache: read and write the cache; ``False`` always trains.

    Raises:
      DataError: for a ``vocab_size`` below 258, no texts, or ``tokenizers`` missing.
    """
    minimum = len(SPECIAL_TOKENS) + _NUM_BYTES
    _check_integer(vocab_size, "vocab_size")
    if vocab_size < minimum:
        raise DataError(
            f"vocab_size must be at least {minimum} (the special tokens and 256 bytes), "
            f"got {vocab_size}"
        )
    if not texts:
        raise DataError("a tokenizer needs at least one training text")
    tk = _tokenizers()
    if not cache:
        return BPETokenizer(_train(texts, vocab_size))
    version = str(tk.__version__)
    key = _cache_key(texts, vocab_size, version)
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"bpe-{key}.json"
    found = os.path.lexists(path)
    if found:
        cached, ours, why = _read_cache(path, key, vocab_size, version)
        if cached is not None:
            return BPETokenizer(cached, origin="cache")
    tok_json = _train(texts, vocab_size)
    if found and not ours:
        warnings.warn(
            f"{path} is in the way of the tokenizer cache and is not a pdjax cache entry "
            f"for these texts ({why}); it is left as it is and the tokenizer is not cached "
            "(move it away, or pass another cache_dir)",
            stacklevel=2,
        )
        return BPETokenizer(tok_json, origin="trained")
    if _not_asked_for(tok_json, vocab_size) is not None:  # fewer ids: not checkable
        return BPETokenizer(tok_json, origin="retrained" if found else "trained")
    entry = {
        "key": key,
        "fingerprint": tokenizer_fingerprint(tok_json),
        "vocab_size": vocab_size,
        "tokenizers": version,
        "recipe": _RECIPE,
        "tokenizer": tok_json,
    }
    _write_cache(path, entry)
    return BPETokenizer(tok_json, origin="retrained" if found else "trained")


def check_tokenizer(stored: str, data: Dataset | BPETokenizer | str) -> None:
    """Checks that a checkpoint's tokenizer is the data's, by fingerprint.

    Args:
      stored: the fingerprint saved with the checkpoint (:attr:`BPETokenizer.fingerprint`).
      data: the data's tokenizer: a :func:`text_bpe` dataset, a :class:`BPETokenizer`,
        or its fingerprint.

    Raises:
      DataError: if they differ (naming both), or ``data`` is a dataset without a
        tokenizer.
    """
    if isinstance(data, Dataset):
        current = data.info.get("tokenizer_fingerprint")
        if current is None:
            raise DataError(
                f"dataset {data.name!r} has no BPE tokenizer to compare with the "
                f"checkpoint's ({stored})"
            )
    elif isinstance(data, BPETokenizer):
        current = data.fingerprint
    else:
        current = data
    if current != stored:
        raise DataError(
            f"tokenizer mismatch between checkpoint and data: the checkpoint was trained "
            f"with tokenizer {stored}, the data is tokenised with {current}; the same "
            "token ids would stand for different text. The tokenizer is trained on the "
            "training documents, so it changes with vocab_size, seed, test_fraction and "
            "the Python version (the corpus): use the checkpoint's, or start a new run"
        )


# -- packing ----------------------------------------------------------------------------------


def pack(token_docs: Sequence[np.ndarray], eot_id: int, seq_len: int) -> np.ndarray:
    """Documents' tokens joined, each followed by ``eot_id``, cut into windows.

    Windows hold ``seq_len + 1`` tokens and start every ``seq_len`` tokens (a window's
    last token is the next one's first), so inputs ``w[:, :-1]`` and targets
    ``w[:, 1:]`` cover every token once as a target; the tail that fills no window is
    dropped.

    Returns:
      int32 ``(N, seq_len + 1)``.

    Raises:
      DataError: for ``seq_len < 1``, a document that is not a 1-D sequence of token ids
        (integers, non-negative, within int32), or a stream shorter than one window.
    """
    if _check_integer(seq_len, "seq_len") < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    if not token_docs:
        raise DataError("packing needs at least one document")
    eot = _token_ids([_check_integer(eot_id, "eot_id")], "eot_id")
    docs = [_token_ids(d, f"document {i}") for i, d in enumerate(token_docs)]
    stream = np.concatenate([part for d in docs for part in (d, eot)])
    count = (len(stream) - 1) // seq_len
    if count < 1:
        raise DataError(
            f"seq_len {seq_len} is too long: the documents hold {len(stream)} tokens "
            f"with their separators, fewer than one window of {seq_len + 1}"
        )
    index = np.arange(count)[:, None] * seq_len + np.arange(seq_len + 1)
    return np.asarray(stream[index])


@dataclasses.dataclass(frozen=True)
class _Encoded:
    """The split corpus, its tokenizer, each set's documents encoded, and the facts both
    :func:`text_bpe` and :func:`text_bpe_buckets` put in their ``info``."""

    train: tuple[Document, ...]
    test: tuple[Document, ...]
    tok: BPETokenizer
    train_ids: list[np.ndarray]
    test_ids: list[np.ndarray]
    info: dict[str, Any]


def _encoded_corpus(
    seed: int,
    test_fraction: float,
    vocab_size: int,
    cache_dir: str | os.PathLike[str] | None,
    cache: bool,
) -> _Encoded:
    train, test = split_documents(documents(), seed, test_fraction)
    tok = train_tokenizer([d.text for d in train], vocab_size, cache_dir=cache_dir, cache=cache)
    train_ids = tok.encode_batch([d.text for d in train])
    test_ids = tok.encode_batch([d.text for d in test])
    info = {
        "source": f"pydoc_data.topics (Python {platform.python_version()})",
        "tokenizer": "byte-level BPE (tokenizers), trained on the training documents",
        "tokenizer_json": tok.json,
        "tokenizer_fingerprint": tok.fingerprint,
        "tokenizer_vocab": tok.vocab_size,
        "eot_id": tok.eot_id,
        "pad_id": tok.pad_id,
        "documents": len(train) + len(test),
        "corpus_chars": sum(len(d.text) for d in (*train, *test)),
        "test_documents": tuple(d.key for d in test),
        # the documents' tokens and one EOT each
        "train_tokens": sum(map(len, train_ids)) + len(train),
        "test_tokens": sum(map(len, test_ids)) + len(test),
        "seed": seed,
        "test_fraction": test_fraction,
    }
    return _Encoded(train, test, tok, train_ids, test_ids, info)


def text_bpe(
    seq_len: int = 16,
    seed: int = 0,
    test_fraction: float = 0.1,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
    cache: bool = True,
) -> Dataset:
    """Packed BPE windows of CPython's bundled documentation, split by whole documents.

    The documents are split with :func:`split_documents`, the tokenizer is trained on the
    training ones (:func:`train_tokenizer`), and each set is packed with :func:`pack`
    (documents in key order, :data:`EOT` after each), so ``targets[:, t] =
    inputs[:, t + 1]`` and a test window holds only test documents' text. Build the model
    with ``vocab_size`` (``ds.vocab_size``). With the defaults on CPython 3.11: 67
    training documents (144k tokens with their separators) and 12 test ones (16k), 2.9
    characters a token at ``vocab_size=1024`` (4.1 at 4096).

    Args:
      seq_len: tokens per window ``T``, at least 1.
      seed: seed of the document split (a non-negative integer).
      test_fraction: share of the characters held out, in ``(0, 1)``.
      vocab_size: the tokenizer's vocabulary size, at least 258.
      cache_dir: the tokenizer cache (default :func:`default_cache_dir`).
      cache: use the tokenizer cache.

    Returns:
      A :class:`Dataset` named ``"text-bpe"``: int32 inputs and targets ``(N, T)``,
      ``num_classes`` = ``vocab_size``; ``info`` holds the tokenizer (``tokenizer_json``,
      ``tokenizer_fingerprint``, ``eot_id``, ``pad_id``), the test documents' keys and
      the token counts (``train_tokens``, ``test_tokens``: the documents' tokens and
      one :data:`EOT` each). :func:`decode` reads its windows back.

    Raises:
      DataError: for a bad ``seq_len``, ``vocab_size``, ``test_fraction`` or ``seed``,
        or a missing ``tokenizers``.
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be at least 1, got {seq_len}")
    enc = _encoded_corpus(seed, test_fraction, vocab_size, cache_dir, cache)
    tok = enc.tok
    train_w = pack(enc.train_ids, tok.eot_id, seq_len)
    test_w = pack(enc.test_ids, tok.eot_id, seq_len)
    info = {**enc.info, "seq_len": seq_len}
    return Dataset(
        name="text-bpe",
        train_x=train_w[:, :-1],
        train_y=train_w[:, 1:],
        test_x=test_w[:, :-1],
        test_y=test_w[:, 1:],
        num_classes=max(vocab_size, tok.vocab_size),
        info=info,
    )


@functools.lru_cache(maxsize=8)
def _tokenizer_of(tokenizer_json: str) -> BPETokenizer:
    return BPETokenizer(tokenizer_json)


def decode(dataset: Dataset, tokens: np.ndarray) -> str:
    """Token ids back into a string, for a :func:`text_bpe` dataset (through its
    tokenizer) or a character-level :func:`pdjax.apps.data.bpe` one.

    Special tokens read as their strings (``"<|endoftext|>"``); :data:`IGNORE` targets
    are left out.

    Raises:
      DataError: for a dataset without a vocabulary.
    """
    tok_json = dataset.info.get("tokenizer_json")
    if tok_json is None:
        return data_lib.decode(dataset, tokens)
    return _tokenizer_of(tok_json).decode(tokens)


# -- buckets ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Bucket:
    """The examples padded to one length.

    Attributes:
      length: positions per example (the model's sequence length for this bucket).
      inputs: int32 ``(N, length)``, right-padded with the pad token.
      targets: int32 ``(N, length)``, :data:`IGNORE` at padded positions.
    """

    length: int
    inputs: np.ndarray
    targets: np.ndarray

    def __post_init__(self) -> None:
        self.inputs.setflags(write=False)
        self.targets.setflags(write=False)

    @property
    def mask(self) -> np.ndarray:
        """bool ``(N, length)``: ``True`` at real targets (the loss weights)."""
        return np.asarray(self.targets >= 0)

    @property
    def real_tokens(self) -> int:
        """Real (weighted) target positions."""
        return int(self.mask.sum())


@dataclasses.dataclass(frozen=True, eq=False)
class Buckets:
    """Examples in buckets of a few lengths, and one-bucket batches of them.

    Attributes:
      buckets: one :class:`Bucket` per length, ascending; a bucket may hold no example.
    """

    buckets: tuple[Bucket, ...]

    @property
    def lengths(self) -> tuple[int, ...]:
        """The bucket lengths, ascending."""
        return tuple(b.length for b in self.buckets)

    @property
    def num_examples(self) -> int:
        """Examples in all buckets."""
        return sum(len(b.inputs) for b in self.buckets)

    @property
    def real_tokens(self) -> int:
        """Real target positions in all buckets."""
        return sum(b.real_tokens for b in self.buckets)

    @property
    def positions(self) -> int:
        """Target positions in all buckets, padded ones included."""
        return sum(b.targets.size for b in self.buckets)

    @property
    def padding_fraction(self) -> float:
        """The share of positions that are padding (computed but weighted zero)."""
        return 1.0 - self.real_tokens / self.positions if self.positions else 0.0

    def num_batches(self, batch_size: int) -> int:
        """Full one-bucket batches per epoch (each bucket's remainder is dropped)."""
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size}")
        return sum(len(b.inputs) // batch_size for b in self.buckets)

    def batches(
        self, batch_size: int, *, seed: int, epoch: int, start: int = 0
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """One epoch of ``(inputs, targets)`` batches, each from one bucket.

        Each bucket's examples are shuffled with ``(seed, epoch, bucket index)`` and cut
        into full batches (the remainder is skipped this epoch); the batches of all
        buckets are then shuffled together with ``(seed, epoch)``. The order depends on
        nothing else, and ``start=k`` yields what skipping ``k`` batches would, so a run
        resumes as :func:`pdjax.apps.data.dataset.batches` does. A jitted step compiles once
        per bucket length.
        """
        count = self.num_batches(batch_size)
        if not 0 <= start <= count:
            raise DataError(f"start must lie in 0..{count} (batches per epoch), got {start}")
        plan: list[tuple[int, np.ndarray]] = []
        for i, b in enumerate(self.buckets):
            order = generator(seed, epoch, i).permutation(len(b.inputs))
            for k in range(len(b.inputs) // batch_size):
                plan.append((i, order[k * batch_size : (k + 1) * batch_size]))
        shuffled = [plan[j] for j in generator(seed, epoch).permutation(len(plan)).tolist()]

        def generate() -> Iterator[tuple[np.ndarray, np.ndarray]]:
            for i, idx in shuffled[start:]:
                b = self.buckets[i]
                yield b.inputs[idx], b.targets[idx]

        return generate()

    def eval_batches(self, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Every example once, bucket by bucket in order, as
        :func:`pdjax.apps.data.dataset.eval_batches` gives them (padded rows have mask
        ``False``; weight by the row mask and ``targets >= 0``)."""
        for b in self.buckets:
            if len(b.inputs):
                yield from eval_batches(b.inputs, b.targets, batch_size)


def _check_integer(value: Any, what: str) -> int:
    """``value`` if it is an integer (Python's or NumPy's, not a bool); else DataError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise DataError(f"{what} must be an integer, got {value!r}")
    return int(value)


def _check_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
    """The bucket lengths as ints: integers (never a float cut to one), positive,
    strictly ascending."""
    given = tuple(lengths)
    for i, n in enumerate(given):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise DataError(
                f"bucket length {i} is {n!r}: bucket lengths are positions per example, "
                f"whole numbers; pass integers, got {given}"
            )
    out = tuple(int(n) for n in given)
    if not out or any(n < 1 for n in out) or list(out) != sorted(set(out)):
        raise DataError(f"bucket lengths must be positive and strictly ascending, got {given}")
    return out


#: The largest token id an int32 array holds.
_MAX_ID = int(np.iinfo(np.int32).max)


def _token_ids(tokens: Any, what: str, vocab_size: int | None = None) -> np.ndarray:
    """``tokens`` as an int32 array, checked rather than cast: a 1-D sequence of integers
    (not floats, not bools), each a token id, ``0 <= id < vocab_size`` (or within int32).

    Raises:
      DataError: naming ``what`` (``"example 3"``), the offending value and its position,
        and what to pass.
    """
    try:
        ids = np.asarray(tokens)
    except (ValueError, TypeError) as e:  # ragged nesting
        raise DataError(f"{what} is not a sequence of token ids ({e}); pass a 1-D list") from e
    if ids.ndim != 1:
        raise DataError(
            f"{what} has shape {ids.shape}, not a 1-D sequence of token ids; pass each "
            "sequence as one of its own"
        )
    if ids.size == 0:
        return ids.astype(np.int32)
    if ids.dtype.kind not in "iu":
        values = ids.tolist()
        bad = (j for j, t in enumerate(values) if isinstance(t, bool) or not isinstance(t, int))
        first = next(bad, None)
        shown = f" ({values[first]!r} at position {first})" if first is not None else ""
        raise DataError(
            f"{what} holds {ids.dtype} values{shown}: token ids are integers that fit int32; "
            "pass an integer array, not floats, bools or larger integers"
        )
    low, high = int(ids.min()), int(ids.max())
    limit = _MAX_ID + 1 if vocab_size is None else vocab_size
    if low < 0:
        at = int(np.argmin(ids))
        raise DataError(
            f"{what} holds the token id {low} at position {at}: token ids are non-negative "
            f"({IGNORE}, IGNORE, marks a padded target, never a token); pass real token ids"
        )
    if high >= limit:
        at = int(np.argmax(ids))
        room = f"the vocabulary's {vocab_size} ids" if vocab_size is not None else "int32"
        raise DataError(
            f"{what} holds the token id {high} at position {at}, past {room}; pass ids "
            "below it (the tokenizer's own)"
        )
    return ids.astype(np.int32)


def bucket_examples(
    examples: Sequence[np.ndarray],
    lengths: Sequence[int] = DEFAULT_BUCKETS,
    *,
    pad_id: int,
    vocab_size: int | None = None,
) -> Buckets:
    """Token sequences, each padded up to the smallest bucket that holds it.

    An example of ``L + 1`` tokens has ``L`` positions: inputs its first ``L`` tokens,
    targets its last ``L``. It goes to the smallest length ``>= L``; inputs are padded on
    the right with ``pad_id``, targets with :data:`IGNORE`. All examples are checked
    before anything is allocated.

    Nothing is cast: token ids must be integers (a float, even a whole one, is refused,
    as is a bool), non-negative (:data:`IGNORE` is a target's padding, never a token)
    and within int32 (and below ``vocab_size`` if given), the bucket lengths positive
    integers.

    Args:
      examples: 1-D integer token sequences of at least 2 tokens, in a fixed order (kept
        within each bucket).
      lengths: the bucket lengths, strictly ascending positive integers.
      pad_id: the padding token of the inputs.
      vocab_size: the vocabulary's size, to check every id (and ``pad_id``) against.

    Raises:
      DataError: for bad lengths, ``pad_id`` or ``vocab_size``, an example that is not a
        1-D sequence of token ids, one of fewer than 2 tokens, or one with more positions
        than the largest bucket (naming its index, what is wrong and what to pass).
    """
    lengths = _check_lengths(lengths)
    if vocab_size is not None and not 0 < _check_integer(vocab_size, "vocab_size") <= _MAX_ID + 1:
        raise DataError(f"vocab_size must lie in 1..{_MAX_ID + 1}, got {vocab_size}")
    (pad,) = _token_ids([_check_integer(pad_id, "pad_id")], "pad_id", vocab_size).tolist()
    largest = lengths[-1]
    checked = []
    for i, example in enumerate(examples):
        ids = _token_ids(example, f"example {i}", vocab_size)
        if len(ids) - 1 > largest:
            raise DataError(
                f"example {i} has {len(ids) - 1} positions ({len(ids)} tokens), longer "
                f"than the largest bucket, {largest}: cut it (document_examples) or add a "
                f"bucket of at least {len(ids) - 1}"
            )
        if len(ids) < 2:
            raise DataError(f"example {i} has {len(ids)} token(s): it needs at least 2")
        checked.append(ids)
    sizes = np.asarray([len(e) - 1 for e in checked], np.int64)
    which = np.searchsorted(np.asarray(lengths), sizes, side="left")
    buckets = []
    for j, n in enumerate(lengths):
        members = np.flatnonzero(which == j).tolist()
        inputs = np.full((len(members), n), pad, np.int32)
        targets = np.full((len(members), n), IGNORE, np.int32)
        for row, i in enumerate(members):
            e = checked[i]
            inputs[row, : len(e) - 1] = e[:-1]
            targets[row, : len(e) - 1] = e[1:]
        buckets.append(Bucket(n, inputs, targets))
    return Buckets(tuple(buckets))


def document_examples(
    token_docs: Sequence[np.ndarray], eot_id: int, max_len: int, *, split_long: bool = True
) -> list[np.ndarray]:
    """Each document framed by ``eot_id`` on both sides, cut into examples of at most
    ``max_len`` positions.

    A document of ``n`` tokens becomes ``n + 2`` tokens, ``n + 1`` positions: the leading
    :data:`EOT` is the context of its first token, the trailing one its last target.
    Pieces hold ``max_len + 1`` tokens and start every ``max_len`` (a piece's last token
    is the next one's first), so every target appears once.

    Args:
      token_docs: each document's token ids.
      eot_id: the id of :data:`EOT`.
      max_len: the largest bucket's length.
      split_long: cut longer documents; ``False`` refuses them instead.

    Raises:
      DataError: for a document that is not a 1-D sequence of token ids (integers,
        non-negative, within int32), a bad ``eot_id`` or ``max_len``; with
        ``split_long=False``, for a document longer than ``max_len`` positions (naming
        its index, length and ``max_len``), before any cutting.
    """
    if _check_integer(max_len, "max_len") < 1:
        raise DataError(f"max_len must be at least 1, got {max_len}")
    (eot,) = _token_ids([_check_integer(eot_id, "eot_id")], "eot_id").tolist()
    token_docs = [_token_ids(d, f"document {i}") for i, d in enumerate(token_docs)]
    if not split_long:
        for i, d in enumerate(token_docs):
            if len(d) + 1 > max_len:
                raise DataError(
                    f"document {i} has {len(d) + 1} positions, longer than the largest "
                    f"bucket, {max_len}: pass split_long=True or add a bucket of at least "
                    f"{len(d) + 1}"
                )
    out: list[np.ndarray] = []
    for d in token_docs:
        framed = np.concatenate([[eot], d, [eot]]).astype(np.int32)
        for lo in range(0, len(framed) - 1, max_len):
            out.append(framed[lo : lo + max_len + 1])
    return out


def text_bpe_buckets(
    lengths: Sequence[int] = DEFAULT_BUCKETS,
    seed: int = 0,
    test_fraction: float = 0.1,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    split_long: bool = True,
    cache_dir: str | os.PathLike[str] | None = None,
    cache: bool = True,
) -> tuple[Buckets, Buckets, dict[str, Any]]:
    """The corpus of :func:`text_bpe` as whole-document examples in buckets.

    The same split and tokenizer as :func:`text_bpe`; each set's documents go through
    :func:`document_examples` (cut at the largest bucket unless ``split_long`` is
    ``False``) and :func:`bucket_examples`.

    Returns:
      ``(train, test, info)``: the two :class:`Buckets` and the facts :func:`text_bpe`
      puts in its ``info`` (the tokenizer, the test documents, token counts), with
      ``"buckets"`` the lengths and ``"padding_fraction"`` of each set.

    Raises:
      DataError: for bad lengths or settings, or (``split_long=False``) a document
        longer than the largest bucket, checked before the examples are made.
    """
    lengths = _check_lengths(lengths)
    enc = _encoded_corpus(seed, test_fraction, vocab_size, cache_dir, cache)
    tok, train_ids, test_ids = enc.tok, enc.train_ids, enc.test_ids
    if not split_long:  # refuse before cutting or padding either set
        for doc, ids in zip((*enc.train, *enc.test), (*train_ids, *test_ids), strict=True):
            if len(ids) + 1 > lengths[-1]:
                raise DataError(
                    f"document {doc.key!r} has {len(ids) + 1} positions, longer than the "
                    f"largest bucket, {lengths[-1]}: pass split_long=True or add a bucket "
                    f"of at least {len(ids) + 1}"
                )
    sets = [
        bucket_examples(
            document_examples(ids, tok.eot_id, lengths[-1]),
            lengths,
            pad_id=tok.pad_id,
            vocab_size=tok.vocab_size,
        )
        for ids in (train_ids, test_ids)
    ]
    info = {**enc.info, "buckets": lengths}
    info["padding_fraction"] = {
        "train": sets[0].padding_fraction,
        "test": sets[1].padding_fraction,
    }
    return sets[0], sets[1], info
