"""The paged-memory core, pure JAX state changed by pure functions: the block manager (block
tables, reference counts, free pool, copy-on-write), the prefix cache over it, eviction of
cached blocks, and the K/V pages the blocks index."""
