"""Shared fixtures: one real Spark session (local[2]) and one real S3 API (moto) on loopback."""

from __future__ import annotations

import logging
import os
import sys
import uuid
from pathlib import Path

import pytest

# Spark's Python workers must run this interpreter (the venv with nbcc installed).
os.environ["PYSPARK_PYTHON"] = sys.executable
os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's per-request access log


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


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 (a random free port), with one bucket."""
    from moto_s3 import start_server

    server, options = start_server("nbcc-tests")
    yield {"endpoint_url": options["endpoint_url"], "bucket": "nbcc-tests", "storage_options": options}
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
def children(tmp_path):
    """Child processes of one test (tests/children.py); any still running at its end is killed."""
    from children import Children

    work = tmp_path / "children"
    work.mkdir()
    kids = Children(work)
    yield kids
    kids.close()


@pytest.fixture
def memory_uri():
    return f"memory://nbcc-{uuid.uuid4().hex}"
