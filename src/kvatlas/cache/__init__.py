"""The cache object: pools over the arena, with the allocator and the ledger."""
