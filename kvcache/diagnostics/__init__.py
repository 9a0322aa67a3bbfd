"""Diagnostics that read the tiers without changing them: the ownership state of a cache (`ownership`), the audit
of that state and of a store (`audit`), and snapshots of it for an offline audit (`snapshot`).
"""
