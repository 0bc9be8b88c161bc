"""nbcc: a merge-on-read table format with non-blocking concurrency control (Apache Hudi RFC-66).

The engine-independent core: pyarrow and fsspec only. Start with `nbcc.Table`.
"""

from .buckets import bucket_ids, file_group_id
from .errors import (
    CommitError,
    DataFileError,
    InvalidOptionError,
    LockLostError,
    LockTimeoutError,
    NbccError,
    SchemaError,
    StorageError,
    TableConfigError,
    TableExistsError,
    TableNotFoundError,
    TimelineFileError,
)
from .file_slices import FileSlice, build_file_slices
from .history import CommitInfo
from .table import Table
from .timeline import Instant

__version__ = "0.1.0"

__all__ = [
    "Table", "Instant", "CommitInfo", "FileSlice", "build_file_slices", "bucket_ids", "file_group_id",
    "NbccError", "TableNotFoundError", "TableExistsError", "InvalidOptionError", "SchemaError",
    "DataFileError", "TimelineFileError", "LockTimeoutError", "LockLostError", "CommitError", "StorageError",
    "TableConfigError",
]
