"""The kvc commands, one module per command group (`kvc.main.COMMANDS` names which module holds which command).

Nothing is imported here: `kvc.main` imports a command's module only when that command runs or its help is asked
for, so `kvc --version` and `kvc --help` load none of them (benchmarks/bench_startup.py).
"""
