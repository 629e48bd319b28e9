"""Pipeline schedules (and, with pipeline parallelism, point-to-point communication)."""
