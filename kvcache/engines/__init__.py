"""Engine adapters: kvc's store under an inference engine's own cache.

An engine with a tiered KV cache of its own (SGLang's HiCache, vLLM's KV offloading) can put kvc's L3 store underneath it: the engine
keeps its device and host tiers and hands whole pages to kvc, which keeps them checksummed, namespaced, audited
and shared between processes and nodes. Each adapter here speaks one engine's storage interface and translates
it to the store API (`kvcache.storage`): the engine's page keys become engine-keyed pages
(`kvcache.storage.api.engine_origins`), its host-pool geometry a `KVLayout`, its host pages segment lists that
the store copies to and from without a bounce buffer.

- `sglang`: `KvcStorage`, SGLang's `HiCacheStorage` on any kvc store (loaded through SGLang's
  `--hicache-storage-backend dynamic`); `sglang_pool` reads SGLang's host pools (geometry, page segments);
  `sglang_keys` recomputes SGLang's storage key chain for a prompt (`kvc ns probe`); `sglang_events` decodes
  SGLang's own KV-event feed (`kvc events --engine sglang`).
- `vllm`: `KvcTier`, a secondary tier of vLLM's KV offloading on any kvc store (`tier_class()` builds it on vLLM's
  own base class from `vllm_tier.VLLMTier`, the scheduler's side, with its settings in `vllm_config`, its values in
  `vllm_vocabulary`, its counters in `vllm_counters`, its lookups' verdicts in `vllm_verdicts`);
  `vllm_deployment` turns vLLM's config into the layout of its offloaded chunks; `vllm_io` runs the tier's loads
  and stores off vLLM's thread, with priorities and deadlines, as `vllm_chunks` copies them; `vllm_events` decodes vLLM's own
  KV-event feed, its KV offloading tiers' events included (`kvc events --engine vllm`), the salts vLLM sends among
  each block's extra keys turned into keyed fingerprints.
- `engine_store`: the store an adapter opens, created and refused in one line when it could never name a page.

The lazy-import rule: an engine is never a dependency of kvc. kvc imports and runs without any engine installed,
so a module here imports its engine inside functions only (tests/test_layers.py checks it, and that no module
outside this package imports one). An adapter's class that must subclass an engine's base class is built on
first use, from the engine found then.

Layering: adapters build on the store and the values (`kvcache.storage`, `kvcache.types`, `kvcache.errors`)
and on nothing else of the core; only the CLI imports them.
"""
