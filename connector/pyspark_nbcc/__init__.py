"""PySpark connector for nbcc tables.

Installing the package is enough: Spark finds `DefaultSource` in this `pyspark_*` module and
registers it as `nbcc`, so `spark.read.format("nbcc")` and `df.write.format("nbcc")` just work.
"""

from .helpers import (build_index, compact, configure, options_from_conf, repartition_by_bucket, set_active_session,
                      spark_conf, spark_conf_path)
from .source import DefaultSource

__all__ = ["DefaultSource", "build_index", "compact", "configure", "options_from_conf", "repartition_by_bucket",
           "set_active_session", "spark_conf", "spark_conf_path"]
