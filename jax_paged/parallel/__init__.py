"""Parallelism: tensor parallelism over a device mesh (`sharding`) and data-parallel replicas
of whole engines (`data_parallel`)."""
