"""ndweave.data: a resumable packed token stream for nD-parallel training.

``prepare`` tokenizes local text once into memmapped shards (cached by a hash of the data, the
tokenizer and the settings); ``PackedDataset`` cuts them into fixed-size samples (``"concat"``,
``"documents"`` with restarting positions and a block-diagonal ``document_mask``, ``"first_fit"``
for SFT, ``"none"``), sample ``k`` a pure function of ``k``; ``Mixture`` weighs several datasets;
``TokenStream`` hands each DP rank its slice of every global batch and keeps the one small state,
``{"samples_seen": int}``, that resumes the stream exactly on any mesh.
"""

from ndweave.data.chat import DEFAULT_CHAT_TEMPLATE, tokenize_chat
from ndweave.data.mask import document_mask
from ndweave.data.mixture import Mixture
from ndweave.data.packing import PACKINGS, PackedDataset
from ndweave.data.prepare import prepare
from ndweave.mesh.contracts import rank_slice
from ndweave.data.shards import Shards
from ndweave.data.sources import data_files, read_records
from ndweave.data.stream import StreamSampler, TokenStream
from ndweave.data.tokenizer import TextTokenizer

__version__ = "0.2.0"

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "Mixture",
    "PACKINGS",
    "PackedDataset",
    "Shards",
    "StreamSampler",
    "TextTokenizer",
    "TokenStream",
    "__version__",
    "data_files",
    "document_mask",
    "prepare",
    "rank_slice",
    "read_records",
    "tokenize_chat",
]
