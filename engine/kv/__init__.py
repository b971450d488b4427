"""KV blocks: the block pool (prefix hashes, copy-on-write), the cache manager that maps sequences to blocks, the cache
tensor, block export / import."""
