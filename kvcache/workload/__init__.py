"""Workload tools, above the cache: traces of requests (`traces`), synthetic KV bytes that verify themselves
(`kvdata`), the replay driver that runs a trace through a cache as an engine would (`replay`), and namespace
warming from L3 (`warm`). The cache never imports them.
"""
