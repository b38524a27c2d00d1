"""Token data: memory-mapped token files, the byte-level default corpus, deterministic batches.

``TokenDataset`` reads nanoGPT-style ``.bin`` files (+ metadata); ``default_corpus_path()`` builds and
caches byte tokens of the stdlib's own sources; ``get_batch`` is a pure function of
(seed, step, micro-batch, rank layout). Sample files (``SampleWriter``; ``TokenDataset.has_loss_mask``)
hold unpacked samples with a loss mask; ``get_batch`` gives them one per row, label -100 where untrained.
``sysx data`` (``sysx.data.prepare``) makes and inspects files.
"""

from sysx.data.corpus import cache_dir, default_corpus_path, ensure_default_corpus
from sysx.data.dataset import TokenDataset
from sysx.data.errors import DataError
from sysx.data.format import TokenWriter, dtype_for_vocab
from sysx.data.sample_batch import IGNORE_INDEX, check_samples_fit
from sysx.data.sample_format import SampleWriter
from sysx.data.sampler import get_batch, step_trained_tokens
from sysx.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "DataError",
    "HFTokenizer",
    "SampleWriter",
    "TokenDataset",
    "TokenWriter",
    "cache_dir",
    "check_samples_fit",
    "default_corpus_path",
    "dtype_for_vocab",
    "ensure_default_corpus",
    "get_batch",
    "load_tokenizer",
    "step_trained_tokens",
]
