"""Storage options: the S3 settings a table is opened with (those of s3fs.S3FileSystem), checked
and coerced from the text that Spark options and the CLI give.

An unknown name is an error, not ignored; a dict or boolean option given in another form is
refused before anything is written. A table not on S3 takes no options and ignores S3 ones, so
one job's settings can serve S3 and local tables alike.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Mapping

import fsspec

from .errors import InvalidOptionError, StorageError

log = logging.getLogger(__name__)


# S3 options whose values are text, however they look (a digit-only key or secret is one).
_S3_TEXT_OPTIONS = frozenset({"key", "secret", "token", "username", "password", "profile", "endpoint_url",
                              "region_name"})
# Options s3fs takes through **kwargs: fsspec's listing cache and the botocore session's profile.
_S3_EXTRA_OPTIONS = frozenset({"use_listings_cache", "listings_expiry_time", "max_paths", "profile",
                               "skip_instance_cache"})
# Not options a user can give as text, or ones nbcc must own.
_S3_REFUSED_OPTIONS = frozenset({"self", "kwargs", "asynchronous", "loop", "session"})


def _s3_parameters() -> dict[str, Any]:
    import inspect

    import s3fs

    return dict(inspect.signature(s3fs.S3FileSystem.__init__).parameters)


@functools.lru_cache(maxsize=None)
def _s3_option_names() -> frozenset[str]:
    return (frozenset(_s3_parameters()) - _S3_REFUSED_OPTIONS) | _S3_EXTRA_OPTIONS | {"region_name"}


# Options s3fs takes as dicts: client_kwargs, config_kwargs, s3_additional_kwargs. Their default
# is None, so the signature cannot tell; s3fs names every dict it hands on to botocore `*_kwargs`.
_S3_DICT_SUFFIX = "_kwargs"
# Boolean options that s3fs takes through **kwargs, so no signature default tells their type.
_S3_EXTRA_BOOL_OPTIONS = frozenset({"use_listings_cache", "skip_instance_cache"})


@functools.lru_cache(maxsize=None)
def _s3_option_kinds() -> tuple[frozenset[str], frozenset[str]]:
    """(dict options, boolean options) of s3fs.S3FileSystem. A parameter whose default is a
    bool is a boolean: s3fs would take any other value (a string "maybe") as true."""
    params = _s3_parameters()
    dicts = frozenset(n for n in params if n.endswith(_S3_DICT_SUFFIX)) - _S3_REFUSED_OPTIONS
    bools = frozenset(n for n, p in params.items() if isinstance(p.default, bool)) - _S3_REFUSED_OPTIONS
    return dicts, bools | _S3_EXTRA_BOOL_OPTIONS


def _coerce(name: str, value: Any) -> Any:
    """Option values arrive as strings from Spark and the CLI; fsspec wants booleans, numbers
    and, for s3fs's `client_kwargs` and the like, dicts (given as JSON objects). A dict or
    boolean option given as anything else is refused here: s3fs would fail later with a raw
    AttributeError, or take any text as true."""
    dicts, bools = _s3_option_kinds()
    if name in dicts:
        if isinstance(value, str):
            try:
                parsed = json.loads(value)
            except ValueError as exc:
                raise InvalidOptionError(f"storage option {name}={value!r} is not a JSON object ({exc}); "
                                         f"give one, e.g. {name}={{\"key\": \"value\"}}") from None
        else:
            parsed = value
        if parsed is None and not isinstance(value, str):  # s3fs's default, from Python
            return None
        if not isinstance(parsed, dict):
            raise InvalidOptionError(f"storage option {name}={value!r} is not a JSON object; give one, "
                                     f"e.g. {name}={{\"key\": \"value\"}}")
        return parsed
    if name in bools:
        low = value.strip().lower() if isinstance(value, str) else value
        if low in ("true", "false"):
            return low == "true"
        if isinstance(value, bool):
            return value
        raise InvalidOptionError(f"storage option {name}={value!r} is not a boolean; give true or false")
    if not isinstance(value, str) or name in _S3_TEXT_OPTIONS:
        return value
    text = value.strip()
    if text.startswith("{"):
        try:
            parsed = json.loads(text)
        except ValueError as exc:
            raise InvalidOptionError(f"storage option {name}={value!r} is not a JSON object: {exc}") from None
        if not isinstance(parsed, dict):
            raise InvalidOptionError(f"storage option {name}={value!r} is not a JSON object")
        return parsed
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(text)
    except ValueError:
        return value


def check_storage_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`options` checked (an unknown name, or a dict or boolean option given as anything else, is
    an InvalidOptionError) and coerced from text to what s3fs takes."""
    valid = _s3_option_names()
    unknown = sorted(set(options) - valid)
    if unknown:
        raise InvalidOptionError(
            f"unknown S3 storage option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; the options "
            f"are those of s3fs.S3FileSystem: {', '.join(sorted(valid))}")
    opts = {name: _coerce(name, value) for name, value in options.items()}
    endpoint = opts.get("endpoint_url")
    if endpoint is not None and not str(endpoint).lower().startswith(("http://", "https://")):
        raise InvalidOptionError(f"storage option endpoint_url={endpoint!r} needs its scheme: "
                                 f"http://{endpoint} or https://{endpoint}")
    return opts


def is_relative_path(uri: str) -> bool:
    """Is `uri` a local path relative to the current folder (perhaps an S3 URI without s3://)?"""
    return "://" not in uri and not os.path.isabs(uri)


def filesystem_options(uri: str, options: dict[str, Any]) -> dict[str, Any]:
    """The fsspec options for `uri`: checked (an unknown name is an error, not ignored) and
    coerced; a table not on S3 takes none, and ignores S3 options. On S3, fsspec's listing
    cache is off unless asked for: it never expires, so a long-lived process would go on missing
    files that other processes committed."""
    s3 = fsspec.utils.get_protocol(uri) in ("s3", "s3a")
    if not options:
        return {"use_listings_cache": False} if s3 else {}
    try:
        # Checked on any table: the same settings would fail on an S3 table.
        opts = check_storage_options(options)
    except ImportError as exc:
        raise StorageError(f"cannot open storage for {uri!r}: {exc}; install s3fs") from exc
    if not s3:
        # One job's settings often serve S3 and local tables alike: S3 options mean nothing here.
        # With a relative path, though, the s3:// was most likely left out.
        relative = is_relative_path(uri)
        (log.warning if relative else log.debug)(
            "storage options %s ignored: %s is not on S3%s", sorted(options), uri,
            f" but a folder under the current one ({os.path.abspath(uri)}); for S3, write s3://{uri}"
            if relative else "")
        return {}
    region = opts.pop("region_name", None)
    if region is not None:  # s3fs takes it only inside client_kwargs
        client = opts.get("client_kwargs") or {}  # a dict: _coerce checked it
        opts["client_kwargs"] = {**client, "region_name": region}
    opts.setdefault("use_listings_cache", False)
    return opts
