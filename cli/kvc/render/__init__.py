"""How kvc shows what it got: safe text (`text`), the output formats and listings (`output`), and one module per
view — audit findings, store and cache figures, namespaces, replay reports, `kvc top`, Prometheus text, progress.

Commands (offline) and the socket client (`kvc.live`, with --socket) render through here, so a live answer and
an offline one print alike. Nothing is imported here, and rich only when something draws with it: a command that
prints tsv or JSON never loads rich.
"""
