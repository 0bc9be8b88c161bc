"""A moto S3 server on 127.0.0.1 for the tests and the soak test, with S3's atomic conditional
writes (moto's own are not: see `_atomic_conditional_writes`)."""

from __future__ import annotations

import logging
import threading
from typing import Any

_patched = False


def _atomic_conditional_writes() -> None:
    """moto (5.2.5) checks If-None-Match and then stores the object in two unlocked steps, one
    request per server thread: two racing conditional writes can both succeed, which S3 never
    allows (a 16-thread race got 2 winners in 60 runs). Serialise its object writes, a PUT and
    the POST that completes a multipart upload, so the fake decides them atomically like S3."""
    global _patched
    if _patched:  # once per process: the server's handlers are class methods
        return
    from moto.s3.responses import S3Response

    lock = threading.Lock()
    for name in ("put_object", "_key_response_post"):
        unlocked = getattr(S3Response, name)

        def locked(self, *args, _unlocked=unlocked, **kwargs):
            with lock:
                return _unlocked(self, *args, **kwargs)

        setattr(S3Response, name, locked)
    _patched = True


def start_server(bucket: str) -> tuple[Any, dict[str, Any]]:
    """A running server (a free port) holding an empty `bucket`: (server, storage options)."""
    from moto.server import ThreadedMotoServer
    import s3fs

    _atomic_conditional_writes()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://{host}:{port}"}
    s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": options["endpoint_url"]}).mkdir(bucket)
    return server, options
