"""The cache: what holds the bytes. The arena (one slab, or a `vmm` reservation) carved into pools
(`pools`), the ledger of every measure (`ledger`), the storage audit of any object graph
(`audit`), and `KVCache`, which joins them to the allocator (`kvatlas.alloc`)."""
