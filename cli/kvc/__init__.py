"""kvc: the command-line tool over the kvcache core (typer app in `kvc.main`)."""
