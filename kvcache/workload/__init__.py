"""Workload tools, above the cache: traces of requests (`traces`), synthetic KV bytes that verify themselves
(`kvdata`), the replay driver that runs a trace through a cache as an engine would (`replay`), and the capacity
sweep that replays a trace once per combination of tier sizes without KV bytes (`sweep`). The cache never imports
them. (Namespace warming from L3 is an operation: `kvcache.ops.warm`.)
"""
