"""Fine-tuning records (JSONL, Parquet, datasets' save_to_disk) as packed, trainable rows.

`build_rows(data, path=..., seq_len=..., vocab_size=..., seed=...)` reads the records, turns each into a
token document with a mask of trained tokens (chat templates rendered like Hugging Face's
apply_chat_template), caches the documents and the packed row index on disk, and returns `PackedRows`,
whose `rows(indices)` gives inputs / labels / segment_ids / positions for global sample indices.
"""
from jaxmem.io.documents.build import CACHE_VERSION, build_rows, cache_dir
from jaxmem.io.documents.chat import ChatTemplate
from jaxmem.io.documents.packing import IGNORE_INDEX, PAD_SEGMENT, PackedRows
from jaxmem.io.documents.reading import RECORD_KINDS

__all__ = ["CACHE_VERSION", "ChatTemplate", "IGNORE_INDEX", "PAD_SEGMENT", "PackedRows", "RECORD_KINDS",
           "build_rows", "cache_dir"]
