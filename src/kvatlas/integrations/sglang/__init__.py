"""kvatlas inside SGLang: the plugin that makes a DeepSeek-V4 server report its KV cache truthfully.

Modules (importing this package imports nothing of SGLang; SGLang's `load_plugins()` imports
`plugin` early in every process, so `plugin` itself stays light):
- `plugin`: the `sglang.srt.plugins` entry point (`register`), its hooks on SGLang's pools and
  scheduler, the ledger it fills, and `build_offline` (SGLang's own pools built on a CPU).
- `prefix`: SGLang's radix cache beside its pools: evictable pages and the SWA prefix-tail quota.
"""
