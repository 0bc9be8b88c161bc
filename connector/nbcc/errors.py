"""Errors raised by nbcc. Every message says what is wrong and how to fix it."""


class NbccError(Exception):
    """Base class of every error nbcc raises on purpose."""


class TableNotFoundError(NbccError):
    """The URI holds no nbcc table (no `.nbcc/table.json`)."""


class TableExistsError(NbccError):
    """`Table.create` was called on a URI that already holds a table."""


class TableConfigError(NbccError):
    """`.nbcc/table.json` is damaged: not JSON, or a field is missing or invalid."""


class InvalidOptionError(NbccError, ValueError):
    """An option or argument is unknown or has a bad value."""


class SchemaError(NbccError, ValueError):
    """Data does not fit the table's schema, or a record key / ordering value is invalid."""


class TimelineFileError(NbccError):
    """A file on the timeline (a commit's metadata, a compaction's or a clean's plan) is damaged:
    not JSON, or without a field every reader needs."""


class DataFileError(NbccError):
    """A committed data file is missing or unreadable; the read stops rather than drop rows."""


class LockTimeoutError(NbccError):
    """The table lock could not be taken in time."""


class LockLostError(NbccError):
    """The lock's lease ran out before the critical step; nothing was committed."""


class CommitError(NbccError):
    """A commit could not be completed (for example its instant is not pending)."""


class StorageError(NbccError):
    """The storage cannot do what nbcc needs (for example put-if-absent)."""
