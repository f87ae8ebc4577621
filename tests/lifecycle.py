"""One lifecycle call on a running request, chosen by (op, x): shared by the property tests of
the allocator and of the vmm backend, so both drive the cache the same way."""


def apply_op(cache, op: str, x: int, running: list) -> bool:
    """extend / step / rollback / finish / flush; True if the op applied. May raise."""
    if op == "flush":
        cache.flush()
        return True
    if not running:
        return False
    if op == "extend":
        cache.extend(running[x % len(running)], 1 + x % 300)
    elif op == "step":
        batch = [r for i, r in enumerate(running) if (x >> i) & 1] or running[:1]
        cache.step(batch, 1 + x % 4)
    elif op == "rollback":
        rid = running[x % len(running)]
        cache.rollback(rid, int(x % (1 + cache.allocator.last_write[cache.allocator.slot_of[rid]])))
    elif op == "finish":
        cache.finish(running.pop(x % len(running)))
    else:
        return False
    return True
