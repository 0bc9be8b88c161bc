"""Shared fixtures: one real Spark session (local[2]) and one real S3 API (moto) on loopback."""

from __future__ import annotations

import logging
import os
import sys
import threading
import uuid
from pathlib import Path

import pytest

# Spark's Python workers must run this interpreter (the venv with nbcc installed).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log

SHARED = Path(__file__).resolve().parents[2] / "shared"


@pytest.fixture(scope="session")
def spark():
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("nbcc-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.warehouse.dir", str(Path(os.environ.get("TMPDIR", "/tmp")) / f"nbcc-wh-{uuid.uuid4().hex[:8]}"))
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _atomic_conditional_writes(response_class) -> None:
    """moto (5.2.5) checks If-None-Match and then stores the object in two unlocked steps, one
    request per server thread: two racing conditional writes can both succeed, which S3 never
    allows (a 16-thread race got 2 winners in 60 runs). Serialise its object writes, a PUT and
    the POST that completes a multipart upload, so the fake decides them atomically like S3."""
    lock = threading.Lock()
    for name in ("put_object", "_key_response_post"):
        unlocked = getattr(response_class, name)

        def locked(self, *args, _unlocked=unlocked, **kwargs):
            with lock:
                return _unlocked(self, *args, **kwargs)

        setattr(response_class, name, locked)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (a random free port), with one bucket."""
    from moto.s3.responses import S3Response
    from moto.server import ThreadedMotoServer
    import s3fs

    _atomic_conditional_writes(S3Response)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    options = {"key": "testing", "secret": "testing", "endpoint_url": endpoint}
    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint})
    fs.mkdir("nbcc-tests")
    yield {"endpoint_url": endpoint, "bucket": "nbcc-tests", "storage_options": options}
    server.stop()


@pytest.fixture
def s3_table(s3_server):
    """(uri, storage_options) of a fresh table location on the moto server."""
    return f"s3://{s3_server['bucket']}/t-{uuid.uuid4().hex[:12]}", dict(s3_server["storage_options"])


@pytest.fixture
def local_table(tmp_path):
    """(uri, storage_options) of a fresh table location on local disk."""
    return str(tmp_path / "table"), {}


@pytest.fixture(params=["local", "s3"])
def any_table(request, tmp_path):
    """A fresh table location on local disk, then on the moto S3 server."""
    if request.param == "local":
        return str(tmp_path / "table"), {}
    server = request.getfixturevalue("s3_server")
    return f"s3://{server['bucket']}/t-{uuid.uuid4().hex[:12]}", dict(server["storage_options"])


@pytest.fixture
def memory_uri():
    return f"memory://nbcc-{uuid.uuid4().hex}"
